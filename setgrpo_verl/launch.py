"""Compose and run verl's ``main_ppo`` for the stages of a SetGRPO run: calibrate, train, the GRPO baseline.

Every stage is one ``python -m verl.trainer.main_ppo`` process (verl's own trainer, Ray, FSDP2 workers, reward
loop); this module only writes the data files, composes the Hydra overrides, runs the command and keeps the run
directory tidy. Nothing here trains, scores or calibrates.

* ``calibrate``: ``--config-name setgrpo_trainer`` with ``algorithm.setgrpo.calibration.only=true``: the SetGRPO
  trainer mode rolls out the calibration prompts, scores each response twice, sketches and writes the frozen
  record (``docs/algorithm.md#7-record``).
* ``train``: the same config with ``algorithm.setgrpo.record_path`` set to that record.
* ``grpo``: verl's stock ``ppo_trainer`` with ``algorithm.adv_estimator=grpo``, same data, seeds and reward.

On a machine without accelerators (the default of the embedded profiles) :func:`cpu_overrides` and
``VERL_PLATFORM=cpu`` select the CPU backend of :mod:`setgrpo_verl.verl_cpu`.

Run directory::

    <run-dir>/data/{calibration,train}.parquet   verl RL rows (prompt, rubric as reward_model.ground_truth)
    <run-dir>/data/split.json                     the split's settings and prompt ids (what train checks against)
    <run-dir>/<stage>/command.sh                  the exact verl command line (copy it to a cluster)
    <run-dir>/<stage>/main_ppo.log                everything verl printed
    <run-dir>/<stage>/metrics.jsonl               verl's file logger (one line per step)
    <run-dir>/calibration/record.json             the frozen calibration record
    <run-dir>/calibration/paired_scores.npz       point [G,K], reference [G,K], gram [G,K,K] of the calibration
    <run-dir>/train_setgrpo/groups.jsonl          per step and group: status, recovery ratio, projections
    <run-dir>/<stage>/COMPLETE | FAILED           written last
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

__all__ = [
    "COMPLETE",
    "FAILED",
    "STAGES",
    "LaunchError",
    "CPU_PRECISIONS",
    "DEFAULT_DATA",
    "SPLIT_FILE",
    "check_data_split",
    "check_split_flags",
    "check_stage_dirs",
    "check_training_prompts",
    "cpu_bf16_units",
    "cpu_overrides",
    "cpu_precision",
    "existing_split",
    "format_override",
    "main_ppo_command",
    "requested_settings",
    "split_data",
    "write_data",
    "latest_checkpoint_step",
    "run_stage",
    "stage_overrides",
]

#: Marker written last into a finished stage directory; its absence means "incomplete".
COMPLETE = "COMPLETE"
#: Marker of a failed stage (holds the reason).
FAILED = "FAILED"
#: Stage directory of each stage. ``calibrate_train`` is one verl process that calibrates (record and paired scores
#: in ``calibration/``) and then trains, saving the start-up of a second process.
STAGES = {"calibrate": "calibration", "train": "train_setgrpo", "calibrate_train": "train_setgrpo",
          "grpo": "train_grpo"}


class LaunchError(ValueError):
    """Bad input found before verl starts (missing file, invalid rubric row, too few prompts, bad flag) or a stage
    that failed; the message names the fix. The CLI prints it as ``error: ...`` and exits with status 2."""


def format_override(key: str, value: Any) -> str:
    """One Hydra override ``key=value`` with ``value`` in Hydra's grammar (lists, null, quoted strings).

    A key starting with ``+`` adds a key that the composed config does not have.
    """
    return f"{key}={_hydra_value(value)}"


def _hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if text and all(c.isalnum() or c in "_-./:@" for c in text) and text not in ("true", "false", "null"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


#: Precisions of the CPU backend: ``bf16`` is the GPU recipes' (bf16 parameters and compute, float32 gradient
#: reductions and buffers over float32 master weights, a bf16 rollout), ``fp32`` runs everything in float32.
CPU_PRECISIONS = ("bf16", "fp32")

#: ``/proc/cpuinfo`` flags of CPU units that compute in bf16 (AVX-512 BF16, AMX BF16 tiles).
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")

logger = logging.getLogger(__name__)


def cpu_bf16_units(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> tuple[str, ...]:
    """The bf16 compute units this CPU reports (``avx512_bf16``, ``amx_bf16``), empty where it has none or the
    file does not exist (a system without ``/proc/cpuinfo`` is treated as having none)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return ()
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return tuple(f for f in _BF16_FLAGS if f in flags)


@functools.lru_cache(maxsize=None)
def cpu_precision() -> str:
    """The CPU backend's default precision on this machine: ``bf16`` where the CPU has bf16 units
    (:func:`cpu_bf16_units`), else ``fp32``, saying so in one log line (per process)."""
    if cpu_bf16_units():
        return "bf16"
    logger.warning("this CPU has no bf16 units (AVX-512 BF16 or AMX): the CPU backend runs in float32, not in the "
                   "GPU recipes' bf16 (bf16 emulation would be several times slower)")
    return "fp32"


