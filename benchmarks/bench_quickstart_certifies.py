"""How often a fresh run certifies a threshold: a posterior-predictive estimate, with its interval, from one run.

Reads ``<run-dir>/calibration/record.json`` and ``paired_scores.npz``. Every risk group of the run has an outcome
at each threshold of the grid: not accepted, accepted, or accepted and reversed (:func:`group_outcomes`,
recomputed with the record's radius and checked against the record's counts). A fresh run's risk groups are a new
sample from the population of such outcomes, whose shares are unknown. Their posterior given the run's groups is a
Dirichlet with one count per group (the Bayesian bootstrap); it carries the uncertainty of the acceptance and
reversal rates of every threshold jointly. For each of ``--draws`` posterior draws, ``--runs`` fresh runs of the
run's number of risk groups are drawn from it (multinomial) and tested with the record's SRGO procedure
(:func:`certifies`); the share that certifies is that draw's probability that a fresh run certifies
(:func:`fresh_run_certify`). The estimate is the mean over the draws (the posterior-predictive probability), the
interval the 5 % and 95 % quantiles of the draws (a 90 % credible interval). The coverage radius ``q_alpha`` is
held at the run's: a fresh run's coverage groups move it, and every acceptance with it, a spread this estimate
leaves out.

Resampling the run's own groups instead (a bootstrap) estimates how often that run's data would certify: the
fresh-run rate only if the observed reversal rate were the true one. A run that certified by a small margin had a
low reversal rate by chance, and its bootstrap says it certifies nearly always.

    python benchmarks/bench_quickstart_certifies.py --run-dir runs/quickstart [--draws 400] [--runs 400] [--groups 192]

``--groups`` (default: the run's) sizes the fresh runs' calibration, to estimate what a larger calibration of the
same policy and grader would give before paying for it. The last line is ``fresh runs certify with probability P
(90% interval LO-HI)``. docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from setgrpo_verl.core import CalibrationRecord, setgrpo_coefficients
from setgrpo_verl.core.calibration import coverage_risk_split
from setgrpo_verl.core.grpo import degenerate_groups
from setgrpo_verl.core.reversal import reversal_events
from setgrpo_verl.core.srgo import clopper_pearson_upper


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


def group_outcomes(paired: dict[str, torch.Tensor], record: CalibrationRecord,
                   risk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(accepted, reversed)``, bool ``[n_risk, m]``: whether each risk group is accepted, and reverses, at each of
    the grid's m thresholds, with the record's radius (what calibration counted, group by group).

    Raises:
        SystemExit: a record of an ablation (the outcomes are the paper variant's), or outcomes whose sums are not
            the record's counts ``n_accepted`` / ``n_reversals``.
    """
    s = record.settings
    if s.ablation is not None:
        raise SystemExit(f"the record is of the {s.ablation!r} ablation; this estimate covers the paper variant")
    point, gram, reference = paired["point"][risk], paired["gram"][risk], paired["reference"][risk]
    accepted, reversed_ = [], []
    for tau in s.tau_grid:  # the record's radius, tau fixed: the groups calibration accepted at tau
        at_tau = dataclasses.replace(record, settings=s.replace(ablation="fixed_threshold", fixed_tau=tau),
                                     tau_sel=tau)
        res = setgrpo_coefficients(point, gram, at_tau)
        accepted.append(res.accepted.numpy())
        reversed_.append(reversal_events(res.coefficients, gram, reference, res.accepted, norm_by_std=s.norm_by_std,
                                         eps=s.eps, degenerate_rtol=record.degenerate_rtol).numpy())
    accepted, reversed_ = np.stack(accepted, 1), np.stack(reversed_, 1)
    counts = (tuple(int(x) for x in accepted.sum(0)), tuple(int(x) for x in reversed_.sum(0)))
    if counts != (tuple(record.n_accepted), tuple(record.n_reversals)):
        raise SystemExit(f"recomputed counts N={counts[0]}, F={counts[1]} differ from the record's "
                         f"N={record.n_accepted}, F={record.n_reversals}: pass the run's own calibration directory")
    return accepted, reversed_


