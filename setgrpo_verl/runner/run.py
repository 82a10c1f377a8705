"""A training command of :mod:`setgrpo_verl.runner.cli`, from its parsed flags to verl's processes.

:func:`make_plan` turns the flags into checked config values, the policy model, the grader and the overrides every
stage shares (:class:`Plan`); then come the data split (:func:`make_split`), the run directory's plan
(:func:`dir_plan`), the verl command line of each stage (:func:`stage_commands`), the start once everything is
checked (:func:`start`: the judge probed, the lock taken, the split written) and the stages themselves
(:func:`run_stages`).
"""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["Plan", "check_before_ray", "dir_plan", "dry_run_text", "grader_config", "hold_lock", "make_plan",
           "make_split", "record_path", "run_stages", "stage_commands", "start", "train_prompts", "write_split"]


def _sketch_batches(values: dict[str, Any], command: str, trains: bool) -> dict[str, int]:
    """The batches the sketch pass sees (description -> prompts): a training step when the command trains, the
    calibration batches (the last, smaller one too) when it calibrates."""
    train = int(values["data.train_batch_size"])
    batches = {f"a training step (--groups-per-step {train})": train} if trains else {}
    if command != "train":
        size = int(values.get("algorithm.setgrpo.calibration.batch_size") or train)
        prompts = int(values["algorithm.setgrpo.calibration.num_prompts"])
        batches[f"a calibration batch (--calib-batch-size {size})"] = min(size, prompts)
        if prompts > size and prompts % size:
            batches[f"the last calibration batch (--calib-groups {prompts} in batches of {size})"] = prompts % size
    return batches


def _padding_multiple(values: dict[str, Any], ranks: int) -> int:
    from ..integration.micro_batch import padded_batch_multiple

    mini = values.get("actor_rollout_ref.actor.ppo_mini_batch_size") or values.get("data.train_batch_size", 1)
    return padded_batch_multiple(ranks=ranks, mini_batch_prompts=int(mini),
                                 k=int(values.get("actor_rollout_ref.rollout.n", 8)))


def _micro_batch_size(values: dict[str, Any], ranks: int, max_responses: int = 16) -> int:
    """Responses per micro-batch and rank: whole groups, at most ``max_responses``, dividing every batch a rank sees
    (training steps and every calibration batch, the last one too, as verl pads them).

    verl's fixed micro-batching needs each rank's share of a batch to be a multiple of the micro-batch size.

    Raises:
        LaunchError: the batches cannot be split evenly over ``ranks``.
    """
    from ..integration.micro_batch import sketch_micro_batch_error
    from ..rundir import LaunchError

    k = int(values.get("actor_rollout_ref.rollout.n", 8))
    train = int(values.get("data.train_batch_size", 1))
    calibration = int(values.get("algorithm.setgrpo.calibration.batch_size") or train)
    groups = math.gcd(train, calibration)
    if groups % ranks:
        raise LaunchError(f"--groups-per-step {train} and --calib-batch-size {calibration} must both be multiples of "
                          f"--actor-ranks {ranks}")
    per_rank = groups // ranks
    batches = _sketch_batches({"algorithm.setgrpo.calibration.num_prompts": calibration, **values,
                               "data.train_batch_size": train}, "quickstart", True)
    multiple = _padding_multiple(values, ranks)
    for d in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0 and (d == 1 or k * d <= max_responses)),
                    reverse=True):
        if sketch_micro_batch_error(k=k, prompts=batches, ranks=ranks, micro=k * d, source="",
                                    multiple=multiple) is None:
            return k * d
    return k