def cpu_overrides(actor_ranks: int = 1, precision: Optional[str] = None) -> list[str]:
    """verl settings of a CPU run on one machine (with ``VERL_PLATFORM=cpu`` in the environment).

    A new local Ray instance for every run (``ray.init`` would otherwise join any Ray instance already running on
    the machine, e.g. another run's, and wait for its logical GPUs). ``actor_ranks`` FSDP2 ranks on gloo, each
    holding one logical Ray ``GPU`` (Ray's CPU count is logical too:
    verl asks several CPUs per worker, more than a small machine has); eager attention and no remove-padding (no
    flash-attention kernels); the ``transformers`` rollout, kept resident (no sleep / wake-up), decoding at most 64
    sequences at once (its key-value cache lives in host memory) and synced with full weights; one agent-loop worker, one reward worker and one TransferQueue storage unit.

    Precision (docs/verl_integration.md#cpu-backend): ``bf16`` is what the GPU recipes run, verl's FSDP mixed
    precision (float32 master weights, bf16 parameters and autocast compute, float32 gradient reductions and
    buffers) for the actor and reference, and a bf16 rollout; ``fp32`` runs all of them in float32.

    Args:
        actor_ranks: FSDP2 ranks, an int >= 1.
        precision: ``"bf16"``, ``"fp32"`` or None for :func:`cpu_precision` (bf16 where the CPU has bf16 units).

    Raises:
        LaunchError: ``precision`` is not one of :data:`CPU_PRECISIONS`.
    """
    precision = cpu_precision() if precision is None else precision
    if precision not in CPU_PRECISIONS:
        raise LaunchError(f"CPU precision {precision!r}: use one of {', '.join(CPU_PRECISIONS)}")
    compute, rollout_dtype = ("bf16", "bfloat16") if precision == "bf16" else ("fp32", "float32")
    mixed = f"{{param_dtype:{compute},reduce_dtype:fp32,buffer_dtype:fp32}}"
    return [
        "trainer.device=cpu",
        f"trainer.n_gpus_per_node={actor_ranks}",
        "trainer.nnodes=1",
        "+ray_kwargs.ray_init.address=local",
        f"+ray_kwargs.ray_init.num_gpus={actor_ranks}",
        f"ray_kwargs.ray_init.num_cpus={4 * actor_ranks + 8}",
        "+ray_kwargs.ray_init.include_dashboard=false",
        "actor_rollout_ref.model.use_remove_padding=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={mixed}",
        "actor_rollout_ref.ref.strategy=fsdp2",
        f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={mixed}",
        "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.rollout.name=transformers",
        f"actor_rollout_ref.rollout.dtype={rollout_dtype}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.free_cache_engine=false",
        "actor_rollout_ref.rollout.max_num_seqs=64",
        "actor_rollout_ref.rollout.load_format=auto",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "data.dataloader_num_workers=0",
        "reward.num_workers=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


def cpu_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a CPU run: ``VERL_PLATFORM=cpu`` (read by every verl process, Ray workers included) and
    quiet, single-tokenizer-thread defaults; explicit settings in ``base`` win except ``VERL_PLATFORM``."""
    env = dict(os.environ if base is None else base)
    env["VERL_PLATFORM"] = "cpu"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    env.setdefault("HYDRA_FULL_ERROR", "1")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def main_ppo_command(overrides: Sequence[str], *, config_name: str = "setgrpo_trainer") -> list[str]:
    """``python -m verl.trainer.main_ppo --config-name <config_name> <overrides>`` as an argument list.

    ``setgrpo_trainer`` (our Hydra config: verl's ``ppo_trainer`` plus ``algorithm.setgrpo``) is found through the
    package's Hydra search-path plugin, like verl's own; ``ppo_trainer`` is verl's stock config.
    """
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-name", config_name]
    return cmd + list(overrides)


#: The embedded default data of :func:`split_data` without ``data``: ``ifbench`` (the IFBench prompts) or
#: ``validation`` (under ``rules_only``: the composite validation rubrics, docs/validation.md#validation-rubrics).
DEFAULT_DATA = ("ifbench", "validation")


def _rubric_rows(data: str | os.PathLike | None, rules_only: bool = False,
                 default_data: str = "ifbench") -> tuple[list[dict], str]:
    from .grading import load_ifbench_rubrics, load_validation_rubrics, read_rubric_rows

    if default_data not in DEFAULT_DATA:
        raise LaunchError(f"default data {default_data!r}: use one of {', '.join(DEFAULT_DATA)}")
    if data is None:
        if rules_only and default_data == "validation":
            return load_validation_rubrics(), "the embedded composite validation rubrics (rule criteria only)"
        if rules_only:
            return load_ifbench_rubrics(rules_only=True), "the embedded IFBench rubric conversion (rule criteria only)"
        return load_ifbench_rubrics(), "the embedded IFBench rubric conversion"
    path = Path(data).expanduser()
    if not path.is_file():
        raise LaunchError(f"--data {data}: no such file; pass a RubricHub-format .jsonl/.json/.parquet file (rows "
                          "with id, question, rubrics) or omit --data for the embedded IFBench prompts")
    try:
        return read_rubric_rows(path), str(path)
    except (ValueError, OSError) as exc:  # the message names the file, line, row, criterion and field
        raise LaunchError(f"--data: {exc}") from None


def split_data(
    *,
    data: str | os.PathLike | None,
    model_path: str | os.PathLike,
    max_prompt_length: int,
    calibration_prompts: int,
    seed: int,
    rules_only: bool = False,
    default_data: str = "ifbench",
) -> dict[str, Any]:
    """Validate the rubric rows, drop overlong prompts, shuffle and split them into verl RL rows (nothing written).

    With ``rules_only`` (the ``rules`` grader) the embedded default is the IFBench rows with their rule criteria only,
    or with ``default_data="validation"`` (``setgrpo-verl validate``) the composite validation rubrics
    (:func:`setgrpo_verl.grading.load_validation_rubrics`, docs/validation.md#validation-rubrics), and every
    criterion of a ``data`` file must carry a rule. Without ``rules_only`` the default is the IFBench rows with
    their judged criteria whatever ``default_data`` says.

    The first ``calibration_prompts`` rows of the ``seed``-shuffled file go to ``data/calibration.parquet``, the rest
    to ``data/train.parquet`` (disjoint, so calibration groups stay exchangeable with fresh ones and training never
    reuses them). Prompts whose chat-formatted length exceeds ``max_prompt_length`` tokens are dropped, as verl's
    ``data.filter_overlong_prompts`` would, but before the split so that the counts are exact.

    A prompt that appears more than once (the same id, or the same question text up to whitespace and case,
    :func:`setgrpo_verl.core.question_key`) is kept once, at its first row, so the two parts stay disjoint.

    Returns:
        ``{"calibration": [rows], "train": [rows], "source": str, "duplicates": int (rows removed),
        "settings": dict (the arguments)}`` for :func:`write_data`.

    Raises:
        LaunchError: unreadable file, an invalid row (the message names the row, criterion and field), a criterion
            without a rule under ``rules_only``, fewer usable prompts than ``calibration_prompts`` + 1, or
            ``default_data`` not in :data:`DEFAULT_DATA`.
    """
    from transformers import AutoTokenizer

    from .grading import as_rubric, rubrics_to_verl_rows

    from .core import question_key

    rows, source = _rubric_rows(data, rules_only, default_data)
    try:
        rubrics = [as_rubric(row) for row in rows]
    except (ValueError, TypeError) as exc:
        raise LaunchError(f"{source}: {exc}; fix or remove that row") from None
    # a prompt that appears twice (same id, or same question text) would land in both parts of the split
    seen_ids: set[str] = set()
    seen_questions: set[str] = set()
    unique = []
    for rubric in rubrics:
        text = question_key(rubric.question)
        if str(rubric.id) in seen_ids or text in seen_questions:
            continue
        seen_ids.add(str(rubric.id))
        seen_questions.add(text)
        unique.append(rubric)
    duplicates, rubrics = len(rubrics) - len(unique), unique
    for rubric in rubrics:
        if not any(c.points > 0 for c in rubric.criteria):
            raise LaunchError(f"{source}: rubric row {rubric.id!r} has no criterion with positive points, so its score "
                              "(sum of met points / sum of positive points) is undefined; add one or remove the row")
        judged = [j for j, c in enumerate(rubric.criteria) if c.rule is None]
        if rules_only and judged:
            raise LaunchError(f"{source}: rubric row {rubric.id!r}, criterion {judged[0]} has no rule, but --judge rules "
                              "checks rule criteria only; give every criterion a rule or choose a judge")
    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    verl_rows = rubrics_to_verl_rows(rubrics)
    kept = []
    for row in verl_rows:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(ids) <= max_prompt_length:
            kept.append(row)
    if len(kept) <= calibration_prompts:
        more = "pass more prompts with --data"
        if data is None and rules_only and default_data == "validation":
            more += (f" (more validation rubrics, the embedded ones first: python scripts/make_validation_rubrics.py "
                     f"compose --rows {calibration_prompts + 500} --out rubrics.jsonl, then --data rubrics.jsonl)")
        raise LaunchError(f"{source}: {len(kept)} of {len(rubrics)} prompts fit in {max_prompt_length} prompt tokens, "
                          f"but calibration needs {calibration_prompts} and training at least one more; raise "
                          f"--max-prompt-length, lower --calib-groups or {more}")
    random.Random(seed).shuffle(kept)
    calibration, train = kept[:calibration_prompts], kept[calibration_prompts:]
    for split, part in (("calibration", calibration), ("train", train)):
        for i, row in enumerate(part):
            row["extra_info"] = {**row["extra_info"], "index": i, "split": split}
    settings = {"data": None if data is None else str(Path(data).expanduser().resolve()),
                "calibration_prompts": int(calibration_prompts), "seed": int(seed),
                "max_prompt_length": int(max_prompt_length), "rules_only": bool(rules_only),
                "default_data": None if data is not None else default_data}
    return {"calibration": calibration, "train": train, "source": source, "duplicates": duplicates,
            "settings": settings}


#: The data split's settings file (what :func:`split_data` was called with), next to the parquet files.
SPLIT_FILE = "split.json"


def _split_ids(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(row["extra_info"]["id"]) for row in rows]


def write_data(run_dir: str | os.PathLike, split: Mapping[str, Any]) -> dict[str, Path]:
    """Write :func:`split_data`'s rows as ``<run_dir>/data/{calibration,train}.parquet`` and its settings and prompt
    ids as ``data/split.json``; returns the two parquet paths."""
    from .grading import write_verl_parquet

    out = Path(run_dir) / "data"
    paths = {name: write_verl_parquet(split[name], out / f"{name}.parquet") for name in ("calibration", "train")}
    meta = {**split.get("settings", {}), "source": split["source"], "duplicates_removed": split.get("duplicates", 0),
            "ids": {name: _split_ids(split[name]) for name in ("calibration", "train")}}
    (out / SPLIT_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return paths


def existing_split(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The ``data/split.json`` of a run directory, or None when it has no data split.

    Raises:
        LaunchError: parquet files without a readable ``split.json`` (a run directory of an older version).
    """
    data = Path(run_dir) / "data"
    if not any((data / f"{n}.parquet").exists() for n in ("calibration", "train")):
        return None
    try:
        return json.loads((data / SPLIT_FILE).read_text())
    except (OSError, ValueError):
        raise LaunchError(f"{data} holds a data split without a readable {SPLIT_FILE}: pass --overwrite to split the "
                          "data again, or choose another --run-dir") from None


def check_data_split(run_dir: str | os.PathLike, split: Mapping[str, Any], *, overwrite: bool) -> bool:
    """Whether :func:`write_data` must write ``split`` into ``run_dir``: True for a run directory without a split,
    False when the existing split holds exactly these prompts (it stays untouched).

    Raises:
        LaunchError: without ``overwrite``, an existing split of other prompts (the message names how many
            calibration prompts would move and the fix).
    """
    if overwrite:
        return True
    old = existing_split(run_dir)
    if old is None:
        return True
    new = {name: _split_ids(split[name]) for name in ("calibration", "train")}
    if old.get("ids") == new:
        return False
    moved = len(set(old.get("ids", {}).get("calibration", [])) - set(new["calibration"]))
    raise LaunchError(f"{Path(run_dir) / 'data'} already holds another data split (from {old.get('source')}, "
                      f"seed {old.get('seed')}, {old.get('calibration_prompts')} calibration prompts); these settings "
                      f"would move {moved} of its calibration prompts: pass --overwrite to replace the run, or choose "
                      "another --run-dir")


def check_split_flags(run_dir: str | os.PathLike, *, data: str | os.PathLike | None, calib_groups: int | None) -> None:
    """``train`` uses the split that ``calibrate`` wrote: ``--data`` / ``--calib-groups`` must name that split.

    Raises:
        LaunchError: a flag that differs from the run directory's ``data/split.json`` (both values named).
    """
    if data is None and calib_groups is None:
        return
    try:
        old = existing_split(run_dir) or {}
    except LaunchError:
        old = {}
    if not old:
        raise LaunchError(f"train uses the data split in {Path(run_dir) / 'data'}, which records no settings (no "
                          f"{SPLIT_FILE}), so --data / --calib-groups cannot be checked against it: drop them, or rerun "
                          f"`setgrpo-verl calibrate --run-dir {run_dir} --overwrite` with them")
    given = {"--data": (None if data is None else str(Path(data).expanduser().resolve()), old.get("data")),
             "--calib-groups": (calib_groups, old.get("calibration_prompts"))}
    for flag, (value, recorded) in given.items():
        if value is not None and value != recorded:
            raise LaunchError(f"train {flag} {value}: the run directory's data split was made with {flag} "
                              f"{recorded} ({Path(run_dir) / 'data' / SPLIT_FILE}), and train uses that split; drop "
                              f"{flag}, or rerun `setgrpo-verl calibrate --run-dir {run_dir} {flag} {value} "
                              "--overwrite`")


def check_stage_dirs(run_dir: str | os.PathLike, stages: Sequence[str], *, overwrite: bool, resume: bool = False) -> None:
    """Refuse, before anything is written, stage directories that already exist (``--overwrite`` replaces them;
    with ``--resume`` :func:`run_stage` keeps complete stages and continues interrupted ones).

    ``calibrate_train`` also writes ``calibration/``.

    Raises:
        LaunchError: the first existing stage directory, with the fix.
    """
    if overwrite or resume:
        return
    dirs = []
    for stage in stages:
        dirs += [STAGES[stage]] + ([STAGES["calibrate"]] if stage == "calibrate_train" else [])
    for name in dict.fromkeys(dirs):
        path = Path(run_dir) / name
        if path.exists():
            raise LaunchError(f"{path} already exists; {_existing_stage_hint(path)}")


def check_training_prompts(record: str | os.PathLike, run_dir: str | os.PathLike) -> None:
    """Refuse a training split that holds a prompt the record was calibrated on (by id or question text).

    Raises:
        LaunchError: naming the first such prompt (:meth:`setgrpo_verl.core.CalibrationRecord.check_disjoint`), or a
            record that does not validate.
    """
    from .core import CalibrationRecord
    from .integration.prompts import read_prompt_identities

    train = Path(run_dir) / "data" / "train.parquet"
    try:
        CalibrationRecord.from_json(record).check_disjoint(read_prompt_identities(train), source=str(train))
    except ValueError as exc:
        raise LaunchError(str(exc)) from None


def stage_overrides(stage: str, run_dir: str | os.PathLike, *, record: str | os.PathLike | None = None) -> list[str]:
    """The overrides that place a stage's data, record and outputs in ``run_dir`` (paths absolute).

    Raises:
        ValueError: unknown stage.
    """
    run_dir = Path(run_dir).resolve()
    stage_dir = run_dir / STAGES[stage]
    data = run_dir / "data"
    common = [
        format_override("data.train_files", str(data / "train.parquet")),
        format_override("data.val_files", str(data / "calibration.parquet")),
        format_override("trainer.default_local_dir", str(stage_dir / "checkpoints")),
        format_override("trainer.experiment_name", STAGES[stage]),
        "trainer.logger=[console,file]",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
    ]
    if stage == "grpo":  # verl's stock config, with the same rubric-validating dataset class and pre-Ray check
        return common + [
            "algorithm.adv_estimator=grpo",
            "data.custom_cls.path=pkg://setgrpo_verl.grading.verl_dataset",
            "data.custom_cls.name=RubricRLHFDataset",
            "+hydra.callbacks.setgrpo_check._target_=setgrpo_verl.integration.config.SetGRPOConfigCheck",
        ]
    common += [
        format_override("algorithm.setgrpo.calibration.files", str(data / "calibration.parquet")),
    ]
    record_out = run_dir / STAGES["calibrate"] / "record.json"
    if stage == "calibrate":
        return common + [
            "algorithm.setgrpo.calibration.only=true",
            format_override("algorithm.setgrpo.record_out", str(record_out)),
        ]
    if stage == "calibrate_train":
        return common + [
            format_override("algorithm.setgrpo.record_out", str(record_out)),
            format_override("algorithm.setgrpo.group_log", str(stage_dir / "groups.jsonl")),
        ]
    if stage == "train":
        if record is None:
            raise ValueError("the train stage needs a calibration record")
        return common + [
            format_override("algorithm.setgrpo.record_path", str(Path(record).resolve())),
            format_override("algorithm.setgrpo.group_log", str(stage_dir / "groups.jsonl")),
        ]
    raise ValueError(f"unknown stage {stage!r}; choose one of {sorted(STAGES)}")


def latest_checkpoint_step(stage_dir: str | os.PathLike) -> int | None:
    """The step of the latest verl checkpoint in ``<stage_dir>/checkpoints`` (verl's
    ``latest_checkpointed_iteration.txt``), or None when the stage saved none."""
    tracker = Path(stage_dir) / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        return int(tracker.read_text().strip())
    except (OSError, ValueError):
        return None


def _existing_stage_hint(path: Path) -> str:
    """What to do about an existing stage directory: replace a complete one, resume or restart an interrupted one."""
    if (path / COMPLETE).exists():
        return "pass --overwrite to replace it or choose another --run-dir"
    step = latest_checkpoint_step(path)
    if step is not None:
        return (f"it was interrupted after its checkpoint of step {step}: pass --resume to continue from there, "
                "--overwrite to start it over, or choose another --run-dir")
    return "it is incomplete and has no checkpoint: pass --overwrite (or --resume) to start it over"


def _stage_dir(run_dir: Path, stage: str, *, overwrite: bool, resume: bool = False) -> Path:
    """The stage's directory, created empty; with ``resume`` an interrupted stage's directory is kept when it holds
    a verl checkpoint to resume from (else it is started over), its ``FAILED`` marker removed."""
    path = run_dir / STAGES[stage]
    if path.exists():
        step = latest_checkpoint_step(path)
        if resume and step is not None and not (path / COMPLETE).exists():
            (path / FAILED).unlink(missing_ok=True)
            return path
        if not overwrite and not resume:
            raise LaunchError(f"{path} already exists; {_existing_stage_hint(path)}")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def run_stage(
    run_dir: str | os.PathLike,
    stage: str,
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    overwrite: bool = False,
    resume: bool = False,
    verbose: bool = False,
    stop_grace: float = 30.0,
) -> Path:
    """Run one verl command as a stage of ``run_dir``; returns the stage directory (docs/cli.md#run-directory).

    Writes ``command.sh`` first (the exact command line, environment variables included), writes verl's output to
    ``main_ppo.log`` (and streams it when ``verbose``; else shows progress bars and one line per step, see
    :mod:`setgrpo_verl.console`), points verl's file logger at ``metrics.jsonl``, and writes ``COMPLETE`` only
    when verl exits with status 0 (else ``FAILED`` with the exit status and the log's tail).

    ``main_ppo`` runs in a session of its own (:class:`setgrpo_verl.supervise.Supervisor`): on SIGINT, SIGTERM or
    SIGHUP it and the local Ray instance it started are stopped (docs/cli.md#stopping-a-run), nothing of that
    session is left running, and ``FAILED`` says which signal stopped it and at which checkpoint to resume.

    With ``resume``, a ``COMPLETE`` stage is kept and not run again, and an interrupted one continues from its latest
    verl checkpoint (``trainer.resume_mode=auto``, verl's default); one without a checkpoint starts over.

    Raises:
        LaunchError: the stage directory exists without ``overwrite`` or ``resume``, or verl exited with a
            non-zero status (the message quotes the last error line of the log).
        SystemExit: with status 128 + the signal number, after a stop signal stopped the stage.
    """
    from .console import StageConsole
    from .supervise import Supervisor

    run_dir = Path(run_dir)
    if resume and (run_dir / STAGES[stage] / COMPLETE).is_file():
        print(f"[setgrpo-verl] {stage}: {run_dir / STAGES[stage]} is complete, kept", flush=True)
        return run_dir / STAGES[stage]
    stage_dir = _stage_dir(run_dir, stage, overwrite=overwrite, resume=resume)
    resumed_from = latest_checkpoint_step(stage_dir)
    calibration = run_dir / STAGES["calibrate"]
    if stage == "calibrate_train":  # its record goes to calibration/, marked complete once the record exists
        if resumed_from is None:
            calibration = _stage_dir(run_dir, "calibrate", overwrite=overwrite, resume=resume)
        elif not (calibration / "record.json").is_file():
            raise LaunchError(f"{stage_dir} has a checkpoint but {calibration}/record.json, the record it was trained "
                              "with, is missing: pass --overwrite to start over")
    env = dict(env)
    metrics = (stage_dir / "metrics.jsonl").resolve()
    env["VERL_FILE_LOGGER_PATH"] = str(metrics)
    shown_env = {k: env[k] for k in ("VERL_PLATFORM", "VERL_FILE_LOGGER_PATH") if k in env}
    line = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in shown_env.items()), *map(shlex.quote, command)])
    (stage_dir / "command.sh").write_text("#!/usr/bin/env bash\n" + line + "\n")
    log_path = stage_dir / "main_ppo.log"
    start = "resuming after its checkpoint of step " + str(resumed_from) if resumed_from is not None else "starting"
    if verbose:
        print(f"[setgrpo-verl] {stage}: {line}", flush=True)
    print(f"[setgrpo-verl] {stage}: {start} verl's main_ppo (command: {stage_dir / 'command.sh'}, log: {log_path})",
          flush=True)
    history: list[bytes] = []
    if resumed_from is not None:
        from .integration.resume import read_history

        history = read_history(str(metrics), resumed_from)
    t0 = time.perf_counter()
    with open(log_path, "a" if resumed_from is not None else "w", encoding="utf-8") as log:
        console = StageConsole(stage, command, metrics, log, verbose=verbose)
        child = Supervisor(command, env=env, on_line=console.line, grace=stop_grace)
        try:
            status = child.run(poll=console.poll)
        finally:
            console.close()
    elapsed = time.perf_counter() - t0
    _keep_history(metrics, history)
    if child.stopped_by is not None:
        step = latest_checkpoint_step(stage_dir)
        where = (f"its latest checkpoint is step {step}: rerun with --resume to continue from there" if step is not None
                 else "it saved no checkpoint: rerun (with --overwrite or --resume) to start it over")
        reason = (f"stopped by {child.stopped_by.name} after {elapsed:.0f} s; main_ppo and the Ray instance it started "
                  f"were stopped; {where}")
        (stage_dir / FAILED).write_text(reason + "\n")
        print(f"[setgrpo-verl] {stage}: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(128 + int(child.stopped_by))
    if status != 0:
        reason = _last_error(console.tail)
        (stage_dir / FAILED).write_text(f"main_ppo exited with status {status} after {elapsed:.0f} s: {reason}\n")
        if not verbose:  # the log was not shown: its end says what went wrong
            sys.stderr.write("".join(t + "\n" for t in console.tail[-15:]))
        raise LaunchError(f"{stage}: verl's main_ppo exited with status {status}: {reason} (full log: {log_path})")
    (stage_dir / COMPLETE).write_text(f"{elapsed:.1f} s\n")
    if stage == "calibrate_train":
        if not (calibration / "record.json").is_file():
            raise LaunchError(f"{stage}: verl exited normally but wrote no record to {calibration}/record.json")
        (calibration / COMPLETE).write_text(f"calibrated by {stage_dir.name}/\n")
    print(f"[setgrpo-verl] {stage}: done in {elapsed:.0f} s", flush=True)
    return stage_dir


def _keep_history(metrics: Path, history: Sequence[bytes]) -> None:
    """Put back the metric rows up to the resumed checkpoint's step that verl's file logger dropped when it opened
    the file again (the SetGRPO trainer puts them back itself; verl's stock trainer, the GRPO stage, does not)."""
    if not history:
        return
    current = metrics.read_bytes() if metrics.is_file() else b""
    present = set(current.splitlines(keepends=True))
    missing = [line for line in history if line not in present]
    if missing:
        metrics.write_bytes(b"".join(missing) + current)


def _last_error(lines: Sequence[str]) -> str:
    for text in reversed(lines):
        stripped = text.strip()
        if stripped and ("Error" in stripped or "error" in stripped or "Exception" in stripped):
            return stripped[-1500:]
    return next((t.strip()[-1500:] for t in reversed(lines) if t.strip()), "no output")


#: The command-line flag (or key) of each field of :class:`setgrpo_verl.core.CalibrationSettings`.
_SETTING_FLAGS = {"alpha": "--alpha", "beta": "--beta", "delta": "--delta", "tau_grid": "--tau-grid", "rho": "--rho",
                  "ablation": "--ablation", "fixed_tau": "--fixed-tau", "on_infeasible": "--on-infeasible",
                  "grid_size": "algorithm.setgrpo.recovery_grid", "norm_by_std": "algorithm.norm_adv_by_std_in_grpo",
                  "srgo_procedure": "algorithm.setgrpo.srgo_procedure", "tau_start": "algorithm.setgrpo.tau_start",
                  "coverage_groups": "algorithm.setgrpo.calibration.coverage_groups"}


def requested_settings(values: Mapping[str, Any]) -> Any:
    """The :class:`setgrpo_verl.core.CalibrationSettings` of ``values`` (``algorithm.setgrpo.*``, schema defaults
    where missing): the same validation as the run's check before Ray and as ``calibrate``.

    Raises:
        LaunchError: naming the flag and the admissible range.
    """
    from .core import CalibrationSettings
    from .integration.config import SetGRPOCalibrationConfig, SetGRPOConfig

    def get(key: str, default: Any) -> Any:
        return values.get(f"algorithm.setgrpo.{key}", default)

    grid = get("tau_grid", None)
    try:
        return CalibrationSettings(
            alpha=get("alpha", SetGRPOConfig.alpha), beta=get("beta", SetGRPOConfig.beta),
            delta=get("delta", SetGRPOConfig.delta), tau_grid=CalibrationSettings.tau_grid if grid is None else grid,
            rho=get("rho", SetGRPOConfig.rho), grid_size=get("recovery_grid", SetGRPOConfig.recovery_grid),
            ablation=get("ablation", None), fixed_tau=get("fixed_tau", None),
            norm_by_std=bool(values.get("algorithm.norm_adv_by_std_in_grpo", True)),
            on_infeasible=get("calibration.on_infeasible", SetGRPOCalibrationConfig.on_infeasible),
            srgo_procedure=get("srgo_procedure", SetGRPOConfig.srgo_procedure), tau_start=get("tau_start", None),
            coverage_groups=get("calibration.coverage_groups", SetGRPOCalibrationConfig.coverage_groups),
        )
    except ValueError as exc:
        field = str(exc).split("=", 1)[0]
        raise LaunchError(f"{_SETTING_FLAGS.get(field, field)}: {exc}") from None


def _requested_levels(values: Mapping[str, Any]) -> tuple[float, float, float, Sequence[float]]:
    """``(alpha, beta, delta, tau_grid)`` of :func:`requested_settings`."""
    settings = requested_settings(values)
    return settings.alpha, settings.beta, settings.delta, settings.tau_grid


def calibration_minimums(values: Mapping[str, Any]) -> tuple[int, int]:
    """``(coverage groups, risk groups)`` the requested levels need at the least (docs/algorithm.md#2-jrsc, #4-srgo).

    Coverage needs ``min_calibration_groups(alpha)`` non-degenerate coverage groups; the risk bound needs the smallest
    N whose Clopper-Pearson bound with no reversal, at confidence ``1 - delta/m`` (``1 - delta`` for the fixed
    sequence), is at most beta.

    Args:
        values: config keys and values (``algorithm.setgrpo.*``; missing ones take the schema defaults).
    """
    from .core import min_calibration_groups, required_accepted_groups

    settings = requested_settings(values)  # the fixed sequence tests at delta: 36 instead of 72 at the paper's levels
    return min_calibration_groups(settings.alpha), required_accepted_groups(
        settings.beta, settings.delta, len(settings.tau_grid), procedure=settings.srgo_procedure)


def _levels(values: Mapping[str, Any]) -> str:
    alpha, beta, delta, grid = _requested_levels(values)
    return f"alpha={alpha}, beta={beta}, delta={delta} over {len(grid)} thresholds"


def _calibration_prompts(values: Mapping[str, Any]) -> int:
    from .integration.config import SetGRPOCalibrationConfig

    return int(values.get("algorithm.setgrpo.calibration.num_prompts", SetGRPOCalibrationConfig.num_prompts))


def check_calibration_size(values: Mapping[str, Any]) -> None:
    """Fail before any rollout when the calibration prompts cannot possibly be enough for the requested levels.

    The calibration groups are split 50/50 (docs/algorithm.md#2-jrsc, #4-srgo), so they must number at least twice
    the larger of the two :func:`calibration_minimums`.

    Args:
        values: config keys and values (``algorithm.setgrpo.*``; missing ones take the schema defaults).

    Raises:
        LaunchError: naming both minima and the flags to change.
    """
    need_cov, need_risk = calibration_minimums(values)
    groups = _calibration_prompts(values)
    need = 2 * max(need_cov, need_risk)
    if groups < need:
        raise LaunchError(
            f"--calib-groups {groups} is too small: {_levels(values)} need >= {need_cov} non-degenerate coverage groups "
            f"and >= {need_risk} accepted risk groups even with no reversal; with the 50/50 split use --calib-groups "
            f">= {need} (more, since groups with tied scores are dropped), or raise --alpha / --beta / --delta")


def check_validation_size(values: Mapping[str, Any], holdout_fraction: float) -> str | None:
    """The sample-size check of ``validate`` (docs/validation.md#validation), before any rollout.

    Each split calibrates on the groups that are not held out. Too few for the coverage minimum is an error (no split
    could calibrate); too few for the risk minimum is allowed -- the coverage check still means something, and
    every split will then report that no threshold is risk-feasible -- and returned as a warning text.

    Returns:
        None, or a warning naming the risk minimum.

    Raises:
        LaunchError: too few calibration groups per split for alpha.
    """
    need_cov, need_risk = calibration_minimums(values)
    groups = _calibration_prompts(values)
    calibration = groups - int(round(groups * holdout_fraction))

    def total(need: int) -> int:
        n = need
        while n - int(round(n * holdout_fraction)) < need:
            n += 1
        return n

    if calibration < 2 * need_cov:
        raise LaunchError(
            f"--calib-groups {groups} with --holdout-fraction {holdout_fraction:g} leaves {calibration} calibration groups "
            f"per split, but {_levels(values)} need >= {need_cov} non-degenerate coverage groups, i.e. {2 * need_cov} "
            f"with the 50/50 split: use --calib-groups >= {total(2 * need_cov)} or raise --alpha")
    if calibration < 2 * need_risk:
        return (f"{calibration} calibration groups per split cannot certify {_levels(values)}: that needs >= "
                f"{need_risk} accepted risk groups with no reversal, i.e. >= {total(2 * need_risk)} --calib-groups; every "
                "split will find no risk-feasible threshold and accept nothing, and only the coverage check is "
                "informative")
    return None


def probe_judge(grader: Mapping[str, Any]) -> None:
    """Score one tiny rubric with an HTTP judge before verl starts, so that a wrong URL fails in seconds.

    Raises:
        LaunchError: the judge cannot be reached or does not answer (the message names the URL and model).
    """
    from .grading import DualScorer, GradingError

    probe = {"question": "Say hello.", "id": "probe", "rubrics": [{"criterion": "The response greets.", "points": 1}]}
    try:
        DualScorer(dict(grader)).score([None], ["Hello!"], [probe])
    except (GradingError, OSError, ValueError) as exc:
        raise LaunchError(
            f"the judge at {grader.get('base_url')} (model {grader.get('model')!r}) failed a probe request: {exc}"
        ) from None
