"""``setgrpo-verl compare``: the outcome comparison through verl's ``main_ppo`` (docs/cli.md#compare,
docs/outcome.md#through-verl-the-plan).

One data split of the validation rubrics (calibration, training and held-out prompts, disjoint, written once), one
calibration stage (for ``setgrpo_paper`` only), then one training run per (arm, seed) in
``<run-dir>/compare/<arm>_s<seed>/``, each a stage of the run directory with verl's held-out validation every
``--val-every`` steps and the seed applied to the data order, the rollout and the noisy grader (the arms of a seed
share their prompts, starting policy and held-out set, not the grader's flips response by response:
docs/cli.md#compare). The run directory's plan (:func:`~setgrpo_verl.runner.lifecycle.plan_run`) keeps finished runs and
continues interrupted ones from their checkpoints under ``--resume``; the analysis
(:mod:`setgrpo_verl.report.outcome`) reads every finished run and writes ``<run-dir>/outcome/``.

Arms (:data:`ARMS`): ``grpo`` (verl's GRPO on one scoring), ``grpo_mean2`` (verl's GRPO on the mean of two),
``setgrpo_paper`` (the SetGRPO trainer with the run's frozen record) and ``setgrpo_reliability``
(``algorithm.setgrpo.variant=reliability``: no record, docs/algorithm.md#9-reliability-weighting).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

__all__ = ["ARMS", "add_parser", "arm_overrides", "compare_depends", "edit_overrides", "run_compare", "run_name"]

#: The arms and the verl stage each runs as: verl's stock GRPO (``grpo``) or the SetGRPO trainer (``train``).
ARMS: Mapping[str, str] = {"grpo": "grpo", "grpo_mean2": "grpo", "setgrpo_paper": "train",
                           "setgrpo_reliability": "train"}
#: The arm that needs the calibration stage's record.
_CALIBRATED = "setgrpo_paper"
#: The parts of the run directory of :func:`compare_depends` besides the runs: the data split, the calibration, the
#: analysis.
_OUTCOME = "outcome"


def run_name(arm: str, seed: int) -> str:
    """The run directory part of one (arm, seed): ``compare/<arm>_s<seed>``."""
    return f"compare/{arm}_s{seed}"


def compare_depends(arms: Sequence[str], seeds: Sequence[int]) -> dict[str, tuple[str, ...]]:
    """What each part of a comparison's run directory is made from, inputs first (the ``depends`` of
    :func:`~setgrpo_verl.runner.lifecycle.plan_run`): ``data``; ``calibration`` (with ``setgrpo_paper``); each run
    from the data (``setgrpo_paper``'s also from the calibration); ``outcome`` from every run."""
    depends: dict[str, tuple[str, ...]] = {"data": ()}
    if _CALIBRATED in arms:
        depends["calibration"] = ("data",)
    runs = [run_name(a, s) for a in arms for s in seeds]
    for arm in arms:
        for seed in seeds:
            depends[run_name(arm, seed)] = ("data", "calibration") if arm == _CALIBRATED else ("data",)
    depends[_OUTCOME] = tuple(runs)
    return depends


def edit_overrides(overrides: Sequence[str], set_: Mapping[str, Any] = {}, drop: Sequence[str] = ()) -> list[str]:
    """``overrides`` with each key of ``set_`` given its value (in place where the key is there, with or without
    Hydra's ``+``; appended as written otherwise) and each key of ``drop`` removed."""
    from .launch import format_override

    def bare(key: str) -> str:
        return key.lstrip("+")

    wanted = {bare(k): k for k in set_}
    out, done = [], set()
    for override in overrides:
        key = bare(override.partition("=")[0])
        if key in {bare(d) for d in drop}:
            continue
        if key in wanted:
            out.append(format_override(override.partition("=")[0], set_[wanted[key]]))
            done.add(key)
        else:
            out.append(override)
    out += [format_override(k, v) for k, v in set_.items() if bare(k) not in done]
    return out


def arm_overrides(arm: str, seed: int, *, common: Sequence[str], grader: Mapping[str, Any], run_dir: Path,
                  val_every: int, validate_first: bool) -> list[str]:
    """The verl overrides of one (arm, seed) run (paths absolute).

    Args:
        arm: a key of :data:`ARMS`.
        seed: the run's seed: verl's data order (``data.seed``), the rollout's sampling
            (``actor_rollout_ref.rollout.seed``) and the noisy grader's flips (its ``seed``).
        common: the overrides every stage shares (:attr:`~setgrpo_verl.runner.run.Plan.common`).
        grader: the grader config (:attr:`~setgrpo_verl.runner.run.Plan.grader`).
        run_dir: the comparison's run directory.
        val_every: held-out validation (and checkpoint) every this many steps, and after the last.
        validate_first: validate before the first step (False where a run continues from its checkpoint).

    Raises:
        ValueError: an unknown arm.
    """
    from . import launch
    from ..rundir import STAGES

    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    stage = ARMS[arm]
    run_dir = Path(run_dir).resolve()
    out = run_dir / run_name(arm, seed)
    base = [o for o in common if not (stage == "grpo" and o.startswith("algorithm.setgrpo"))]
    record = run_dir / STAGES["calibrate"] / "record.json"
    overrides = base + launch.stage_overrides(stage, run_dir, record=record)
    noisy = dict(grader, seed=seed)
    if "base" in noisy:
        noisy["base"] = dict(noisy["base"], seed=seed)
    set_: dict[str, Any] = {
        "data.val_files": str(run_dir / "data" / "heldout.parquet"),
        "trainer.default_local_dir": str(out / "checkpoints"),
        "trainer.experiment_name": f"{arm}_s{seed}",
        "hydra.run.dir": str(out / "hydra"),
        "trainer.val_before_train": bool(validate_first),
        "trainer.test_freq": int(val_every),
        "trainer.save_freq": int(val_every),
        "data.seed": int(seed),
        "actor_rollout_ref.rollout.seed": int(seed),
        "+reward.reward_kwargs.grader": noisy,
    }
    drop: list[str] = []
    if stage == "train":
        set_["algorithm.setgrpo.group_log"] = str(out / "groups.jsonl")
    if arm == "grpo_mean2":
        set_.update({"+reward.reward_kwargs.scorings": 2, "+reward.reward_kwargs.point": "mean"})
    if arm == "setgrpo_reliability":
        set_["algorithm.setgrpo.variant"] = "reliability"
        drop.append("algorithm.setgrpo.record_path")
    return launch.with_file_logger(edit_overrides(overrides, set_, drop))


def add_parser(sub, add_run_options: Callable[..., None]) -> None:
    """Register ``compare`` on the CLI's sub-parsers; ``add_run_options`` adds the shared run options."""
    p = sub.add_parser("compare", help="the outcome comparison: GRPO, GRPO on the mean of two scorings and SetGRPO "
                       "through verl's main_ppo, held-out truth reward per arm and seed (docs/cli.md#compare)")
    p.add_argument("--run-dir", required=True, type=Path,
                   help="run directory (data/, calibration/, compare/<arm>_s<seed>/ and outcome/ inside)")
    p.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS), metavar="ARM",
                   help=f"arms to run (default all: {' '.join(ARMS)})")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], metavar="S",
                   help="seeds of the runs: data order, rollout sampling and grader flips (default 0 1 2)")
    p.add_argument("--val-every", type=int, default=10, metavar="M",
                   help="held-out validation and a checkpoint every M steps and after the last (default 10)")
    p.add_argument("--heldout-prompts", type=int, default=240, metavar="V",
                   help="held-out validation prompts, disjoint from calibration and training (default 240)")
    p.add_argument("--overwrite", action="store_true", help="replace the run directory's data, calibration and runs")
    p.add_argument("--analysis-only", action="store_true",
                   help="run nothing: analyse the finished runs again and write outcome/")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="with --analysis-only: write the analysis to DIR instead of <run-dir>/outcome/ (for a run "
                        "directory this user cannot write)")
    add_run_options(p, profile="compare", judge="rules")


