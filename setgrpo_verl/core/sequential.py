"""Anytime-valid evidence on the online reversal risk (docs/algorithm.md#6-diagnostics): mixture likelihood-ratio
martingales, read after every training step without inflating the error.

For accepted groups with reversal indicators X_1, X_2, ... (each with risk p_i given the past), the likelihood ratio
of a rate q against the boundary rate beta after N groups with F reversals is
``L(q) = (q / beta) ** F * ((1 - q) / (1 - beta)) ** (N - F)``. Mixed over q uniform on [0, beta] (certification) or
on [beta, 1] (drift), it is a non-negative supermartingale with initial value 1 whenever every ``p_i >= beta``
(resp. ``<= beta``), so by Ville's inequality it ever reaches ``1 / delta`` with probability at most delta, however
many steps are looked at.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import brentq
from scipy.special import betainc, betaln

from ._checks import check_counts


def _log_mixture(f: np.ndarray, n: np.ndarray, b: np.ndarray, upper: bool) -> np.ndarray:
    """log of the uniform mixture of ``L(q)`` (boundary b) over q in [0, b] (``upper=False``) or [b, 1]."""
    log_beta_fn = betaln(f + 1, n - f + 1)
    with np.errstate(divide="ignore"):
        mass = np.log(betainc(f + 1, n - f + 1, b) if not upper else betainc(n - f + 1, f + 1, 1 - b))
    width = np.log(b) if not upper else np.log1p(-b)
    return log_beta_fn + mass - width - f * np.log(b) - (n - f) * np.log1p(-b)


def _check(failures, trials, beta: float) -> tuple[np.ndarray, np.ndarray]:
    f, n = check_counts(failures, "failures"), check_counts(trials, "trials")
    if f.shape != n.shape or (f < 0).any() or (f > n).any():
        raise ValueError(f"need 0 <= failures <= trials elementwise, got failures={f}, trials={n}")
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    return f, n


def risk_evidence(failures, trials, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """Log e-values against "risk >= beta" and against "risk <= beta" after N accepted groups with F reversals
    (docs/algorithm.md#6-diagnostics).

    ``log E_low = log of int_0^beta L(q) dq / beta`` (evidence that the risk is below beta) and
    ``log E_high = log of int_beta^1 L(q) dq / (1 - beta)`` (evidence that it is above), in closed form with the
    regularised incomplete beta function. Either exceeds ``log(1 / delta)`` at some step with probability at most
    delta when its null holds at every step.

    Args:
        failures, trials: array-likes of integer counts F (reversals), N (accepted groups), ``0 <= F <= N``.
        beta: the risk level in (0, 1).

    Returns:
        ``(log_e_low, log_e_high)``, float64 arrays of the inputs' shape (``-inf`` where a mixture underflows).

    Raises:
        ValueError: non-integer counts, F > N, or beta outside (0, 1).
    """
    f, n = _check(failures, trials, beta)
    f, n = f.astype(np.float64), n.astype(np.float64)
    return _log_mixture(f, n, np.full(f.shape, float(beta)), False), _log_mixture(f, n, np.full(f.shape, float(beta)),
                                                                                    True)


def anytime_upper_bound(failures: int, trials: int, delta: float) -> float:
    """Anytime-valid upper confidence bound on the reversal risk (docs/algorithm.md#6-diagnostics):
    ``U = inf{b >= F/N : log E_low(b) >= log(1/delta)}``, 1 when no such b (e.g. ``N = 0`` or ``F = N``).

    With probability >= 1 - delta the true risk (of a stationary stream) stays below U at every step at once;
    ``U <= beta`` exactly when ``risk_evidence(F, N, beta)[0] >= log(1/delta)`` (the certification).

    Args:
        failures, trials: integer counts F <= N.
        delta: failure probability in (0, 1).

    Returns:
        U in (0, 1] as a float.

    Raises:
        ValueError: bad counts or delta outside (0, 1).
    """
    f, n = _check([failures], [trials], 0.5)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    f, n = float(f[0]), float(n[0])
    if n == 0 or f == n:
        return 1.0
    target = np.log(1.0 / delta)

    def gap(b: float) -> float:
        return float(_log_mixture(np.array([f]), np.array([n]), np.array([b]), False)[0]) - target

    lo, hi = max(f / n, 1e-300), 1.0 - 1e-12
    if gap(hi) < 0:
        return 1.0
    return float(brentq(gap, lo, hi, xtol=1e-10)) if gap(lo) < 0 else lo
