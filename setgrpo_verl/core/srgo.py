"""SRGO - Selective Risk-Gated Optimization (docs/algorithm.md#4-srgo): the Clopper-Pearson bound, the two testing
procedures over the threshold grid (Bonferroni, Learn-then-Test fixed sequence) and the sample-size plan."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import beta as beta_dist
from scipy.stats import binom

from ._checks import check_counts

DEFAULT_TAU_GRID = tuple(round(0.05 * j, 2) for j in range(20))  # 0.00, 0.05, ..., 0.95
#: The testing procedures of docs/algorithm.md#4-srgo: ``bonferroni`` (the paper's: every threshold at delta / m)
#: and ``fixed_sequence`` (Learn then Test: from a start fixed before calibration, down the grid, each at delta).
PROCEDURES = ("bonferroni", "fixed_sequence")


def clopper_pearson_upper(failures, trials, confidence: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper confidence bound on a binomial proportion (docs/algorithm.md#4-srgo).

    ``UCB = Beta.ppf(confidence, F + 1, N - F)`` for ``F < N``, 1 for ``F = N`` and for
    ``N = 0`` (no evidence). ``P(p <= UCB) >= confidence`` for every true proportion p.

    Args:
        failures: array-like of integer counts F (reversals), ``0 <= F <= N``; integer-valued floats (3.0) are
            accepted, other values refused.
        trials: array-like of integer counts N (accepted groups), same shape.
        confidence: one-sided level in (0, 1), e.g. ``1 - delta / m`` under Bonferroni.

    Returns:
        float64 numpy array of upper bounds in [0, 1], same shape as the inputs.

    Raises:
        ValueError: confidence outside (0, 1), non-integer counts (e.g. 1.5), or counts with F < 0, N < 0 or F > N.
    """
    f = check_counts(failures, "failures")
    n = check_counts(trials, "trials")
    if not (0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if f.shape != n.shape or (f < 0).any() or (n < 0).any() or (f > n).any():
        raise ValueError(f"need 0 <= failures <= trials elementwise, got failures={f}, trials={n}")
    out = np.ones(f.shape, dtype=np.float64)
    ok = f < n
    out[ok] = beta_dist.ppf(confidence, f[ok] + 1, n[ok] - f[ok])
    return out


def binomial_p_values(failures, trials, beta: float) -> np.ndarray:
    """p-values of the tests ``H0: risk > beta`` at each threshold: ``P(Bin(N, beta) <= F)``, 1 for ``N = 0``
    (docs/algorithm.md#4-srgo). ``p <= level`` exactly when the Clopper-Pearson bound at ``1 - level`` is ``<= beta``.

    Args:
        failures, trials: array-likes of integer counts F, N (as :func:`clopper_pearson_upper`).
        beta: risk level in (0, 1).

    Returns:
        float64 numpy array of p-values in [0, 1], same shape.

    Raises:
        ValueError: as :func:`clopper_pearson_upper`, or beta outside (0, 1).
    """
    f, n = check_counts(failures, "failures"), check_counts(trials, "trials")
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    if f.shape != n.shape or (f < 0).any() or (f > n).any():
        raise ValueError(f"need 0 <= failures <= trials elementwise, got failures={f}, trials={n}")
    return np.where(n > 0, binom.cdf(f, n, beta), 1.0).astype(np.float64)


def _check_procedure(procedure: str, start_index, m: int) -> None:
    if procedure not in PROCEDURES:
        raise ValueError(f"procedure={procedure!r}: choose one of {PROCEDURES}")
    if procedure == "bonferroni":
        if start_index is not None:
            raise ValueError(f"start_index={start_index!r} is for procedure='fixed_sequence' only; the Bonferroni "
                             "procedure tests every threshold")
        return
    if isinstance(start_index, bool) or not isinstance(start_index, (int, np.integer)) or not 0 <= start_index < m:
        raise ValueError(f"procedure='fixed_sequence' needs start_index, the grid index of the first threshold tested "
                         f"(an integer in [0, {m})), got {start_index!r}; take it from a pilot record on disjoint "
                         "prompts or set it yourself, never from the calibration groups")


@dataclass(frozen=True)
class ThresholdTests:
    """The SRGO tests over a threshold grid of m thresholds (docs/algorithm.md#4-srgo).

    Attributes:
        procedure: ``bonferroni`` or ``fixed_sequence``.
        order: grid indices in the order tested (Bonferroni: all, ascending; fixed sequence: from the start down to
            index 0, ending at the first failed test).
        levels: the level of each test in ``order`` (delta / m, or delta).
        p_values: ``[m]`` float64 ``P(Bin(N_j, beta) <= F_j)`` for every threshold (tested or not).
        ucb: ``[m]`` float64 Clopper-Pearson bounds at ``1 - level`` (delta / m, or delta).
        certified: ``[m]`` bool: tested and ``N_j > 0`` and ``UCB_j <= beta``.
        stopped_at: fixed sequence: grid index of the failed test that ended the sequence, None when every test down
            to index 0 passed; None for Bonferroni.
        index: the selected grid index (largest utility among certified thresholds, ties to the larger tau), None
            when none is certified.
    """

    procedure: str
    order: tuple[int, ...]
    levels: tuple[float, ...]
    p_values: np.ndarray
    ucb: np.ndarray
    certified: np.ndarray
    stopped_at: int | None
    index: int | None


def threshold_tests(n_accepted, n_reversals, utility, *, beta: float, delta: float, procedure: str = "bonferroni",
                    start_index: int | None = None) -> ThresholdTests:
    """Test ``H0_j: risk at tau_j > beta`` on the risk groups and select a threshold (docs/algorithm.md#4-srgo).

    ``bonferroni``: every threshold at level ``delta / m``; certified thresholds are those with ``N_j > 0`` and the
    Clopper-Pearson bound at ``1 - delta / m`` ``<= beta``. ``fixed_sequence`` (Learn then Test): thresholds
    ``start_index, start_index - 1, ..., 0`` (from the conservative start towards smaller thresholds), each at level
    ``delta``, stopping at the first that fails; certified are the thresholds passed before the stop. Either way the
    family-wise error is ``<= delta``, so with probability ``>= 1 - delta`` every certified threshold, the selected
    one included, has conditional reversal risk ``<= beta`` (exchangeability, given the counts N_j). The start must
    not depend on the calibration groups.

    Args:
        n_accepted, n_reversals: ``[m]`` integer counts N_j, F_j on the risk-calibration groups.
        utility: ``[m]`` float U_j (normalised cumulative recovery).
        beta: risk level in (0, 1); delta: failure probability in (0, 1).
        procedure: one of :data:`PROCEDURES`.
        start_index: fixed sequence only: the grid index tested first.

    Returns:
        :class:`ThresholdTests`.

    Raises:
        ValueError: an unknown procedure, a missing or out-of-range ``start_index`` (or one given to Bonferroni),
            bad counts (:func:`clopper_pearson_upper`), or arrays of different lengths.
    """
    n_acc = check_counts(n_accepted, "n_accepted")
    n_rev = check_counts(n_reversals, "n_reversals")
    u = np.asarray(utility, dtype=np.float64)
    m = len(n_acc)
    if n_rev.shape != (m,) or u.shape != (m,) or m == 0:
        raise ValueError(f"n_accepted, n_reversals and utility must be 1-D of one length m >= 1, got "
                         f"{n_acc.shape}, {n_rev.shape}, {u.shape}")
    _check_procedure(procedure, start_index, m)
    level = delta / m if procedure == "bonferroni" else delta
    ucb = clopper_pearson_upper(n_rev, n_acc, 1.0 - level)
    p_values = binomial_p_values(n_rev, n_acc, beta)
    passes = (n_acc > 0) & (ucb <= beta)
    stopped_at = None
    if procedure == "bonferroni":
        order = tuple(range(m))
        certified = passes
    else:
        order_list = []
        certified = np.zeros(m, dtype=bool)
        for j in range(int(start_index), -1, -1):
            order_list.append(j)
            if not passes[j]:
                stopped_at = j
                break
            certified[j] = True
        order = tuple(order_list)
    index = None
    if certified.any():
        masked = np.where(certified, u, -np.inf)
        index = int(np.flatnonzero(masked == masked.max())[-1])
    return ThresholdTests(procedure=procedure, order=order, levels=tuple(float(level) for _ in order),
                          p_values=p_values, ucb=ucb, certified=certified, stopped_at=stopped_at, index=index)


def select_threshold(
    n_accepted, n_reversals, utility, *, beta: float, delta: float, procedure: str = "bonferroni",
    start_index: int | None = None,
) -> tuple[np.ndarray, int | None]:
    """SRGO threshold selection over a grid of m thresholds (docs/algorithm.md#4-srgo).

    The selected index is ``argmax U_j`` over the thresholds certified by ``procedure`` (see
    :func:`threshold_tests`), ties broken towards the larger threshold (grid assumed increasing). ``bonferroni``
    certifies ``N_j > 0`` and ``UCB_j <= beta`` with ``UCB_j`` the Clopper-Pearson bound at ``1 - delta / m``;
    ``fixed_sequence`` tests from ``start_index`` down, each at ``delta`` (bound at ``1 - delta``), and stops at
    the first failure. Guarantee (exchangeability): with probability >= 1 - delta over the risk set, the
    conditional reversal risk of accepted updates at the selected threshold is <= beta.

    Args:
        n_accepted, n_reversals: ``[m]`` integer counts N_j, F_j on the risk-calibration groups.
        utility: ``[m]`` float U_j (normalised cumulative recovery).
        beta: risk level in (0, 1); delta: failure probability in (0, 1).
        procedure: ``"bonferroni"`` (default, the paper's) or ``"fixed_sequence"``.
        start_index: the fixed sequence's first grid index, chosen without the calibration groups.

    Returns:
        ``(ucb [m] float64, index)`` with ``index = None`` when no threshold is risk-feasible.

    Raises:
        ValueError: as :func:`threshold_tests`.
    """
    tests = threshold_tests(n_accepted, n_reversals, utility, beta=beta, delta=delta, procedure=procedure,
                            start_index=start_index)
    return tests.ucb, tests.index


def certification_power(n_accepted, reversal_rate: float, *, beta: float, level: float) -> np.ndarray:
    """Probability that ``N`` accepted groups with true reversal rate p certify beta at one test of ``level``:
    ``P(Bin(N, p) <= F*(N))``, ``F*(N)`` the largest F whose Clopper-Pearson bound at ``1 - level`` is ``<= beta``
    (docs/algorithm.md#44-sample-size).

    Args:
        n_accepted: array-like of integer counts N >= 0.
        reversal_rate: true reversal rate p in [0, 1].
        beta, level: risk level and test level, each in (0, 1).

    Returns:
        float64 numpy array of probabilities, same shape as ``n_accepted`` (0 where even F = 0 fails).

    Raises:
        ValueError: non-integer or negative counts, or a level outside its range.
    """
    n = check_counts(n_accepted, "n_accepted")
    if (n < 0).any() or not (0.0 < beta < 1.0 and 0.0 < level < 1.0 and 0.0 <= reversal_rate <= 1.0):
        raise ValueError(f"need N >= 0, beta and level in (0, 1), reversal_rate in [0, 1]; got beta={beta}, "
                         f"level={level}, reversal_rate={reversal_rate}")
    f_crit = binom.ppf(level, n, beta).astype(np.int64)  # smallest F with P(Bin(N, beta) <= F) >= level
    f_crit = np.where(binom.cdf(f_crit, n, beta) <= level, f_crit, f_crit - 1)
    return np.where((f_crit >= 0) & (n > 0), binom.cdf(f_crit, n, reversal_rate), 0.0).astype(np.float64)


def required_accepted_groups(beta: float, delta: float, m: int, reversal_rate: float = 0.0, *, power: float = 0.9,
                             procedure: str = "bonferroni", max_groups: int = 10_000_000) -> int:
    """Smallest number N of accepted risk groups that certifies beta with probability ``>= power`` when the true
    reversal rate is ``reversal_rate`` (docs/algorithm.md#44-sample-size; the sample sizes of
    docs/validation.md#profiles).

    Each test runs at level ``delta / m`` (``bonferroni``) or ``delta`` (``fixed_sequence``, the test of the
    selected threshold in the sequence). With no reversal the bound is ``1 - level ** (1 / N)``, so
    ``N = ceil(log(level) / log(1 - beta))`` whatever the power: 72 at the paper's beta = 0.08, delta = 0.05,
    m = 20 under Bonferroni, 36 in the fixed sequence (the floor of any level-delta test). With reversals F is
    binomial and N grows like ``1 / (beta - reversal_rate) ** 2``; the power is not monotone in N (F is an
    integer), so N is the first count after which it stays at or above ``power`` up to 2 N + 1000.

    Args:
        beta: risk level in (0, 1).
        delta: failure probability in (0, 1).
        m: number of thresholds of the grid, >= 1 (used by Bonferroni only).
        reversal_rate: true share of reversals among accepted groups, in [0, beta).
        power: probability of certifying, in (0, 1); default 0.9.
        procedure: one of :data:`PROCEDURES`.
        max_groups: search limit.

    Returns:
        N as an int.

    Raises:
        ValueError: a level outside (0, 1), ``m < 1``, an unknown procedure, a reversal rate outside [0, beta) (no N
            certifies beta when the reversal rate reaches it), or no N up to ``max_groups``.
    """
    if not (0.0 < beta < 1.0 and 0.0 < delta < 1.0 and 0.0 < power < 1.0) or int(m) < 1:
        raise ValueError(f"need beta, delta, power in (0, 1) and m >= 1, got beta={beta}, delta={delta}, "
                         f"power={power}, m={m}")
    if procedure not in PROCEDURES:
        raise ValueError(f"procedure={procedure!r}: choose one of {PROCEDURES}")
    if not 0.0 <= reversal_rate < beta:
        raise ValueError(f"reversal_rate must be in [0, beta={beta}) for beta to be certifiable, got {reversal_rate}; "
                         "raise beta or lower the reversal rate (a stricter method or a less noisy grader)")
    level = delta / int(m) if procedure == "bonferroni" else delta
    n0 = int(np.ceil(np.log(level) / np.log1p(-beta) - 1e-12))
    if reversal_rate == 0.0:
        return n0
    start = n0
    while start <= max_groups:
        n = np.arange(start, min(2 * start + 1000, max_groups) + 1)
        ok = certification_power(n, reversal_rate, beta=beta, level=level) >= power
        if ok[-1]:
            bad = np.flatnonzero(~ok)
            return int(n[0] if bad.size == 0 else n[bad[-1] + 1])
        start = int(n[-1]) + 1
    raise ValueError(f"no N <= {max_groups} certifies beta={beta} at reversal rate {reversal_rate} with power {power}")


def infeasible_text(tau_grid, n_accepted, n_reversals, ucb, *, beta: float, stopped_at: int | None = None) -> str:
    """Why no threshold is risk-feasible (docs/algorithm.md#4-srgo): the smallest Clopper-Pearson bound UCB_j, its
    threshold and counts, against beta; for a fixed sequence (``stopped_at`` given), its first test, which failed.

    Args:
        tau_grid: ``[m]`` thresholds; n_accepted, n_reversals: ``[m]`` counts N_j, F_j; ucb: ``[m]`` UCB_j.
        beta: the risk level.
        stopped_at: the grid index where a fixed sequence stopped (None for Bonferroni).

    Returns:
        ``"the smallest Clopper-Pearson bound is <UCB> at tau=<tau> (N=<N>, F=<F>), above beta=<beta>"``, or
        ``"the fixed sequence failed its first test: the Clopper-Pearson bound at its start tau=<tau> is ..."``.
    """
    if stopped_at is not None:
        j = int(stopped_at)
        return (f"the fixed sequence failed its first test: the Clopper-Pearson bound at its start "
                f"tau={float(tau_grid[j]):.2f} is {float(ucb[j]):.4f} (N={int(n_accepted[j])}, "
                f"F={int(n_reversals[j])}), above beta={beta}")
    j = int(np.argmin(np.asarray(ucb, dtype=np.float64)))
    return (f"the smallest Clopper-Pearson bound is {float(ucb[j]):.4f} at tau={float(tau_grid[j]):.2f} "
            f"(N={int(n_accepted[j])}, F={int(n_reversals[j])}), above beta={beta}")


def risk_group_power(n_risk, accepted_share: float, reversal_rate: float, *, beta: float, level: float) -> np.ndarray:
    """Probability that ``n_risk`` risk groups certify beta at one test of ``level`` when each is accepted with
    probability ``accepted_share`` and an accepted one reverses with probability ``reversal_rate``
    (docs/algorithm.md#44-sample-size): ``sum_N Bin(N; n_risk, share) * certification_power(N)``.

    Args:
        n_risk: array-like of integer risk-group counts >= 0.
        accepted_share: share of risk groups accepted at the threshold, in (0, 1].
        reversal_rate: reversal rate among accepted groups, in [0, 1].
        beta, level: risk level and test level, in (0, 1).

    Returns:
        float64 numpy array of probabilities, the shape of ``n_risk``.

    Raises:
        ValueError: bad counts or shares.
    """
    n_all = check_counts(n_risk, "n_risk")
    if not 0.0 < accepted_share <= 1.0:
        raise ValueError(f"accepted_share must be in (0, 1], got {accepted_share}")
    out = np.empty(n_all.shape, dtype=np.float64)
    for i, n in np.ndenumerate(n_all):
        sd = np.sqrt(n * accepted_share * (1 - accepted_share))
        lo, hi = max(0, int(n * accepted_share - 12 * sd - 5)), min(int(n), int(n * accepted_share + 12 * sd + 5))
        counts = np.arange(lo, hi + 1)
        weights = binom.pmf(counts, n, accepted_share)
        out[i] = float((weights * certification_power(counts, reversal_rate, beta=beta, level=level)).sum())
    return out


def required_risk_groups(beta: float, delta: float, m: int, accepted_share: float, reversal_rate: float = 0.0, *,
                         power: float = 0.9, procedure: str = "bonferroni", max_groups: int = 100_000_000) -> int:
    """Smallest number of risk groups that certifies beta with probability ``>= power`` at a threshold with the
    given accepted share and reversal rate (docs/algorithm.md#44-sample-size): the accepted count is binomial too,
    not its expected value.

    The power (:func:`risk_group_power`) is searched by doubling and bisection; with a random accepted count it is
    close to monotone in the number of groups.

    Args:
        beta, delta, m, reversal_rate, power, procedure: as :func:`required_accepted_groups`.
        accepted_share: share of risk groups accepted at the threshold, in (0, 1].
        max_groups: search limit.

    Returns:
        The number of risk groups, an int.

    Raises:
        ValueError: as :func:`required_accepted_groups`, or no count up to ``max_groups``.
    """
    n_acc = required_accepted_groups(beta, delta, m, reversal_rate, power=power, procedure=procedure)
    level = delta / int(m) if procedure == "bonferroni" else delta

    def ok(n: int) -> bool:
        return bool(risk_group_power([n], accepted_share, reversal_rate, beta=beta, level=level)[0] >= power)

    lo, hi = max(n_acc - 1, 0), max(n_acc, int(n_acc / accepted_share))
    while not ok(hi):
        lo, hi = hi, 2 * hi
        if hi > max_groups:
            raise ValueError(f"no count of risk groups <= {max_groups} certifies beta={beta} with power {power}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def calibration_groups_needed(n_risk: int, *, coverage_groups: int | None, risk_fraction: float = 0.5) -> int:
    """Non-degenerate calibration groups that give ``n_risk`` risk groups under the coverage / risk split of
    :func:`calibrate` (docs/algorithm.md#41-defaults): ``n_risk + min(coverage_groups, n_risk (1 - f) / f)``.

    Args:
        n_risk: risk groups wanted, >= 0.
        coverage_groups: the coverage cap (None: none).
        risk_fraction: the split's risk share f, in (0, 1).

    Returns:
        The number of groups, an int.
    """
    cov = int(np.ceil(n_risk * (1 - risk_fraction) / risk_fraction - 1e-9))
    if coverage_groups is not None:
        cov = min(cov, int(coverage_groups))
    return int(n_risk) + cov


def power_plan(tau_grid, n_accepted, n_reversals, n_risk: int, *, beta: float, delta: float, power: float = 0.9,
               procedure: str = "bonferroni", coverage_groups: int | None = 1000) -> dict | None:
    """The cheapest threshold to certify beta with probability ``power`` at measured rates
    (docs/algorithm.md#44-sample-size): per threshold with an accepted group and a reversal rate below beta, the
    accepted share ``N_j / n_risk`` and rate ``F_j / N_j`` give :func:`required_risk_groups`, and
    :func:`calibration_groups_needed` the non-degenerate calibration groups (50/50 split, coverage capped). For the
    fixed sequence the plan's threshold is its start.

    Args:
        tau_grid, n_accepted, n_reversals: ``[m]`` thresholds and pooled counts N_j, F_j.
        n_risk: the pooled risk groups the counts come from, >= 1.
        beta, delta, power, procedure: as :func:`required_accepted_groups`.
        coverage_groups: the coverage cap of the planned calibration.

    Returns:
        ``{"tau", "procedure", "power", "accepted_share", "reversal_rate", "risk_groups", "calibration_groups"}`` for
        the threshold needing the fewest groups, or None when no threshold's rate is below beta.
    """
    best = None
    for tau, n, f in zip(tau_grid, n_accepted, n_reversals):
        if n == 0 or f / n >= beta:
            continue
        share, rate = n / n_risk, f / n
        risk = required_risk_groups(beta, delta, len(tau_grid), share, rate, power=power, procedure=procedure)
        total = calibration_groups_needed(risk, coverage_groups=coverage_groups)
        if best is None or total < best["calibration_groups"]:
            best = {"tau": float(tau), "procedure": procedure, "power": power, "accepted_share": share,
                    "reversal_rate": rate, "risk_groups": risk, "calibration_groups": total}
    return best