def _check(args: argparse.Namespace) -> None:
    """Refuse what the comparison cannot measure or run, before anything is read.

    Raises:
        LaunchError: naming the flag and the fix.
    """
    from ..rundir import LaunchError

    if args.judge != "rules" or args.flip_prob is None:
        raise LaunchError("compare measures held-out truth reward, which needs a grader with a known truth: pass "
                          "--judge rules --flip-prob P")
    if args.out is not None and not args.analysis_only:
        raise LaunchError("--out goes with --analysis-only (where the analysis is written); the runs themselves "
                          "are written into --run-dir")
    if args.noise_seed is not None:
        raise LaunchError("--noise-seed: compare seeds the grader's flips with each run's seed (--seeds)")
    for flag, values in (("--arms", args.arms), ("--seeds", args.seeds)):
        if len(set(values)) != len(values):
            raise LaunchError(f"{flag} {' '.join(map(str, values))}: each at most once")
    if min(args.seeds) < 0:
        raise LaunchError(f"--seeds {' '.join(map(str, args.seeds))}: seeds are non-negative integers")
    if args.val_every < 1 or args.heldout_prompts < 1:
        raise LaunchError(f"--val-every {args.val_every} --heldout-prompts {args.heldout_prompts}: both must be "
                          "positive")


def _split(args: argparse.Namespace, plan) -> dict[str, Any]:
    """The data split with its held-out part: the first ``--heldout-prompts`` training prompts of the seeded
    shuffle (:func:`~setgrpo_verl.runner.run.make_split`).

    Raises:
        LaunchError: too few prompts for the held-out part and training.
    """
    from .run import make_split
    from ..rundir import LaunchError

    split = make_split(args, plan)
    rest, n = split["train"], args.heldout_prompts
    if len(rest) <= n:
        raise LaunchError(f"{split['source']}: {len(rest)} prompts are left after calibration, but --heldout-prompts "
                          f"{n} and training need more; lower --heldout-prompts or --calib-groups, or pass more --data")
    parts = {"heldout": rest[:n], "train": rest[n:]}
    for name, rows in parts.items():
        for i, row in enumerate(rows):
            row["extra_info"] = {**row["extra_info"], "index": i, "split": name}
    return {**split, **parts, "settings": {**split["settings"], "heldout_prompts": n}}