def grader_config(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    grader = _base_grader(args, seed)
    if args.flip_prob is None:
        return grader
    return {"type": "noisy", "flip_prob": float(args.flip_prob), "seed": int(args.noise_seed or 0), "base": grader}


def _base_grader(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    if args.judge == "rules":
        return {"type": "rules", "seed": seed}
    if args.judge == "local":
        grader: dict[str, Any] = {"type": "local_hf", "seed": seed}
        if args.judge_model:
            grader["model_path"] = str(Path(args.judge_model).expanduser().resolve())
    elif args.judge == "function":
        path, _, name = str(args.reward_function).partition(":")
        return {"type": "function", "path": str(Path(path).expanduser().resolve()), "name": name or "compute_score",
                "seed": seed}
    else:
        grader = {"type": "openai", "base_url": args.judge_base_url, "model": args.judge_model, "seed": seed}
        if args.judge_max_tokens is not None:
            grader["max_tokens"] = args.judge_max_tokens
        if args.judge_chat_template_kwargs:
            grader["chat_template_kwargs"] = dict(args.judge_chat_template_kwargs)
        if args.judge_max_concurrency is not None:
            grader["max_concurrency"] = args.judge_max_concurrency
    if args.judge_max_response_tokens is not None:
        grader["max_response_tokens"] = args.judge_max_response_tokens
    grader["temperature"] = 1.0 if args.judge_temperature is None else args.judge_temperature
    return grader


def _check_grader(grader: dict[str, Any]) -> None:
    """Refuse a deterministic judge (``--judge-temperature`` <= 0) before anything is read or loaded.

    Raises:
        LaunchError: the message of :func:`setgrpo_verl.grading.check_stochastic_judge`.
    """
    from ..grading import check_stochastic_judge
    from .launch import LaunchError

    judge = grader.get("base", grader) if grader.get("type") == "noisy" else grader
    try:
        check_stochastic_judge(str(judge.get("type")), judge.get("temperature"))
    except ValueError as exc:
        raise LaunchError(str(exc)) from None


def train_prompts(run_dir: Path, split: dict[str, Any] | None) -> int:
    """Rows of the training split about to be written (``split``), else of the run's ``data/train.parquet``."""
    if split is not None:
        return len(split["train"])
    import pyarrow.parquet as pq

    return pq.ParquetFile(run_dir / "data" / "train.parquet").metadata.num_rows


@dataclass
class Plan:
    """What every training command needs: config values, the policy model, the grader and the shared overrides."""

    values: dict[str, Any]
    model: Path
    grader: dict[str, Any]
    seed: int
    common: list[str] = field(default_factory=list)


def make_plan(args: argparse.Namespace, values: dict[str, Any]) -> Plan:
    """The command's plan from its flags and their config ``values``, checked before anything is read or written
    (levels, grid, rho, micro-batches).

    Raises:
        LaunchError: a bad flag, model directory, setting or micro-batch size.
    """
    from . import launch
    from ..integration.micro_batch import sketch_micro_batch_error

    values = dict(values)
    seed = int(values.get("data.seed", 1))
    # a deterministic judge is refused before the embedded model is resolved (its first use converts and loads it)
    grader = grader_config(args, seed)
    _check_grader(grader)
    if args.model is not None:
        model = Path(args.model).expanduser().resolve()
        if not (model / "config.json").is_file():
            raise launch.LaunchError(f"--model {args.model}: not a local Hugging Face model directory (no config.json)")
    else:
        from ..models import embedded_model_dir

        model = embedded_model_dir()
    values["actor_rollout_ref.model.path"] = str(model)
    launch.requested_settings(values)
    values.setdefault("actor_rollout_ref.actor.ppo_mini_batch_size", values.get("data.train_batch_size"))
    micro = _micro_batch_size(values, args.actor_ranks)
    values.setdefault("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", micro)
    values.setdefault("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", micro)
    sketch_key = "algorithm.setgrpo.sketch.micro_batch_size_per_gpu"
    # the sketch pass's micro-batch (its own, else the log-prob one), checked here before anything is written
    sketch_micro = values.get(sketch_key)
    source = sketch_key if sketch_micro is not None else "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
    if sketch_micro is None and values.get("algorithm.setgrpo.sketch.max_token_len_per_gpu") is None:
        sketch_micro = values["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"]
    if sketch_micro is not None and not (args.command == "train" and args.estimator == "grpo"):
        trains = (args.command in ("quickstart", "compare")
                  or (args.command == "train" and args.estimator == "setgrpo"))
        error = sketch_micro_batch_error(k=int(values["actor_rollout_ref.rollout.n"]),
                                         prompts=_sketch_batches(values, args.command, trains), ranks=args.actor_ranks,
                                         micro=int(sketch_micro), source=source,
                                         multiple=_padding_multiple(values, args.actor_ranks))
        if error:
            raise launch.LaunchError(error)
    if args.resume and args.overwrite:
        raise launch.LaunchError("--resume keeps the run directory's stages and --overwrite deletes them: pass one")
    common = [launch.format_override(k, v) for k, v in values.items() if v is not None]
    common += launch.cpu_overrides(args.actor_ranks, args.precision) + [launch.format_override("+reward.reward_kwargs.grader", grader)]
    common += ["reward.reward_manager.name=setgrpo_dual"]
    return Plan(values=values, model=model, grader=grader, seed=seed, common=common)


def stage_commands(args: argparse.Namespace, plan: Plan, stages: list[str],
                   record: Path) -> list[tuple[str, list[str]]]:
    """The verl command line of each stage."""
    from . import launch

    commands = []
    for stage in stages:
        overrides = (plan.common + launch.stage_overrides(stage, args.run_dir, record=record)
                     + launch.with_file_logger(args.overrides))
        config = "ppo_trainer" if stage == "grpo" else "setgrpo_trainer"
        if stage == "grpo":  # verl's stock config has no algorithm.setgrpo block
            overrides = [o for o in overrides if not o.startswith("algorithm.setgrpo")]
        commands.append((stage, launch.main_ppo_command(overrides, config_name=config)))
    return commands


#: What a dry run says of the GPU environment checks: the command line's runs use verl's CPU backend, which skips them.
NOT_RUN_GPU_CHECKS = ("[setgrpo-verl] checks: the GPU environment checks (CUDA available, NVIDIA driver R580 or newer "
                      "for torch's CUDA 13.0, flash-attn loads) were not run: these commands run verl's CPU backend, "
                      "which does not use them (docs/verl_integration.md#gpu-requirements)")


def check_before_ray(args: argparse.Namespace, commands: list[tuple[str, list[str]]], lifecycle,
                     split: dict[str, Any] | None, checks: tuple[Callable[[], None], ...] = ()) -> None:
    """Every local check the command makes before verl's Ray starts, the same for a dry run (docs/cli.md#run-directory):
    the run directory's plan, the command's own ``checks`` (which may read the directories), then ``main_ppo``'s
    own check on each stage's composed config
    (:func:`~setgrpo_verl.runner.preflight.check_stage_configs`). A dry run leaves out the GPU environment checks; the
    judge probe, a network request, is :func:`start`'s.

    Raises:
        LaunchError: the first check that fails; a dry run prints its plan and commands first.
    """
    from .preflight import check_stage_configs

    try:
        lifecycle.check()
        for check in checks:
            check()
        prompts = None
        if split is not None:
            from ..integration.prompts import prompt_fingerprints

            prompts = prompt_fingerprints(split["calibration"])
        check_stage_configs(commands, calibration_prompts=prompts, environment=not args.dry_run)
    except Exception:
        if args.dry_run:  # what it would have done, then why it would not
            print(dry_run_text(commands, lifecycle), flush=True)
        raise


def dry_run_text(commands: list[tuple[str, list[str]]], lifecycle=None, *, judge: str | None = None) -> str:
    """``--dry-run``'s text: the run directory's plan (what each directory would get), a line saying that the GPU
    environment checks were not run (:data:`NOT_RUN_GPU_CHECKS`), the verl command lines and, given the command's
    ``judge`` once every check passed, a line saying so and naming the judge probe that only the command makes."""
    lines = [] if lifecycle is None else [lifecycle.text()]
    if lifecycle is not None:
        from .runlock import holder

        if holder(lifecycle.run_dir) is not None:
            lines.append(f"[setgrpo-verl] plan: {lifecycle.run_dir} is locked by another command: "
                         f"{holder(lifecycle.run_dir)}")
        refused = [d for d in lifecycle.dirs if d.action == "refuse"]
        if refused:
            lines.append(f"[setgrpo-verl] plan: the command would stop before writing anything: "
                         f"{lifecycle.run_dir / refused[0].name} {refused[0].reason}")
    if commands:
        lines.append(NOT_RUN_GPU_CHECKS)
    lines += [" ".join(shlex.quote(c) for c in cmd) for _, cmd in commands]
    if commands and judge is not None:
        probe = (", except the judge probe (a request to --judge-base-url, which only the command makes)"
                 if judge == "openai" else "")
        lines.append(f"[setgrpo-verl] dry run: every other check the command makes before verl starts passed{probe}")
    return "\n".join(lines)


def make_split(args: argparse.Namespace, plan: Plan) -> dict[str, Any] | None:
    """The data split these flags make (nothing written; a dry run makes it too, so that it never prints a command
    the run would refuse).

    Raises:
        LaunchError: bad data, or too few prompts for the calibration.
    """
    from . import datasplit

    values = plan.values
    return datasplit.split_data(data=args.data, model_path=plan.model,
                                max_prompt_length=int(values["data.max_prompt_length"]),
                                calibration_prompts=int(values["algorithm.setgrpo.calibration.num_prompts"]),
                                seed=plan.seed, rules_only=args.judge == "rules",
                                default_data="validation" if args.judge == "rules" else "ifbench",
                                duplicate_criteria=args.duplicate_criteria)


def dir_plan(args: argparse.Namespace, writes: list[str], reads: tuple[str, ...] = (),
               split: dict[str, Any] | None = None):
    """The run directory's plan of this command (:func:`setgrpo_verl.runner.lifecycle.plan_run`)."""
    from .datasplit import split_matches
    from .lifecycle import plan_run

    same = split_matches(args.run_dir, split) if split is not None else None
    return plan_run(args.run_dir, writes, reads=reads, overwrite=args.overwrite, resume=args.resume, same_data=same)


def write_split(args: argparse.Namespace, lifecycle, split: dict[str, Any]) -> None:
    from .datasplit import split_drop_line, write_data
    from .writes import writing

    if lifecycle.action("data") == "keep":
        print(f"[setgrpo-verl] data: {args.run_dir / 'data'} already holds this split; kept", flush=True)
        return
    lifecycle.prepare("data")
    with writing(args.run_dir / "data", "the data split", remove=[args.run_dir / "data"]):
        write_data(args.run_dir, split)
    print(f"[setgrpo-verl] data: {len(split['calibration'])} calibration and {len(split['train'])} training prompts "
          f"from {split['source']}", flush=True)
    if split["duplicates"]:
        print(f"[setgrpo-verl] data: removed {split['duplicates']} duplicate prompts (same id or same question text)",
              flush=True)
    if split_drop_line(split):
        print(split_drop_line(split), flush=True)


def start(args: argparse.Namespace, plan: Plan, lifecycle, split: dict[str, Any] | None) -> None:
    """Everything checked: probe the judge, remove what the replaced directories' results no longer match, print
    the plan and write the data split."""
    from .preflight import probe_judge

    lifecycle.check()
    if args.judge == "openai":
        probe_judge(plan.grader)
    hold_lock(args)
    if any(d.action != "create" for d in lifecycle.dirs):
        print(lifecycle.text(), flush=True)
    lifecycle.remove_derived()
    if split is not None:
        write_split(args, lifecycle, split)


def run_stages(args: argparse.Namespace, commands: list[tuple[str, list[str]]], lifecycle) -> None:
    """Run each stage's ``main_ppo`` in turn. The first stage starts right after :func:`start` probed the judge, so
    its Hydra callback does not probe it again (``SETGRPO_SKIP_JUDGE_PROBE=1`` in its environment, not in its
    ``command.sh``); a later stage, which may start hours later, probes it itself."""
    from ..integration.judge_access import SKIP_PROBE_ENV
    from .launch import cpu_environment
    from .stages import run_stage

    env = cpu_environment()
    for n, (stage, cmd) in enumerate(commands):
        stage_env = {**env, SKIP_PROBE_ENV: "1"} if n == 0 and getattr(args, "judge", None) == "openai" else env
        run_stage(args.run_dir, stage, cmd, env=stage_env, plan=lifecycle, verbose=args.verbose,
                  argv=getattr(args, "argv", None))


def record_path(run_dir: Path) -> Path:
    from ..rundir import STAGES

    return run_dir / STAGES["calibrate"] / "record.json"




def hold_lock(args: argparse.Namespace) -> None:
    """Take the run directory's lock (:func:`setgrpo_verl.runner.runlock.run_dir_lock`) for the rest of the command,
    unless it is held already or this is a dry run."""
    if getattr(args, "dry_run", False) or getattr(args, "locked", False) or getattr(args, "lock", None) is None:
        return
    from .runlock import run_dir_lock
    from .writes import writable, writing

    if getattr(args, "out", None) is not None and not writable(args.run_dir):
        return  # a command that only reads it, writing to --out: nothing here can change the directory either

    with writing(args.run_dir, "the run directory's lock (every command but a dry run takes it)"):
        args.lock.enter_context(run_dir_lock(args.run_dir, args.argv))
    args.locked = True
