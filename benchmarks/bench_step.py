"""Per-step time of SetGRPO against GRPO through verl's main_ppo, from one run directory, and its split.

Reads verl's metrics files of a run made by ``setgrpo-verl quickstart --baseline`` (``train_setgrpo/`` and ``train_grpo/``,
same prompts, seeds and reward) and prints, per phase, the mean seconds over the steps after the first (the first
step pays one-off warm-ups), and the ratio of the mean step times. The SetGRPO step replaces verl's old-log-prob
forward by the fused old-log-prob + sketch pass (forward + activation-only backward); everything else is verl's.

    python benchmarks/bench_step.py runs/quickstart        # after: setgrpo-verl quickstart --baseline
"""

from __future__ import annotations

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


def phase_means(metrics_file: Path) -> dict[str, float]:
    """Mean seconds per phase over the steps after the first (all steps if there is only one)."""
    steps = [m for m in load_metrics(metrics_file) if "timing_s/step" in m]
    if not steps:
        raise SystemExit(f"{metrics_file}: no training steps")
    steps = steps[1:] or steps
    return {name: float(np.mean([m.get(key, 0.0) for m in steps])) for name, key in PHASES.items()}


def main(argv: list[str]) -> int:
    run = Path(argv[1] if len(argv) > 1 else "runs/quickstart")
    for stage in ("train_setgrpo", "train_grpo"):
        if not (run / stage / "metrics.jsonl").is_file():
            print(f"error: {run / stage / 'metrics.jsonl'} is missing: run `setgrpo-verl quickstart --baseline "
                  f"--run-dir {run}` (the GRPO stage is opt-in), or `setgrpo-verl train --estimator grpo --run-dir "
                  f"{run}` after a quickstart", file=sys.stderr)
            return 2
    setgrpo, grpo = phase_means(run / "train_setgrpo" / "metrics.jsonl"), phase_means(run / "train_grpo" / "metrics.jsonl")
    print(f"{'phase':<26} {'SetGRPO s':>10} {'GRPO s':>10}")
    for name in PHASES:
        print(f"{name:<26} {setgrpo[name]:>10.2f} {grpo[name]:>10.2f}")
    print(f"SetGRPO / GRPO step time: {setgrpo['step'] / grpo['step']:.3f} (paper: 1.26; target <= 1.15)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