def _commands(args: argparse.Namespace, plan, lifecycle) -> list[tuple[str, str, list[str]]]:
    """``(stage, run directory part, verl command)`` of the calibration (with ``setgrpo_paper``) and every run."""
    from . import launch
    from .run import record_path, stage_commands

    commands = []
    if _CALIBRATED in args.arms:
        commands += [(s, "calibration", c) for s, c in stage_commands(args, plan, ["calibrate"],
                                                                      record_path(args.run_dir))]
    for arm in args.arms:
        for seed in args.seeds:
            name = run_name(arm, seed)
            continued = lifecycle.action(name) == "continue"
            commands.append((ARMS[arm], name, _run_command(args, plan, arm, seed, validate_first=not continued
                                                           or owes_validation(args.run_dir / name))))
    return commands


def _run_command(args: argparse.Namespace, plan, arm: str, seed: int, *, validate_first: bool) -> list[str]:
    """The verl command of one (arm, seed) run of this invocation."""
    from . import launch

    overrides = arm_overrides(arm, seed, common=plan.common, grader=plan.grader, run_dir=args.run_dir,
                              val_every=args.val_every, validate_first=validate_first)
    config = "ppo_trainer" if ARMS[arm] == "grpo" else "setgrpo_trainer"
    return launch.main_ppo_command(overrides + list(args.overrides), config_name=config)


def _joined(run_dir: Path, lifecycle) -> list[tuple[str, Path]]:
    """The work in ``run_dir`` that a command joins: the calibration and the runs under ``compare/`` that are
    finished or checkpointed (:func:`~setgrpo_verl.runner.lifecycle.dir_state`), have their ``command.sh`` and that
    this command keeps or continues, or does not touch (other arms and seeds); ``[(name, path)]``."""
    from .lifecycle import dir_state

    out = []
    for path in [run_dir / "calibration", *sorted((run_dir / "compare").glob("*"))]:
        name = "calibration" if path.name == "calibration" else f"compare/{path.name}"
        if (name in lifecycle and lifecycle.action(name) in ("create", "replace", "remove")) \
                or dir_state(path) not in ("complete", "checkpointed") or not (path / "command.sh").is_file():
            continue
        out.append((name, path))
    return out


