"""How often a finished run's calibration certifies a threshold: bootstrap of its calibration groups.

Reads ``<run-dir>/calibration/paired_scores.npz`` (point and reference scores and Gram matrices of every
calibration group) and ``record.json`` (the levels, grid, rho and split seed), draws ``--resamples`` sets of
``--groups`` groups with replacement (default: as many as the run calibrated on), re-calibrates each with the
record's settings (its levels, grid, SRGO procedure and start threshold; ``on_infeasible="reject_all"``) and counts the resamples whose record selects a threshold
(docs/record.md#threshold-grid-srgo). The last line is ``quickstart certifies in R of N resamples``.

    python benchmarks/bench_quickstart_certifies.py --run-dir runs/quickstart [--resamples 200] [--groups 96]

``--groups`` larger than the run's own count estimates what a larger calibration set of the same policy and
grader would give, before paying for it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from setgrpo_verl.core import CalibrationRecord, calibrate


def certified(paired: dict[str, torch.Tensor], record: CalibrationRecord, rows: np.ndarray) -> bool:
    """Whether re-calibrating on the groups ``rows`` (int64 indices, repeats allowed) selects a threshold."""
    rec = calibrate(paired["point"][rows], paired["reference"][rows], paired["gram"][rows], alpha=record.alpha,
                    beta=record.beta, delta=record.delta, tau_grid=record.tau_grid, rho=record.rho,
                    split_seed=record.split_seed, norm_by_std=record.norm_by_std, eps=record.eps,
                    grid_size=record.grid_size, degenerate_rtol=record.degenerate_rtol,
                    srgo_procedure=record.srgo_procedure, tau_start=record.tau_start, on_infeasible="reject_all")
    return rec.tau_sel is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--resamples", type=int, default=200)
    parser.add_argument("--groups", type=int, default=None, help="groups per resample (default: the run's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    calibration = args.run_dir / "calibration"
    record = CalibrationRecord.from_json(calibration / "record.json")
    with np.load(calibration / "paired_scores.npz", allow_pickle=False) as z:
        paired = {k: torch.from_numpy(np.asarray(z[k], dtype=np.float64)) for k in ("point", "reference", "gram")}
    total = paired["point"].shape[0]
    groups = args.groups or total
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    hits = sum(certified(paired, record, rng.integers(0, total, size=groups)) for _ in range(args.resamples))
    elapsed = time.perf_counter() - t0
    print(f"run: {args.run_dir} ({total} calibration groups, K={record.K}; alpha={record.alpha}, beta={record.beta}, "
          f"delta={record.delta}, {len(record.tau_grid)} thresholds); the run itself "
          f"{'certified tau_sel=' + format(record.tau_sel, 'g') if record.tau_sel is not None else 'certified none'}")
    print(f"{args.resamples} resamples of {groups} groups with replacement in {elapsed:.1f} s")
    print(f"quickstart certifies in {hits} of {args.resamples} resamples")


if __name__ == "__main__":
    main()
