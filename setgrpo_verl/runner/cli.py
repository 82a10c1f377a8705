"""Command line of setgrpo-verl (``setgrpo-verl ...`` or ``python -m setgrpo_verl ...``).

Every training command launches verl's own ``python -m verl.trainer.main_ppo`` (:mod:`setgrpo_verl.runner.launch`):

* ``calibrate``      roll out the calibration prompts, score each response twice, sketch, write the frozen record;
* ``train``          SetGRPO steps with that record, or ``--estimator grpo``: verl's stock GRPO on the same data;
* ``quickstart``     the main job: calibrate + train SetGRPO (``--baseline``: then verl's GRPO) + report, on the
                     embedded offline defaults (the validation rubrics and the noisy rules grader, whose truth is
                     known; ``--judge local``: the embedded LLM judge on the IFBench prompts);
* ``validate``       a calibration stage with a noisy grader of known noise, then coverage and reversal risk on
                     held-out groups over repeated splits, against the re-scoring and the truth (docs/validation.md);
* ``report``         PNG plots and a text summary from verl's metrics files and the record;
* ``inspect-record`` a calibration record as the paper's Table 4 row;
* ``merge-calibration`` one record from the shard directories of a calibration run as ``calibrate --shard I/N``
                     parts (docs/record.md#calibration-shards);
* ``compare``        the outcome comparison: each arm and seed through ``main_ppo`` with held-out truth reward
                     (:mod:`setgrpo_verl.runner.compare`).

Flags are shorthands for keys of the one configuration (``algorithm.setgrpo.*``, whose ``--help`` texts come from
its field docs, and a few of verl's keys); any further ``key=value`` argument is passed to verl's Hydra config as
it is. ``--dry-run`` prints the run directory's plan (:mod:`setgrpo_verl.runner.lifecycle`) and the verl command lines
without running them. A failing command prints one line
``error: ...`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from .compare import add_parser as _add_compare, run_compare
from .profiles import (FLAGS, MAIN_JOB_FLIP_PROB, PROFILES, default_profile, flag_dest, overrides_from_args,
                       profile_help)
from .run import (Plan, check_before_ray, dir_plan, dry_run_text, hold_lock, make_plan, make_split, record_path,
                  run_stages, stage_commands, start, train_prompts)

__all__ = ["FLAGS", "HANDLERS", "MAIN_JOB_FLIP_PROB", "PROFILES", "build_parser", "main", "overrides_from_args"]


def _flag_help(key: str, text: str | None) -> str:
    if text is not None:
        return f"{text} [{key}]"
    from ..integration.config import field_doc

    return f"{field_doc(key.removeprefix('algorithm.setgrpo.'))} [{key}]"


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}); e.g. '{{\"enable_thinking\": false}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _add_run_options(p: argparse.ArgumentParser, *, profile: str | None = None, judge: str = "local",
                     flip_prob: float | None = None, flip_text: str | None = None) -> None:
    g = p.add_argument_group("inputs (defaults: embedded, offline)")
    g.add_argument("--profile", choices=sorted(PROFILES), default=profile, help=profile_help(profile))
    g.add_argument("--model", default=None, help="local Hugging Face causal-LM directory of the policy (default: the "
                   "embedded SmolLM2-135M-Instruct) [actor_rollout_ref.model.path]")
    default_data = ("the composite validation rubrics shipped in the package with --judge rules, "
                    "the IFBench rubric conversion of the IFBench prompts shipped in the package with any other judge")
    g.add_argument("--data", default=None, help="RubricHub-format .jsonl/.json/.parquet file of prompts with rubrics "
                   f"(default: {default_data})")
    g.add_argument("--duplicate-criteria", choices=("error", "keep_one"), default="error",
                   help="a criterion listed twice in a --data row: 'error' (default: stop, naming how many rows) or "
                   "'keep_one' (keep its first copy; docs/grading.md#rubric-rows)")
    g.add_argument("--judge", choices=("local", "openai", "function", "rules"), default=judge,
                   help="'local' (embedded stochastic SmolLM2 judge), 'openai' (an OpenAI-compatible HTTP judge), "
                        "'function' (a Python reward function, --reward-function) or 'rules' (rule criteria checked by "
                        "code only; without --data: the composite validation rubrics) "
                        f"(default {judge}) [reward.reward_kwargs.grader.type]")
    g.add_argument("--flip-prob", type=float, default=flip_prob, metavar="P",
                   help="wrap the grader in the noisy grader: flip every criterion verdict independently with "
                        "probability P in each scoring, a simulation of an LLM judge's random verdict errors "
                        "(docs/validation.md#noisy-grader)" + (f" (default {flip_prob})" if flip_prob else "")
                        + (f" ({flip_text})" if flip_text else ""))
    g.add_argument("--noise-seed", type=int, default=None, help="seed of the noisy grader's flips (default 0)")
    g.add_argument("--reward-function", default=None, metavar="FILE[:NAME]",
                   help="for --judge function: a Python file defining NAME (default compute_score) with verl's "
                        "custom-reward signature (data_source, solution_str, ground_truth, extra_info)")
    g.add_argument("--judge-model", default=None,
                   help="judge model: a local Hugging Face directory for --judge local, a model name for --judge openai")
    g.add_argument("--judge-base-url", default=None, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    g.add_argument("--judge-temperature", type=float, default=None, help="judge sampling temperature (> 0: SetGRPO "
                   "calibrates a stochastic grader)")
    g.add_argument("--judge-max-tokens", type=int, default=None,
                   help="--judge openai: token budget per verdict (default 16); a reasoning ('thinking') judge needs "
                   "room for its reasoning, e.g. 2048 [reward.reward_kwargs.grader.max_tokens]")
    g.add_argument("--judge-max-response-tokens", type=int, default=None, metavar="N",
                   help="--judge openai or local: cut every response to N tokens before the judge reads it (default: "
                   "local 384, openai uncut); openai counts them from above as UTF-8 bytes (the judge's tokenizer is "
                   "on the server; English keeps about N/4 tokens): set it from the judge's context (context - "
                   "--judge-max-tokens - about 1000, e.g. 7000 for an 8192-token judge) "
                   "[reward.reward_kwargs.grader.max_response_tokens]")
    g.add_argument("--judge-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="--judge openai: chat_template_kwargs sent with every request, e.g. "
                   "'{\"enable_thinking\": false}' to switch a Qwen3 judge's thinking off "
                   "[reward.reward_kwargs.grader.chat_template_kwargs]")
    g.add_argument("--judge-max-concurrency", type=int, default=None, metavar="N",
                   help="--judge openai: at most N requests in flight per reward worker (default 32; fewer while the "
                   "judge answers HTTP 429; docs/grading.md#requests-in-flight) "
                   "[reward.reward_kwargs.grader.max_concurrency]")
    g.add_argument("--actor-ranks", type=int, default=1, help="FSDP2 actor ranks on this machine (gloo)")
    from .launch import CPU_PRECISIONS

    g.add_argument("--precision", choices=CPU_PRECISIONS, default=None,
                   help="CPU compute precision: bf16 (the GPU recipes', default where the CPU has bf16 units) or fp32")
    g.add_argument("--dry-run", action="store_true", help="print the run directory's plan (keep / continue / replace "
                   "/ remove / refuse per directory) and the verl command line(s), and exit")
    g.add_argument("--verbose", action="store_true", help="stream verl's full output (always written to the stage's "
                   "main_ppo.log) instead of progress bars and one line per step")
    g.add_argument("--resume", action="store_true", help="continue an interrupted run directory: finished directories "
                   "are kept, an interrupted stage resumes from its latest verl checkpoint (trainer.resume_mode=auto) "
                   "or starts over without one, the data split is not rewritten (docs/cli.md#resuming-a-run)")
    c = p.add_argument_group("configuration keys (docs/algorithm.md; any other key: pass key=value)")
    for flag, key, typ, text in FLAGS:
        kwargs: dict[str, Any] = dict(dest=flag_dest(flag), type=typ, default=None, help=_flag_help(key, text))
        if flag == "--on-infeasible":
            kwargs["choices"] = ("error", "reject_all")
        if flag == "--ablation":
            from ..integration.config import ABLATIONS

            kwargs["choices"] = ABLATIONS
        names = (flag, "-K") if flag == "--rollout-n" else (flag,)
        c.add_argument(*names, **kwargs)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="further Hydra overrides for verl's main_ppo, e.g. trainer.logger=[console,wandb]")


def build_parser() -> argparse.ArgumentParser:
    """The ``setgrpo-verl`` argument parser (one sub-parser per command)."""
    parser = argparse.ArgumentParser(prog="setgrpo-verl", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("calibrate", help="roll out, score twice, sketch, and write the frozen calibration record")
    p.add_argument("--run-dir", required=True, type=Path, help="run directory (data/ and calibration/ inside)")
    p.add_argument("--overwrite", action="store_true", help="replace data/ and calibration/ and remove what was made from them (training stages, validation/, report/)")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help=_flag_help("algorithm.setgrpo.calibration.shard", None))
    _add_run_options(p)

    p = sub.add_parser("train", help="SetGRPO (or --estimator grpo) training steps through verl's main_ppo")
    p.add_argument("--run-dir", required=True, type=Path, help="run directory (train_<estimator>/ inside)")
    p.add_argument("--estimator", choices=("setgrpo", "grpo"), default="setgrpo")
    p.add_argument("--record", type=Path, default=None,
                   help="frozen record to train with (default: <run-dir>/calibration/record.json)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing train_<estimator>/ (and remove report/)")
    _add_run_options(p)

    p = sub.add_parser("quickstart", help="the main job: calibrate + train SetGRPO + report against the truth on the "
                                          "embedded defaults (--baseline: and verl's GRPO on the same data; "
                                          "--judge local: the LLM-judge demonstration)")
    p.add_argument("--run-dir", type=Path, default=Path("runs/quickstart"))
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=False,
                   help="also train verl's stock GRPO on the same data, reward and seeds, for the report's comparison "
                        "(off by default: about 2.5 more minutes on 2 cores)")
    p.add_argument("--overwrite", action="store_true", help="replace the run directory's data, calibration and stages, and remove what was made from them")
    _add_run_options(p, judge="rules", flip_text=f"default with --judge rules: {MAIN_JOB_FLIP_PROB}")

    p = sub.add_parser("validate", help="calibrate on a noisy grader with known truth, then check coverage and "
                       "reversal risk on held-out groups over repeated splits (docs/validation.md#validation)")
    p.add_argument("--run-dir", required=True, type=Path,
                   help="run directory (data/, calibration/ and validation/ inside)")
    p.add_argument("--overwrite", action="store_true", help="replace data/, calibration/ and validation/ (with --analysis-only: validation/ only) and remove what was made from them")
    p.add_argument("--splits", type=int, default=20, help="R, repeated calibration / held-out splits (default 20)")
    p.add_argument("--holdout-fraction", type=float, default=0.25,
                   help="share of the groups held out in each split (default 0.25)")
    p.add_argument("--analysis-only", action="store_true",
                   help="skip the calibration stage: analyse the run directory's calibration/paired_scores.npz again "
                        "(levels from its record unless given as flags)")
    _add_run_options(p, profile="validate", judge="rules", flip_prob=0.1)

    p = sub.add_parser("report", help="PNG plots and a text summary of a run directory, or (--outcome) the analysis "
                       "of finished outcome-comparison runs")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--run-dir", type=Path, help="a run directory of calibrate, train, quickstart or validate")
    which.add_argument("--outcome", type=Path, metavar="DIR",
                       help="a directory of finished outcome-comparison runs <arm>_s<seed>/ (metrics.jsonl, command.sh): "
                            "the committed validation/outcome_verl/flip<P>/, or a compare run directory's compare/ "
                            "once every run in it finished; writes DIR/outcome.json and DIR/outcome.txt")
    p.add_argument("--figure", type=Path, default=None,
                   help="with --outcome: where the figure goes (default DIR/outcome.png)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write the report to DIR instead of <run-dir>/report/ (with --outcome: instead of DIR/) - "
                        "for a directory this user cannot write")

    p = sub.add_parser("merge-calibration", help="one record from the shard directories of calibrate --shard I/N parts")
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIR",
                   help="each part's calibration directory (<run-dir>/calibration, or its shards/)")
    p.add_argument("--out", required=True, type=Path, help="directory of the record (record.json, paired_scores.npz)")
    p.add_argument("--pilot", type=Path, default=None, help="pilot record on other prompts whose tau_sel is the fixed "
                   "sequence's tau_start; the record names it as the start's source")

    p = sub.add_parser("inspect-record", help="print a calibration record as the paper's Table 4 row")
    p.add_argument("record", type=Path, help="record.json, or a run directory holding calibration/record.json")
    p.add_argument("--thresholds", action="store_true", help="also print the per-threshold table (N_j, F_j, UCB_j, U_j)")
    _add_compare(sub, _add_run_options)
    return parser


def _plan(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> Plan:
    """The command's checked plan (:func:`~setgrpo_verl.runner.run.make_plan`); ``defaults`` hold where neither a
    flag nor the profile sets a key."""
    return make_plan(args, {**(defaults or {}), **overrides_from_args(args)})


def _cmd_calibrate(args: argparse.Namespace) -> str | None:
    """``calibrate``: split the data, then the calibration stage (the frozen record)."""
    from ..core.shards import parse_part
    from .preflight import check_calibration_size
    from ..rundir import LaunchError

    if args.shard is not None:
        try:
            parse_part(args.shard)
        except ValueError as exc:
            raise LaunchError(f"--{exc}") from None
    plan = _plan(args, defaults={"algorithm.setgrpo.calibration.shard": args.shard} if args.shard else None)
    commands = stage_commands(args, plan, ["calibrate"], record_path(args.run_dir))
    check_calibration_size(plan.values)
    split = make_split(args, plan)
    lifecycle = dir_plan(args, ["data", "calibration"], split=split)
    check_before_ray(args, commands, lifecycle, split)
    if args.dry_run:
        return dry_run_text(commands, lifecycle, judge=args.judge)
    start(args, plan, lifecycle, split)
    run_stages(args, commands, lifecycle)
    return None


def _cmd_quickstart(args: argparse.Namespace) -> str | None:
    """``quickstart``: calibrate and train in one verl process (or train with a kept calibration), with
    ``--baseline`` the GRPO baseline, then the report."""
    from .preflight import check_calibration_size, check_training_steps

    if args.judge == "rules" and args.flip_prob is None:  # the main job: the noisy rules grader, truth known
        args.flip_prob = MAIN_JOB_FLIP_PROB
    plan = _plan(args)
    check_calibration_size(plan.values)
    split = make_split(args, plan)
    writes = ["data", "calibration", "train_setgrpo"] + (["train_grpo"] if args.baseline else []) + ["report"]
    lifecycle = dir_plan(args, writes, split=split)
    first = "train" if lifecycle.action("calibration") == "keep" else "calibrate_train"
    commands = stage_commands(args, plan, [first] + (["grpo"] if args.baseline else []), record_path(args.run_dir))
    if split is not None:
        check_training_steps(plan.values, args.overrides, train_prompts(args.run_dir, split))
    check_before_ray(args, commands, lifecycle, split)
    if args.dry_run:
        return dry_run_text(commands, lifecycle, judge=args.judge)
    start(args, plan, lifecycle, split)
    lifecycle.prepare("report")  # an old report describes the stages about to be run again
    run_stages(args, commands, lifecycle)
    lifecycle.prepare("report")
    return _report(args.run_dir)


def _cmd_train(args: argparse.Namespace) -> str | None:
    """``train``: SetGRPO with the run's record (or ``--estimator grpo``) on the split ``calibrate`` wrote."""
    from . import datasplit, preflight
    from ..rundir import STAGES, LaunchError

    plan = _plan(args)
    run_dir = args.run_dir
    stage = "train" if args.estimator == "setgrpo" else "grpo"
    record = args.record if args.record is not None else record_path(run_dir)
    commands = stage_commands(args, plan, [stage], record)
    reads = ("data",) + (("calibration",) if stage == "train" and args.record is None else ())
    lifecycle = dir_plan(args, [STAGES[stage]], reads=reads)

    def check_data() -> None:  # after the directories' check: it reads them
        datasplit.check_split_flags(run_dir, data=args.data, calib_groups=args.calib_groups)
        preflight.check_training_steps(plan.values, args.overrides, train_prompts(run_dir, None))
        if stage == "train":
            if not Path(record).is_file():
                raise LaunchError(f"calibration record {record} not found: run `setgrpo-verl calibrate --run-dir "
                                  f"{run_dir}` first or pass --record")
            preflight.check_training_prompts(record, run_dir)

    check_before_ray(args, commands, lifecycle, None, checks=(check_data,))
    if args.dry_run:
        return dry_run_text(commands, lifecycle, judge=args.judge)
    start(args, plan, lifecycle, None)
    run_stages(args, commands, lifecycle)
    return None