def check_settings(commands: Sequence[tuple[str, str, list[str]]], run_dir: Path, lifecycle,
                   compose: Callable[[str, int], list[str]]) -> None:
    """Refuse to join work in ``run_dir`` made with other settings than this command would use for it: each kept,
    continued or untouched run (:func:`_joined`) and the calibration must have been made with the command this
    invocation runs for it (``commands``; for an untouched run of another arm or seed, ``compose(arm, seed)``), apart
    from what a resume changes (:func:`~setgrpo_verl.report.experiment.differing_settings`): a finished run kept
    under another grader noise, learning rate, K, ... would be analysed as the same experiment, and a continued one
    would change its settings mid-way.

    Raises:
        LaunchError: naming each such run, the settings that differ (the flag that sets each, where there is one)
            with both values, and the fix.
    """
    from ..report import ReportError
    from ..report.experiment import differing_settings
    from ..report.outcome import RUN_NAME
    from ..rundir import LaunchError
    from .profiles import FLAGS

    flags = {key: flag for flag, key, _, _ in FLAGS}
    flags.update({"reward.reward_kwargs.grader": "--flip-prob", "actor_rollout_ref.rollout.dtype": "--precision",
                  "actor_rollout_ref.actor.fsdp_config.mixed_precision": "--precision",
                  "trainer.test_freq": "--val-every", "trainer.save_freq": "--val-every"})
    planned = {name: command for _, name, command in commands}
    found = []
    for name, path in _joined(Path(run_dir), lifecycle):
        ours = planned.get(name)
        match = RUN_NAME.match(path.name)
        if ours is None and match and match["arm"] in ARMS:
            ours = compose(match["arm"], int(match["seed"]))
        if ours is None:
            continue
        try:
            # the settings a flag sets first: they are what a user changes
            diff = sorted(differing_settings((path / "command.sh").read_text(), " ".join(ours)),
                          key=lambda d: d[0] not in flags)
        except ReportError as exc:
            raise LaunchError(f"{path / 'command.sh'} is {exc}, so the settings {name} was made with are unknown: "
                              "pass --overwrite to make it again, or choose another --run-dir") from None
        if diff:
            shown = [f"{key}={'(not set)' if theirs is None else theirs}" + (f" ({flags[key]})" if key in flags else "")
                     + f" where this command has {'(not set)' if mine is None else mine}" for key, theirs, mine in diff]
            found.append(f"{name} was made with " + ", ".join(shown[:4])
                         + (f" and {len(shown) - 4} more setting(s)" if len(shown) > 4 else ""))
    if found:
        raise LaunchError(f"{run_dir}: " + "; ".join(found) + ": a comparison keeps, continues or sits beside only "
                          "work made with its own settings; pass the flags they were made with (see each run's "
                          "command.sh), --overwrite to make them again, or choose another --run-dir")


def owes_validation(path: Path) -> bool:
    """Whether a checkpointed run of ``compare`` owes the held-out validation of its checkpoint's step: its metrics
    (:func:`~setgrpo_verl.integration.resume.kept_rows`) hold no held-out truth reward at that step. ``compare``
    checkpoints and validates at the same steps, and verl saves the checkpoint, then validates, then logs the step's
    row, so a run stopped during a validation (or before the row was written) resumes owing it; continued with
    ``trainer.val_before_train=true``, verl makes it at the checkpoint's step before training on."""
    import json

    from ..integration.resume import kept_rows
    from ..report.outcome import TRUTH_METRIC
    from ..rundir import latest_checkpoint_step

    step = latest_checkpoint_step(path)
    if step is None:
        return True
    for line in kept_rows(str(Path(path).resolve() / "metrics.jsonl"), step):
        row = json.loads(line)
        if row["step"] == step and any(TRUTH_METRIC.match(k) for k in row.get("data", {})):
            return False
    return True


def check_precision(commands: Sequence[tuple[str, str, list[str]]], run_dir: Path, lifecycle) -> None:
    """Refuse commands at another compute precision than the work they join in ``run_dir``: the calibration and
    the runs under ``compare/`` that are finished or checkpointed (:func:`~setgrpo_verl.runner.lifecycle.dir_state`)
    and that this command keeps or continues, or does not touch (other arms and seeds). The
    CPU backend's default precision follows the host (bf16 where the CPU has bf16 units, fp32 elsewhere), and the
    analysis pairs runs by seed, so a run directory continued on another kind of host would mix two arithmetics.

    Args:
        commands: ``(stage, run directory part, verl command)`` of this command's stages.
        run_dir: the comparison's run directory.
        lifecycle: this command's :class:`~setgrpo_verl.runner.lifecycle.RunPlan`.

    Raises:
        LaunchError: naming the runs, both precisions and the fix (``--precision``, another ``--run-dir``, or for
            the calibration alone, removing ``calibration/``).
    """
    from ..report.outcome import command_precision
    from ..rundir import LaunchError

    def precision(text: str) -> str:
        return command_precision(text) or "verl default"

    planned = sorted({precision(" ".join(c)) for _, _, c in commands})
    others = {}
    for name, path in _joined(run_dir, lifecycle):
        theirs = precision((path / "command.sh").read_text())
        if theirs not in planned or len(planned) > 1:
            others[name] = theirs
    if others:
        raise LaunchError(f"{run_dir}: " + ", ".join(f"{n} ran at {p}" for n, p in sorted(others.items()))
                          + f", and this command runs at {' and '.join(planned)} (the CPU's default: bf16 where it "
                          "has bf16 units, fp32 elsewhere); a comparison is one arithmetic: pass --precision to "
                          "match them (bf16 is many times slower on a CPU without bf16 units), use another "
                          "--run-dir, or, where only the calibration differs, remove its calibration/ to calibrate "
                          "again")