def certifies(n_accepted: np.ndarray, n_reversals: np.ndarray, *, beta: float, delta: float, procedure: str,
              start_index: int | None = None) -> np.ndarray:
    """Whether SRGO certifies a threshold (``threshold_tests(...).index is not None``, docs/algorithm.md#4-srgo),
    for many runs at once.

    Args:
        n_accepted, n_reversals: int ``[..., m]`` counts N_j, F_j of each run.
        beta, delta, procedure, start_index: the record's (``start_index``: the fixed sequence's first threshold).

    Returns:
        bool ``[...]``: Bonferroni, some threshold's Clopper-Pearson bound at ``1 - delta / m`` is ``<= beta`` with
        ``N_j > 0``; fixed sequence, the start's bound at ``1 - delta`` is.
    """
    m = n_accepted.shape[-1]
    level = delta / m if procedure == "bonferroni" else delta
    passes = (n_accepted > 0) & (clopper_pearson_upper(n_reversals, n_accepted, 1.0 - level) <= beta)
    return passes.any(-1) if procedure == "bonferroni" else passes[..., start_index]


def fresh_run_certify(accepted: np.ndarray, reversed_: np.ndarray, n_risk: int, test, *, draws: int, runs: int,
                      rng: np.random.Generator) -> np.ndarray:
    """Posterior draws of the probability that a fresh run certifies (module docstring).

    Args:
        accepted, reversed_: bool ``[n, m]`` outcomes of the run's n risk groups (:func:`group_outcomes`).
        n_risk: risk groups of a fresh run.
        test: ``test(n_accepted, n_reversals) -> bool[...]``, e.g. :func:`certifies` with the record's levels.
        draws: posterior draws of the outcome shares (Dirichlet, one count per group).
        runs: fresh runs simulated per draw.
        rng: the random generator.

    Returns:
        float64 ``[draws]``: each draw's share of certifying fresh runs.
    """
    acc, rev = accepted.astype(np.int64), (accepted & reversed_).astype(np.int64)
    out = np.empty(draws)
    for d in range(draws):
        shares = rng.dirichlet(np.ones(acc.shape[0]))
        picks = rng.multinomial(n_risk, shares, size=runs)  # [runs, n]: copies of each group in each fresh run
        out[d] = test(picks @ acc, picks @ rev).mean()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--draws", type=int, default=400, help="posterior draws of the outcome shares")
    parser.add_argument("--runs", type=int, default=400, help="fresh runs simulated per draw")
    parser.add_argument("--groups", type=int, default=None, help="calibration groups of a fresh run (default: the "
                        "run's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    calibration = args.run_dir / "calibration"
    record = CalibrationRecord.from_json(calibration / "record.json")
    with np.load(calibration / "paired_scores.npz", allow_pickle=False) as z:
        paired = {k: torch.from_numpy(np.asarray(z[k], dtype=np.float64)) for k in ("point", "reference", "gram")}
    total = paired["point"].shape[0]
    groups = args.groups or total
    _, risk = run_split(paired["point"], record)
    accepted, reversed_ = group_outcomes(paired, record, risk)
    n_risk = round(groups * risk.size / total)  # the run's share of risk groups
    s = record.settings
    start = None if s.srgo_procedure == "bonferroni" else list(s.tau_grid).index(s.tau_start)

    def test(n_acc, n_rev):
        return certifies(n_acc, n_rev, beta=s.beta, delta=s.delta, procedure=s.srgo_procedure, start_index=start)

    t0 = time.perf_counter()
    probs = fresh_run_certify(accepted, reversed_, n_risk, test, draws=args.draws, runs=args.runs,
                              rng=np.random.default_rng(args.seed))
    lo, hi = np.quantile(probs, [0.05, 0.95])
    print(f"run: {args.run_dir} ({total} calibration groups, {risk.size} risk groups, K={record.K}; alpha={s.alpha}, "
          f"beta={s.beta}, delta={s.delta}, {len(s.tau_grid)} thresholds, {s.srgo_procedure}); the run itself "
          f"{'certified tau_sel=' + format(record.tau_sel, 'g') if record.tau_sel is not None else 'certified none'}"
          f" (N={list(record.n_accepted)}, F={list(record.n_reversals)})")
    print(f"{args.draws} posterior draws x {args.runs} fresh runs of {groups} groups ({n_risk} risk groups), radius "
          f"q_alpha={record.q_alpha:.4g} held, in {time.perf_counter() - t0:.1f} s")
    print(f"fresh runs certify with probability {probs.mean():.2f} (90% interval {lo:.2f}-{hi:.2f})")


if __name__ == "__main__":
    main()