def _cmd_validate(args: argparse.Namespace) -> str | None:
    """``validate``: a calibration stage with a grader of known noise, then the held-out analysis."""
    from .preflight import check_validation_size

    # the stage's own record is not what validate measures: each split calibrates again (reject_all there too)
    plan = _plan(args, defaults={} if args.analysis_only else {"algorithm.setgrpo.calibration.on_infeasible":
                                                                 "reject_all"})
    _check_validate(args, plan.values)
    if args.analysis_only:
        lifecycle = dir_plan(args, ["validation"], reads=("calibration",))
        check_before_ray(args, [], lifecycle, None)
        if args.dry_run:
            return dry_run_text([], lifecycle)
        return _analyse(args, plan.values, lifecycle)
    commands = stage_commands(args, plan, ["calibrate"], record_path(args.run_dir))
    warning = check_validation_size(plan.values, args.holdout_fraction)
    if warning and not args.dry_run:
        print(f"[setgrpo-verl] warning: {warning}", flush=True)
    split = make_split(args, plan)
    lifecycle = dir_plan(args, ["data", "calibration", "validation"], split=split)
    check_before_ray(args, commands, lifecycle, split)
    if args.dry_run:
        return dry_run_text(commands, lifecycle, judge=args.judge)
    start(args, plan, lifecycle, split)
    if lifecycle.action("calibration") == "replace":
        lifecycle.prepare("validation")  # its results were made from the calibration about to be replaced
    run_stages(args, commands, lifecycle)
    return _analyse(args, plan.values, lifecycle)


