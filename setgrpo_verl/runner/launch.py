"""Compose and run verl's ``main_ppo`` for the stages of a SetGRPO run: calibrate, train, the GRPO baseline.

Every stage is one ``python -m verl.trainer.main_ppo`` process (verl's own trainer, Ray, FSDP2 workers, reward
loop); this module composes the Hydra overrides of each stage and the CPU backend's settings. The data split is
:mod:`setgrpo_verl.runner.datasplit`, the stage runner :mod:`setgrpo_verl.runner.stages`, the checks before verl starts
:mod:`setgrpo_verl.runner.preflight` and the run directory's layout :mod:`setgrpo_verl.rundir`; their public names are
importable from here too. Nothing here trains, scores or calibrates.

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
import logging
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from .datasplit import (
    DEFAULT_DATA,
    SPLIT_FILE,
    check_split_flags,
    existing_split,
    split_data,
    write_data,
)
from .preflight import (
    calibration_minimums,
    check_calibration_size,
    check_training_prompts,
    check_training_steps,
    check_validation_size,
    probe_judge,
    requested_settings,
)
from ..rundir import COMPLETE, FAILED, STAGES, LaunchError, latest_checkpoint_step
from .stages import run_stage

__all__ = [
    "COMPLETE",
    "FAILED",
    "STAGES",
    "LaunchError",
    "CPU_PRECISIONS",
    "DEFAULT_DATA",
    "SPLIT_FILE",
    "calibration_minimums",
    "check_calibration_size",
    "check_split_flags",
    "check_training_prompts",
    "check_training_steps",
    "check_validation_size",
    "cpu_bf16_units",
    "cpu_environment",
    "cpu_overrides",
    "cpu_precision",
    "existing_split",
    "format_override",
    "main_ppo_command",
    "probe_judge",
    "requested_settings",
    "split_data",
    "write_data",
    "latest_checkpoint_step",
    "run_stage",
    "stage_overrides",
    "with_file_logger",
]


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


def with_file_logger(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with ``file`` added to any ``trainer.logger`` list that lacks it (docs/cli.md#run-directory).

    A stage's ``metrics.jsonl`` -- its console line per step, the report, a resume's history -- is verl's file
    logger, so a tracker list such as ``trainer.logger=[console,tensorboard]`` keeps it: ``[console,tensorboard,file]``.
    """
    out = []
    for override in overrides:
        key, eq, value = override.partition("=")
        if eq and key.lstrip("+") == "trainer.logger":
            items = [v.strip().strip("'\"") for v in value.strip().strip("'\"").strip("[]").split(",") if v.strip()]
            if "file" not in items:
                override = f"{key}=[{','.join([*items, 'file'])}]"
        out.append(override)
    return out


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
        # Hydra's own output (.hydra/, its log) in the stage directory, not in the directory the command runs from
        format_override("hydra.run.dir", str(stage_dir / "hydra")),
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
    ]
    if stage == "grpo":  # verl's stock config, with the same rubric-validating dataset class and pre-Ray check
        return common + [
            "algorithm.adv_estimator=grpo",
            # GRPO reads the point score alone: one grader call per response, and the grading metrics logged
            "+reward.reward_kwargs.scorings=1",
            "trainer.v1.trainer_mode=graded_sync",
            "data.custom_cls.path=pkg://setgrpo_verl.grading.verl_dataset",
            "data.custom_cls.name=RubricRLHFDataset",
            "+hydra.callbacks.setgrpo_check._target_=setgrpo_verl.integration.run_check.SetGRPOConfigCheck",
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

