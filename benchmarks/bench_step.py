"""Per-step time of SetGRPO against GRPO through verl's main_ppo, from paired runs, and its split.

Reads verl's metrics files of a run made by ``setgrpo-verl quickstart --baseline`` (``train_setgrpo/`` and
``train_grpo/``, same prompts, seeds and data order; the GRPO baseline scores once, SetGRPO twice), or two metrics
files given with ``--pair`` (for example two ``setgrpo-verl compare`` runs of one seed), and prints, per phase, the
mean seconds over the steps after the first (the first step pays one-off warm-ups), then the SetGRPO / GRPO step
time as the median of the per-step ratios over the steps both runs logged after the first (the issue's measure; it
needs at least 10 such pairs) and as the ratio of the mean step times. The SetGRPO step replaces verl's old-log-prob
forward by the fused old-log-prob + sketch pass (forward + activation-only backward) and scores twice; everything
else is verl's. Run the two stages on one host with nothing else on it: the ratio is only as good as that.

    python benchmarks/bench_step.py runs/quickstart        # after: setgrpo-verl quickstart --baseline --steps 12
    python benchmarks/bench_step.py --pair SETGRPO/metrics.jsonl GRPO/metrics.jsonl
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from setgrpo_verl.report import load_metrics

#: verl's timing keys per phase ("reward" is inside "gen" when the reward loop streams, as in the CPU runs).
PHASES = {
    "gen (rollout + reward)": "timing_s/gen",
    "old log-prob (+ sketch)": "timing_s/old_log_prob",
    "adv": "timing_s/adv",
    "update_actor": "timing_s/update_actor",
    "update_weights": "timing_s/update_weights",
    "step": "timing_s/step",
}


#: Paired steps (after the first) the median ratio needs.
MIN_PAIRS = 10


def step_seconds(metrics_file: Path) -> dict[int, float]:
    """``{global step: timing_s/step}`` of a metrics file (a step logged twice, as after a resume, counts once: its
    last row)."""
    return {int(m["training/global_step"]): float(m["timing_s/step"])
            for m in load_metrics(metrics_file) if "timing_s/step" in m}


def paired_ratio(setgrpo: dict[int, float], grpo: dict[int, float]) -> tuple[float, int]:
    """Median over the steps both runs logged, each run's first logged step left out (it pays one-off warm-ups), of
    SetGRPO's step time / GRPO's, and the number of such steps."""
    steps = sorted((set(setgrpo) - {min(setgrpo, default=0)}) & (set(grpo) - {min(grpo, default=0)}))
    if not steps:
        return math.nan, 0
    return float(np.median([setgrpo[s] / grpo[s] for s in steps])), len(steps)


def phase_means(metrics_file: Path) -> dict[str, float]:
    """Mean seconds per phase over the steps after the first (all steps if there is only one)."""
    steps = [m for m in load_metrics(metrics_file) if "timing_s/step" in m]
    if not steps:
        raise SystemExit(f"{metrics_file}: no training steps")
    steps = steps[1:] or steps
    return {name: float(np.mean([m.get(key, 0.0) for m in steps])) for name, key in PHASES.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("run", nargs="?", type=Path, default=Path("runs/quickstart"),
                       help="a quickstart --baseline run directory (default runs/quickstart)")
    which.add_argument("--pair", nargs=2, type=Path, metavar=("SETGRPO", "GRPO"),
                       help="the two runs' metrics.jsonl instead, SetGRPO's first")
    args = parser.parse_args(argv[1:])
    if args.pair:
        files = args.pair
    else:
        files = [args.run / "train_setgrpo" / "metrics.jsonl", args.run / "train_grpo" / "metrics.jsonl"]
    for path in files:
        if not path.is_file():
            hint = ("" if args.pair else f": run `setgrpo-verl quickstart --baseline --steps 12 --run-dir {args.run}` "
                    "(the GRPO stage is opt-in)")
            print(f"error: {path} is missing{hint}", file=sys.stderr)
            return 2
    setgrpo, grpo = phase_means(files[0]), phase_means(files[1])
    print(f"{'phase':<26} {'SetGRPO s':>10} {'GRPO s':>10}")
    for name in PHASES:
        print(f"{name:<26} {setgrpo[name]:>10.2f} {grpo[name]:>10.2f}")
    median, pairs = paired_ratio(step_seconds(files[0]), step_seconds(files[1]))
    short = f" (only {pairs} paired steps: the target needs >= {MIN_PAIRS})" if pairs < MIN_PAIRS else ""
    print(f"SetGRPO / GRPO step time, ratio of means: {setgrpo['step'] / grpo['step']:.3f}")
    print(f"SetGRPO / GRPO step time, median of {pairs} per-step ratios: {median:.3f} (paper: 1.26; target <= 1.10)"
          + short)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