def _cmd_report(args: argparse.Namespace) -> str:
    """``report``: PNG plots and a text summary of a run directory; ``--outcome DIR``: the outcome comparison's
    analysis of the finished runs in ``DIR`` (docs/cli.md#compare).

    Raises:
        LaunchError: ``--figure`` without ``--outcome``, or outcome files that cannot be written.
        ReportError: a run directory without a finished calibration, or outcome runs the analysis refuses
            (:func:`~setgrpo_verl.report.outcome.read_runs`, :func:`~setgrpo_verl.report.outcome.outcome_rows`).
    """
    if args.outcome is not None:
        from ..report.outcome import outcome_report, read_runs, write_outcome

        curves, flip_prob, unfinished = read_runs(args.outcome)
        result, text = outcome_report(curves, flip_prob=flip_prob, unfinished=unfinished)
        out = args.outcome if args.out is None else args.out
        from .writes import writing

        with writing(out, "report --outcome's analysis"):
            out.mkdir(parents=True, exist_ok=True)
            written = write_outcome(out, curves, result, text, figure=args.figure)
        return f"written: {written}, {out / 'outcome.txt'}, {args.figure or out / 'outcome.png'}\n{text}"
    if args.figure is not None:
        from ..rundir import LaunchError

        raise LaunchError("report --figure goes with --outcome DIR (the comparison's figure); a run directory's "
                          "report writes its figures into <run-dir>/report/")
    if args.out is None and (args.run_dir / "report").exists():
        from .lifecycle import plan_run

        plan_run(args.run_dir, ["report"]).prepare("report")
    from .writes import writing

    with writing(args.out or args.run_dir / "report", "the report"):
        return _report(args.run_dir, out=args.out)