def _checked(commands, run_dir: Path) -> list[tuple[str, list[str]]]:
    """The commands as the pre-Ray check composes them: ``setgrpo_paper``'s without its record until the calibration
    stage has written it (its own ``main_ppo`` checks the record before Ray)."""
    from .run import record_path

    have = record_path(run_dir).is_file()
    return [(name, c if have or not name.startswith(f"compare/{_CALIBRATED}_")
             else [o for o in c if not o.startswith("algorithm.setgrpo.record_path=")]) for _, name, c in commands]


def _header(args: argparse.Namespace, plan, split: Mapping[str, Any]) -> str:
    v = plan.values
    steps, k = int(v["trainer.total_training_steps"]), int(v["actor_rollout_ref.rollout.n"])
    validations = -(-steps // args.val_every) + 1
    return (f"[setgrpo-verl] compare: {len(args.arms)} arm(s) x {len(args.seeds)} seed(s) = "
            f"{len(args.arms) * len(args.seeds)} runs of {steps} steps (K {k}, {v['data.train_batch_size']} groups a "
            f"step) at flip {args.flip_prob:g}; {len(split['heldout'])} held-out prompts validated greedily "
            f"{validations} times a run (before the first step, every {args.val_every} steps and after the last); "
            f"{len(split['calibration'])} calibration and {len(split['train'])} training prompts"
            + (f"; one calibration of {v['algorithm.setgrpo.calibration.num_prompts']} groups for setgrpo_paper"
               if _CALIBRATED in args.arms else ""))


def run_compare(args: argparse.Namespace) -> str | None:
    """``compare``: plan, check, then the data split, the calibration, every run not yet finished and the
    analysis; ``--dry-run`` prints the plan and every command, ``--analysis-only`` only analyses.

    Raises:
        LaunchError: a bad flag, a refused directory, a check that fails before Ray, or a failed stage.
    """
    from .datasplit import split_matches
    from .launch import cpu_environment
    from .lifecycle import plan_run
    from .preflight import check_calibration_size, check_training_steps
    from .profiles import overrides_from_args
    from .run import check_before_ray, dry_run_text, make_plan, start
    from .stages import run_stage

    _check(args)
    depends = compare_depends(args.arms, args.seeds)
    if args.analysis_only:
        lifecycle = plan_run(args.run_dir, [_OUTCOME], depends=depends, overwrite=args.overwrite, resume=args.resume)
        return dry_run_text([], lifecycle) if args.dry_run else analyse(args, lifecycle)
    plan = make_plan(args, overrides_from_args(args))
    if _CALIBRATED in args.arms:
        check_calibration_size(plan.values)
    split = _split(args, plan)
    writes = [n for n in depends]
    lifecycle = plan_run(args.run_dir, writes, overwrite=args.overwrite, resume=args.resume,
                         same_data=split_matches(args.run_dir, split), depends=depends)
    commands = _commands(args, plan, lifecycle)
    check_before_ray(args, _checked(commands, args.run_dir), lifecycle, split,
                     checks=(lambda: check_precision(commands, Path(args.run_dir), lifecycle),
                             lambda: check_settings(commands, Path(args.run_dir), lifecycle,
                                                    lambda arm, seed: _run_command(args, plan, arm, seed,
                                                                                   validate_first=True)),
                             lambda: check_training_steps(plan.values, args.overrides, len(split["train"]))))
    header = _header(args, plan, split)
    if args.dry_run:
        return header + "\n" + dry_run_text([(n, c) for _, n, c in commands], lifecycle, judge=args.judge)
    print(header, flush=True)
    start(args, plan, lifecycle, split)
    env = cpu_environment()
    for stage, name, command in commands:
        kept = lifecycle.action(name) == "keep"
        out = run_stage(args.run_dir, stage if name == "calibration" else name.split("/")[1], command, env=env,
                        argv=getattr(args, "argv", None),
                        plan=lifecycle, verbose=args.verbose, directory=name)
        if name != "calibration" and not kept and not owes_validation(out):
            # the analysis reads the metrics; a finished run's checkpoint (about 1.6 GB) is not needed again once
            # its last validation is in them (else it is what a rerun validates from)
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return analyse(args, lifecycle)


def _check_validated(curves: Mapping[str, Mapping[int, Any]], run_dir: Path, where: str) -> None:
    """Refuse finished runs (of one experiment, so of one schedule) of which some validated last at an earlier step
    than the others, naming each such run and the command that makes its missing validations.

    Raises:
        LaunchError: naming the short runs, the steps and, per run, what to remove before ``--resume``.
    """
    from ..rundir import COMPLETE, LaunchError, latest_checkpoint_step

    ends = {(arm, seed): int(c.steps[-1]) for arm, runs in curves.items() for seed, c in runs.items()}
    last = max(ends.values(), default=0)
    short = sorted(run for run, end in ends.items() if end < last)
    if not short:
        return
    fixes = []
    for arm, seed in short:
        path = Path(run_dir) / run_name(arm, seed)
        step = latest_checkpoint_step(path)
        fixes.append(f"{arm}_s{seed} validated last at step {ends[arm, seed]}: "
                     + (f"remove {path / COMPLETE} and rerun this command with --resume (it continues from its "
                        f"checkpoint of step {step} and validates what it owes)" if step is not None else
                        f"remove {path}/ and rerun this command with --resume (it has no checkpoint left and runs "
                        "again)"))
    raise LaunchError(f"{where}: the other finished runs validated last at step {last}; " + "; ".join(fixes))


def analyse(args: argparse.Namespace, lifecycle) -> str:
    """Read every finished run of ``--arms`` x ``--seeds``, write ``outcome/`` (``outcome.png``, ``outcome.json``,
    ``outcome.txt``, then ``COMPLETE``) and return the table, the runs left out and the outcome line (last).

    Raises:
        LaunchError: no run finished, a metrics file the analysis cannot read, finished runs at different
            precisions or that validated last at different steps, or runs of an arm the figure cannot draw (the
            message names them).
    """
    from ..report import ReportError
    from ..report.outcome import check_one_experiment, outcome_report, read_curve, write_outcome
    from ..rundir import COMPLETE, LaunchError, mark_complete
    from .writes import writing

    curves: dict[str, dict[int, Any]] = {}
    commands: dict[str, str] = {}
    left = []
    for arm in args.arms:
        for seed in args.seeds:
            path = args.run_dir / run_name(arm, seed)
            if not (path / COMPLETE).is_file():
                left.append(f"{arm}_s{seed}")
                continue
            try:
                curves.setdefault(arm, {})[seed] = read_curve(path / "metrics.jsonl")
                commands[f"{arm}_s{seed}"] = (path / "command.sh").read_text()
            except (OSError, ReportError) as exc:
                raise LaunchError(f"compare analysis: {exc}") from None
    where = f"compare analysis of {args.run_dir}"
    try:
        flip = check_one_experiment(commands, where) if commands else args.flip_prob
    except ReportError as exc:
        raise LaunchError(str(exc)) from None
    if flip != args.flip_prob:
        raise LaunchError(f"{where}: the finished runs were made at flip {flip:g}, not --flip-prob "
                          f"{args.flip_prob:g}: pass --flip-prob {flip:g} to analyse them, or use another --run-dir")
    _check_validated(curves, args.run_dir, where)
    try:
        result, text = outcome_report(curves, flip_prob=args.flip_prob, unfinished=left)
    except ReportError as exc:
        raise LaunchError(f"{where}: {exc}") from None
    out = lifecycle.prepare(_OUTCOME) if getattr(args, "out", None) is None else args.out
    try:
        with writing(out, "the comparison's analysis", remove=[out] if getattr(args, "out", None) is None else []):
            out.mkdir(parents=True, exist_ok=True)
            write_outcome(out, curves, result, text)
            mark_complete(out)
    except ReportError as exc:
        raise LaunchError(f"compare analysis of {args.run_dir}: {exc}") from None
    return f"written: {out / 'outcome.json'}, {out / 'outcome.png'}\n{text}"
