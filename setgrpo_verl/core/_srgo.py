"""SRGO - Selective Risk-Gated Optimization (docs/algorithm.md#4-srgo)."""

from __future__ import annotations

import numpy as np
from scipy.stats import beta as beta_dist

DEFAULT_TAU_GRID = tuple(round(0.05 * j, 2) for j in range(20))  # 0.00, 0.05, ..., 0.95


def clopper_pearson_upper(failures, trials, confidence: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper confidence bound on a binomial proportion.

    ``UCB = Beta.ppf(confidence, F + 1, N - F)`` for ``F < N``, 1 for ``F = N`` and for
    ``N = 0`` (no evidence). ``P(p <= UCB) >= confidence`` for every true proportion p.

    Args:
        failures: array-like of ints F (reversals), ``0 <= F <= N``.
        trials: array-like of ints N (accepted groups), same shape.
        confidence: one-sided level in (0, 1), e.g. ``1 - delta / m`` under Bonferroni.

    Returns:
        float64 numpy array of upper bounds in [0, 1], same shape as the inputs.

    Raises:
        ValueError: confidence outside (0, 1), or counts with F < 0, N < 0 or F > N.
    """
    f = np.asarray(failures, dtype=np.int64)
    n = np.asarray(trials, dtype=np.int64)
    if not (0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if f.shape != n.shape or (f < 0).any() or (n < 0).any() or (f > n).any():
        raise ValueError(f"need 0 <= failures <= trials elementwise, got failures={f}, trials={n}")
    out = np.ones(f.shape, dtype=np.float64)
    ok = f < n
    out[ok] = beta_dist.ppf(confidence, f[ok] + 1, n[ok] - f[ok])
    return out


def select_threshold(
    n_accepted, n_reversals, utility, *, beta: float, delta: float
) -> tuple[np.ndarray, int | None]:
    """SRGO threshold selection over a grid of m thresholds (docs/algorithm.md#4-srgo).

    ``UCB_j`` is the Clopper-Pearson upper bound at confidence ``1 - delta/m`` (Bonferroni, so
    the bounds hold simultaneously for all thresholds). The selected index is
    ``argmax_{j : N_j > 0, UCB_j <= beta} U_j`` with ties broken towards the larger threshold
    (grid assumed increasing). Guarantee (exchangeability): with probability >= 1 - delta over
    the risk set, the conditional reversal risk of accepted updates at the selected threshold
    is <= beta.

    Args:
        n_accepted, n_reversals: ``[m]`` integer counts N_j, F_j on the risk-calibration groups.
        utility: ``[m]`` float U_j (normalised cumulative recovery).
        beta: risk level in (0, 1); delta: failure probability in (0, 1).

    Returns:
        ``(ucb [m] float64, index)`` with ``index = None`` when no threshold is risk-feasible.
    """
    n_acc = np.asarray(n_accepted)
    ucb = clopper_pearson_upper(n_reversals, n_acc, 1.0 - delta / len(n_acc))
    ok = (n_acc > 0) & (ucb <= beta)
    if not ok.any():
        return ucb, None
    u = np.where(ok, np.asarray(utility, dtype=np.float64), -np.inf)
    best = np.flatnonzero(u == u.max())
    return ucb, int(best[-1])