def _report(run_dir: Path, out: Path | None = None) -> str:
    """The run directory's report (:func:`~setgrpo_verl.report.make_report`) with its check against the truth where
    the grader knew it (:func:`~setgrpo_verl.runner.truth.truth_report_lines`).

    Raises:
        ReportError: no finished calibration, or paired scores that do not load.
    """
    from ..report import ReportError, make_report
    from ..rundir import COMPLETE
    from .truth import truth_report_lines

    if not (run_dir / "calibration" / COMPLETE).is_file():
        return make_report(run_dir, out=out)  # which says what is missing
    try:
        truth = truth_report_lines(run_dir)
    except (OSError, ValueError) as exc:
        raise ReportError(f"{run_dir}: the check against the truth: {exc}") from None
    return make_report(run_dir, truth=truth, out=out)


def _cmd_inspect_record(args: argparse.Namespace) -> str:
    """``inspect-record``: a record as the paper's Table 4 row, its levels, identities and package versions."""
    from ..report import inspect_record

    return inspect_record(args.record, thresholds=args.thresholds)


def _cmd_merge_calibration(args: argparse.Namespace) -> str:
    """``merge-calibration``: the record of a sharded calibration from its parts' shard directories."""
    from ..core.record_text import table4_row
    from .merge import merge_calibration

    record = merge_calibration(args.dirs, args.out, pilot=args.pilot)
    return f"record written to {args.out / 'record.json'}: {table4_row(record)}"


