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


def required_accepted_groups(beta: float, delta: float, m: int, reversal_rate: float = 0.0, *,
                             max_groups: int = 10_000_000) -> int:
    """Smallest number N of accepted risk groups whose Clopper-Pearson bound certifies beta at confidence
    ``1 - delta / m`` when ``F = ceil(reversal_rate * N)`` of them are reversals (docs/algorithm.md#4-srgo; the
    sample sizes of docs/validation.md#profiles).

    With no reversal the bound is ``1 - (delta / m) ** (1 / N)``, so ``N = ceil(log(delta / m) / log(1 - beta))``
    (72 at the paper's beta = 0.08, delta = 0.05, m = 20). With reversals N grows like
    ``1 / (beta - reversal_rate) ** 2``; because F is rounded up, the bound is not monotone in N, so N is the first
    count after which it stays at or below beta up to 2 N + 1000.

    Args:
        beta: risk level in (0, 1).
        delta: failure probability in (0, 1).
        m: number of thresholds of the grid (Bonferroni), >= 1.
        reversal_rate: expected share of reversals among accepted groups, in [0, beta).
        max_groups: search limit.

    Returns:
        N as an int.

    Raises:
        ValueError: a level outside (0, 1), ``m < 1``, a reversal rate outside [0, beta) (no N certifies beta when
            the reversal rate reaches it), or no N up to ``max_groups``.
    """
    if not (0.0 < beta < 1.0 and 0.0 < delta < 1.0) or int(m) < 1:
        raise ValueError(f"need beta, delta in (0, 1) and m >= 1, got beta={beta}, delta={delta}, m={m}")
    if not 0.0 <= reversal_rate < beta:
        raise ValueError(f"reversal_rate must be in [0, beta={beta}) for beta to be certifiable, got {reversal_rate}; "
                         "raise beta or lower the reversal rate (a stricter method or a less noisy grader)")
    confidence = 1.0 - delta / int(m)
    if reversal_rate == 0.0:
        return int(np.ceil(np.log(delta / int(m)) / np.log1p(-beta) - 1e-12))
    start = 1
    while start <= max_groups:
        n = np.arange(start, min(2 * start + 1000, max_groups) + 1)
        ok = clopper_pearson_upper(np.ceil(reversal_rate * n - 1e-12).astype(np.int64), n, confidence) <= beta
        if ok[-1]:
            bad = np.flatnonzero(~ok)
            return int(n[0] if bad.size == 0 else n[bad[-1] + 1])
        start = int(n[-1]) + 1
    raise ValueError(f"no N <= {max_groups} certifies beta={beta} at reversal rate {reversal_rate}")


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


def infeasible_text(tau_grid, n_accepted, n_reversals, ucb, *, beta: float) -> str:
    """Why no threshold is risk-feasible (docs/algorithm.md#4-srgo): the smallest Clopper-Pearson bound UCB_j, its
    threshold and counts, against beta.

    Args:
        tau_grid: ``[m]`` thresholds; n_accepted, n_reversals: ``[m]`` counts N_j, F_j; ucb: ``[m]`` UCB_j.
        beta: the risk level.

    Returns:
        ``"the smallest Clopper-Pearson bound is <UCB> at tau=<tau> (N=<N>, F=<F>), above beta=<beta>"``.
    """
    j = int(np.argmin(np.asarray(ucb, dtype=np.float64)))
    return (f"the smallest Clopper-Pearson bound is {float(ucb[j]):.4f} at tau={float(tau_grid[j]):.2f} "
            f"(N={int(n_accepted[j])}, F={int(n_reversals[j])}), above beta={beta}")
