"""How often a finished run's calibration certifies a threshold: bootstrap of its calibration groups.

Reads ``<run-dir>/calibration/paired_scores.npz`` (point and reference scores and Gram matrices of every
calibration group) and ``record.json`` (the levels, grid, rho and split seed), and draws ``--resamples``
bootstrap sets of the non-degenerate share of ``--groups`` groups (default: as many as the run calibrated on; the
degenerate groups, which calibration drops, are left out). Each set is stratified by the
run's own split: its coverage part is drawn with replacement from the run's coverage groups and its risk part from
the run's risk groups, in the positions where re-calibration puts them, so no group (or copy of one) is in both
parts, as no group is in a real calibration. Each set is re-calibrated with the record's settings (its levels,
grid, SRGO procedure and start threshold, the run's risk fraction, no coverage cap; ``on_infeasible="reject_all"``)
and the sets whose record selects a
threshold are counted (docs/record.md#threshold-grid-srgo). The last line is ``quickstart certifies in R of N
resamples``.

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

from setgrpo_verl.core import CalibrationRecord, calibrate, coverage_risk_split, degenerate_groups


def certified(paired: dict[str, torch.Tensor], record: CalibrationRecord, rows: np.ndarray,
              risk_fraction: float) -> bool:
    """Whether re-calibrating on the groups ``rows`` (int64 indices, repeats allowed) with the record's settings, the
    run's risk fraction and no coverage cap selects a threshold."""
    settings = record.settings.replace(on_infeasible="reject_all", risk_fraction=risk_fraction, coverage_groups=None)
    rec = calibrate(paired["point"][rows], paired["reference"][rows], paired["gram"][rows], settings,
                    split_seed=record.split_seed, degenerate_rtol=record.degenerate_rtol)
    return rec.tau_sel is not None


def run_split(point: torch.Tensor, record: CalibrationRecord) -> tuple[np.ndarray, np.ndarray]:
    """The run's coverage and risk groups (int64 indices into ``point`` [G, K]), as its calibration split them: the
    split's permutation depends only on the number of non-degenerate groups and the seed, and the record's
    ``n_risk`` says where it was cut (whatever risk fraction and coverage cap the run used).

    Raises:
        SystemExit: the paired scores do not have the record's group counts and K (another calibration's scores).
    """
    live = (~degenerate_groups(point, record.degenerate_rtol)).nonzero().flatten()
    n_live = int(live.numel())
    if (n_live, point.shape[0] - n_live, point.shape[1]) != (record.n_cov + record.n_risk, record.n_degenerate,
                                                             record.K):
        raise SystemExit(f"the paired scores hold {point.shape[0]} groups of K={point.shape[1]} ({n_live} "
                         f"non-degenerate), the record {record.n_cov} + {record.n_risk} non-degenerate and "
                         f"{record.n_degenerate} degenerate of K={record.K}: pass the run's own calibration directory")
    cov, risk = coverage_risk_split(n_live, split_seed=record.split_seed, risk_fraction=record.n_risk / n_live,
                                    coverage_groups=None)
    return live[cov].numpy(), live[risk].numpy()


def stratified_rows(coverage: np.ndarray, risk: np.ndarray, n: int, split_seed: int, risk_fraction: float,
                    rng: np.random.Generator) -> np.ndarray:
    """``n`` group indices (int64 [n]) whose re-calibration split (:func:`coverage_risk_split` with ``split_seed``,
    ``risk_fraction`` and no coverage cap; the rows are all non-degenerate) puts draws with replacement from
    ``coverage`` at its coverage positions and from ``risk`` at its risk positions."""
    cov_pos, risk_pos = coverage_risk_split(n, split_seed=split_seed, risk_fraction=risk_fraction,
                                            coverage_groups=None)
    rows = np.empty(n, dtype=np.int64)
    rows[cov_pos.numpy()] = rng.choice(coverage, size=cov_pos.numel(), replace=True)
    rows[risk_pos.numpy()] = rng.choice(risk, size=risk_pos.numel(), replace=True)
    return rows


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
    coverage, risk = run_split(paired["point"], record)
    live = round(groups * (coverage.size + risk.size) / total)  # the run's share of non-degenerate groups
    risk_fraction = risk.size / (coverage.size + risk.size)  # the run's own, whatever its settings were
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    hits = sum(certified(paired, record, stratified_rows(coverage, risk, live, record.split_seed, risk_fraction, rng),
                         risk_fraction)
               for _ in range(args.resamples))
    elapsed = time.perf_counter() - t0
    levels = record.settings
    print(f"run: {args.run_dir} ({total} calibration groups, K={record.K}; alpha={levels.alpha}, beta={levels.beta}, "
          f"delta={levels.delta}, {len(levels.tau_grid)} thresholds); the run itself "
          f"{'certified tau_sel=' + format(record.tau_sel, 'g') if record.tau_sel is not None else 'certified none'}")
    print(f"{args.resamples} resamples of {groups} groups ({live} non-degenerate) with replacement, stratified by "
          f"the run's coverage/risk split, in {elapsed:.1f} s")
    print(f"quickstart certifies in {hits} of {args.resamples} resamples")


if __name__ == "__main__":
    main()