#: The handler of each subcommand: ``handler(args) -> text to print or None``.
HANDLERS: dict[str, Callable[[argparse.Namespace], str | None]] = {
    "calibrate": _cmd_calibrate,
    "train": _cmd_train,
    "quickstart": _cmd_quickstart,
    "validate": _cmd_validate,
    "report": _cmd_report,
    "inspect-record": _cmd_inspect_record,
    "merge-calibration": _cmd_merge_calibration,
    "compare": run_compare,
}


def _check_validate(args: argparse.Namespace, values: dict[str, Any]) -> None:
    from .launch import LaunchError

    if args.splits < 1:
        raise LaunchError(f"--splits {args.splits}: need at least one split")
    if not 0.0 < args.holdout_fraction < 1.0:
        raise LaunchError(f"--holdout-fraction {args.holdout_fraction}: must be in (0, 1)")
    if args.flip_prob is None and args.judge == "rules":
        raise LaunchError("--judge rules scores every response the same way twice, so there is no noise to calibrate: "
                          "give --flip-prob")
    if values.get("algorithm.setgrpo.ablation") is not None or values.get("algorithm.setgrpo.fixed_tau") is not None:
        raise LaunchError("validate calibrates the full method and every ablation itself: drop --ablation / --fixed-tau")


def _analyse(args: argparse.Namespace, values: dict[str, Any], lifecycle) -> str:
    """The offline part of ``validate``: repeated splits of the stage's paired scores, JSON + PNG + table; the
    ``validation/`` directory is only replaced once the new results exist."""
    from ..core import CalibrationRecord
    from ..report import summary_table, write_validation
    from ..rundir import STAGES, LaunchError, complete_seconds
    from .validate import load_paired, run_validation

    calibration = args.run_dir / STAGES["calibrate"]
    out = args.run_dir / "validation"
    if lifecycle.action("validation") == "keep":
        return f"{out} is complete, kept (--resume): {out / 'validation.json'}"
    record = CalibrationRecord.from_json(calibration / "record.json")
    explicit = {"alpha": args.alpha, "beta": args.beta, "delta": args.delta, "rho": args.rho,
                "tau_grid": None if args.tau_grid is None else tuple(args.tau_grid)}
    try:
        levels = record.settings.replace(**{k: v for k, v in explicit.items() if v is not None})
    except ValueError as exc:
        raise LaunchError(f"validate --analysis-only: {exc}") from None
    t0 = time.perf_counter()
    try:
        paired = load_paired(calibration / "paired_scores.npz")
        result = run_validation(paired, levels=levels, n_splits=args.splits, holdout_fraction=args.holdout_fraction,
                                first_seed=int(values.get("algorithm.setgrpo.calibration.split_seed") or 0),
                                metadata={"loss_agg_mode": record.loss_agg_mode, "sketch": record.sketch,
                                          "grader": record.grader, "policy": record.policy,
                                          "training": record.training})
    except (OSError, ValueError) as exc:
        raise LaunchError(f"validate: {exc}") from None
    result.report["analysis_seconds"] = round(time.perf_counter() - t0, 1)
    # None where calibration/ was written by quickstart's combined stage (its time is the whole stage's)
    result.report["calibration_stage_seconds"] = complete_seconds(calibration)
    lifecycle.prepare("validation")
    paths = write_validation(result, out)
    from ..rundir import mark_complete

    mark_complete(out, result.report["analysis_seconds"])
    return f"{summary_table(result.report)}\nwritten: {paths['json']}, {paths['png']}, {paths['groups']}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``setgrpo-verl``; returns the process exit status."""
    args = build_parser().parse_args(argv)
    # verl's engine registry warns once per optional engine it cannot import (megatron, veomni, ...): the command
    # line never uses them, and those ten lines would bury its own output
    warnings.filterwarnings("ignore", message=r"\w+ engine is not available", category=UserWarning)
    from ..report import ReportError
    from ..rundir import LaunchError
    from .writes import USER_FIXABLE, write_error

    try:
        with contextlib.ExitStack() as args.lock:
            args.argv = ["setgrpo-verl", *(sys.argv[1:] if argv is None else argv)]
            if getattr(args, "run_dir", None) is not None and args.run_dir.is_dir():
                hold_lock(args)  # before the run directory is looked at; a new one is locked when it is created
            text = HANDLERS[args.command](args)
        if text:
            print(text)
        return 0
    except (LaunchError, ReportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a write the user can fix (full disk, read-only directory) that no step named
        if exc.errno not in USER_FIXABLE:
            raise
        print(f"error: {write_error(exc, getattr(args, 'run_dir', None), 'a file')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; the stage directory is left without its COMPLETE marker", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
