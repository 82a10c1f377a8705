"""Plan the main job's flip rate and calibration size offline, from calibration shards that hold the truth.

The main job (``setgrpo-verl quickstart``: the validation rubrics, the noisy rules grader) needs a flip rate at which
SetGRPO trains most groups, and a calibration size at which a fresh run certifies a threshold with probability
>= 0.9 at its levels (docs/cli.md#quickstart). Both can be read off stored shards without a rollout: their Gram
matrices do not depend on the grader, so the groups can be scored again at another flip rate.

* Shards with the noise-free verdicts (``truth_verdicts``, ``criterion_points``; docs/validation.md#noisy-grader)
  are scored again exactly: every verdict flips with probability p, fresh for the point and the reference scoring.
* Shards without them (the committed ``validation/paper/`` run at flip 0.1) are thinned: each response keeps its
  noise ``r - r*`` with probability p / 0.1, else scores its truth. At these rates most noisy responses carry one
  flipped verdict, so this is close to flipping at p, but it is an approximation.

Groups whose Gram matrix is zero (sketches skipped for a group tied on the original scores) are left out. Per flip
rate: the share of non-degenerate groups SetGRPO accepts (NUR) and the reversal rates against the truth of its
accepted updates and of GRPO's, from one calibration on every group; the calibration size that certifies with
probability 0.9 (``core.srgo.power_plan``); and the share of ``--trials`` calibrations on random subsets of each
``--sizes`` that certify a threshold.

    python benchmarks/plan_main_job.py validation/paper --flips 0.04 0.06 0.08 --sizes 96 128
    python benchmarks/plan_main_job.py runs/quickstart/calibration/shards
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import numpy as np
import torch

from setgrpo_verl.core import calibrate, CalibrationSettings, setgrpo_coefficients
from setgrpo_verl.core.grpo import degenerate_groups
from setgrpo_verl.core.reversal import reference_coefficients, reversal_events
from setgrpo_verl.core.srgo import power_plan

#: The flip rate of the committed paper-profile shards (validation/paper/README.md).
PAPER_FLIP = 0.1


def load(directory: str) -> dict[str, np.ndarray]:
    """The shards' arrays, concatenated over the batches: ``point``, ``reference``, ``truth``, ``gram`` and, when
    every shard holds them, ``truth_verdicts`` [G, K, J] and ``criterion_points`` [G, J] (J padded to the widest)."""
    files = sorted(glob.glob(os.path.join(directory, "batch_*.npz")))
    if not files:
        raise SystemExit(f"{directory}: no batch_*.npz shards")
    parts = [dict(np.load(f, allow_pickle=False)) for f in files]
    out = {k: np.concatenate([p[k] for p in parts]) for k in ("point", "reference", "truth", "gram")}
    if all("truth_verdicts" in p for p in parts):
        width = max(p["truth_verdicts"].shape[-1] for p in parts)
        out["truth_verdicts"] = np.concatenate([np.pad(p["truth_verdicts"], ((0, 0), (0, 0), (0, width - p[
            "truth_verdicts"].shape[-1])), constant_values=-1) for p in parts])
        out["criterion_points"] = np.concatenate([np.pad(p["criterion_points"], ((0, 0), (0, width - p[
            "criterion_points"].shape[-1]))) for p in parts])
    return out


def rescore(verdicts: np.ndarray, points: np.ndarray, flip: float, rng: np.random.Generator) -> np.ndarray:
    """One noisy scoring ``[G, K]`` of the noise-free verdicts: each parsed verdict flips with probability ``flip``,
    the score is the met points over the parsed points (positive points: docs/algorithm.md#0-notation)."""
    parsed = verdicts >= 0
    met = np.where(rng.random(verdicts.shape) < flip, 1 - verdicts, verdicts) * parsed
    w = points[:, None, :] * parsed
    return (met * w).sum(-1) / np.maximum(w.sum(-1), 1e-12)


def scorings(data: dict[str, np.ndarray], flip: float, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(point, reference)`` at ``flip``: exact from the verdicts where stored, else thinned (module docstring)."""
    if "truth_verdicts" in data:
        return tuple(torch.from_numpy(rescore(data["truth_verdicts"], data["criterion_points"], flip, rng))
                     for _ in range(2))
    if flip > PAPER_FLIP:
        raise SystemExit(f"shards without verdicts are taken at flip {PAPER_FLIP}; thinning cannot raise it to {flip}")
    truth = data["truth"]
    return tuple(torch.from_numpy(truth + (data[k] - truth) * (rng.random(truth.shape) < flip / PAPER_FLIP))
                 for k in ("point", "reference"))


def _plan_text(plan: dict | None) -> str:
    return "none" if plan is None else f"tau {plan['tau']:g}, {plan['calibration_groups']} groups"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards", help="a directory of calibration shards holding the truth")
    parser.add_argument("--flips", type=float, nargs="+", default=[0.04, 0.06, 0.08, 0.1])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 96, 128, 160])
    parser.add_argument("--trials", type=int, default=200, help="calibrations per size and flip rate")
    parser.add_argument("--alpha", type=float, default=0.2)
    parser.add_argument("--beta", type=float, default=0.3)
    parser.add_argument("--delta", type=float, default=0.05)
    parser.add_argument("--tau-grid", type=float, nargs="+", default=[0.0, 0.2, 0.4, 0.6])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = load(args.shards)
    keep = np.abs(data["gram"]).sum((1, 2)) > 0
    data = {k: v[keep] for k, v in data.items()}
    gram, truth = torch.from_numpy(data["gram"]), torch.from_numpy(data["truth"])
    settings = CalibrationSettings(alpha=args.alpha, beta=args.beta, delta=args.delta, tau_grid=tuple(args.tau_grid),
                                   on_infeasible="reject_all")
    how = "exact re-scoring of the verdicts" if "truth_verdicts" in data else f"thinned from flip {PAPER_FLIP}"
    print(f"{args.shards}: {len(truth)} groups with a Gram matrix ({int((~keep).sum())} without left out), {how}; "
          f"alpha={args.alpha} beta={args.beta} delta={args.delta}, thresholds {args.tau_grid}")
    rng = np.random.default_rng(args.seed)
    for flip in args.flips:
        t0 = time.perf_counter()
        point, reference = scorings(data, flip, rng)
        record = calibrate(point, reference, gram, settings, split_seed=args.seed)
        res = setgrpo_coefficients(point, gram, record)
        live, judged = ~degenerate_groups(point), ~degenerate_groups(truth)
        kw = dict(norm_by_std=True, eps=settings.eps, degenerate_rtol=record.degenerate_rtol)
        setgrpo = reversal_events(res.coefficients, gram, truth, res.accepted, **kw)
        grpo = reversal_events(reference_coefficients(point, norm_by_std=True, eps=settings.eps,
                                                      degenerate_rtol=record.degenerate_rtol), gram, truth, live, **kw)
        plan = power_plan(settings.tau_grid, record.n_accepted, record.n_reversals, record.n_risk, beta=args.beta,
                          delta=args.delta)
        rates = []
        for n in args.sizes:
            hits = 0
            for t in range(args.trials):
                idx = torch.from_numpy(rng.choice(len(truth), n, replace=False))
                hits += calibrate(point[idx], reference[idx], gram[idx], settings, split_seed=t).tau_sel is not None
            rates.append(f"{n}: {hits / args.trials:.2f}")
        print(f"flip {flip:g}: NUR {float(res.accepted.sum() / live.sum()):.2f}; reversals against the truth: SetGRPO "
              f"{float(setgrpo.sum() / (res.accepted & judged).sum()):.3f}, GRPO {float(grpo.sum() / (live & judged).sum()):.3f}; "
              f"power-0.9 plan: {_plan_text(plan)}; "
              f"certify rate by size {', '.join(rates)} ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
