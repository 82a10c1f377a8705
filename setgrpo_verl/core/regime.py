"""The judge's regime from the two scorings of every calibration response (docs/record.md#the-judges-regime).

A calibration scores each response twice with independent judge calls. Their differences measure the judge's noise
without a truth: under noise independent between scorings with mean zero, ``E[(r - r')^2] = 2 sigma^2``, with
``sigma^2`` the noise variance of one scoring. For a rubric grader whose verdicts flip independently with rate
``p`` (the noisy grader's model, docs/validation.md#noisy-grader), two scorings of a criterion disagree with
probability ``q = 2 p (1 - p)``, and a rubric score ``sum_j w_j b_j / W`` then has
``E[(r - r')^2] = q h_g`` with ``h_g = sum_j (w_j / W)^2`` of the group's rubric, so ``p`` follows from the pooled
ratio. Every estimate comes with a 95 % band: a percentile bootstrap over groups (the groups are independent draws of
prompts; the responses of one group are not), and a Clopper-Pearson band for the share of reversed updates.

No verl import; float64 throughout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from scipy.stats import beta as beta_dist

from .grpo import DEGENERATE_RTOL, degenerate_groups, grpo_coefficients
from .reversal import reference_coefficients

__all__ = ["BAND", "Estimate", "Regime", "criterion_concentration", "flip_from_disagreement", "judge_regime"]

#: Level of every band this module gives.
BAND = 0.95


@dataclass(frozen=True)
class Estimate:
    """A figure with its band: ``value`` and the ``low``, ``high`` ends of its 95 % band."""

    value: float
    low: float
    high: float

    def text(self, spec: str = ".3f", scale: float = 1.0) -> str:
        """``value [low, high]`` in ``spec`` after multiplying by ``scale``."""
        return (f"{format(self.value * scale, spec)} [{format(self.low * scale, spec)}, "
                f"{format(self.high * scale, spec)}]")


@dataclass(frozen=True)
class Regime:
    """A judge's regime, read from ``groups`` calibration groups of ``k`` responses each scored twice.

    ``noise_var``: variance of one scoring's error (reward units squared); ``noise_share``: its share of one scoring's
    within-group variance (0: no noise, 1: the within-group spread is all noise); ``flip_rate``: the verdict flip rate
    of a rubric grader (None without the rubrics' points); ``reversed_share``: the share of GRPO updates (groups whose
    first scoring has spread) whose direction a re-scoring reverses, ``a^T M a' < 0`` in the gradient geometry ``M``
    (docs/algorithm.md#4-srgo), ``reversed`` of ``updates`` groups.
    """

    groups: int
    k: int
    noise_var: Estimate
    noise_share: Estimate
    flip_rate: Estimate | None
    reversed_share: Estimate
    reversed: int
    updates: int


def criterion_concentration(points: Sequence[float]) -> float:
    """``h = sum_j (w_j / W)^2`` of one rubric with criterion points ``w_j`` (``W``: the sum of the positive points,
    or of the absolute negative points when none is positive, as ``rubric_score`` normalises): the factor between a
    verdict disagreement rate ``q`` and the expected squared score difference of two scorings, ``q h``.

    Raises:
        ValueError: no criterion with non-zero points, or a non-finite point.
    """
    w = np.asarray([float(p) for p in points], dtype=np.float64)
    if not np.all(np.isfinite(w)) or not np.any(w != 0):
        raise ValueError(f"criterion points {list(points)!r}: need finite points, at least one non-zero")
    pos = w[w > 0].sum()
    norm = pos if pos > 0 else -w[w < 0].sum()
    return float(np.sum((w / norm) ** 2))


def flip_from_disagreement(q: float) -> float:
    """The verdict flip rate ``p`` in [0, 0.5] with ``2 p (1 - p) = q`` (``q`` clipped to [0, 0.5])."""
    q = min(max(float(q), 0.0), 0.5)
    return 0.5 * (1.0 - math.sqrt(max(0.0, 1.0 - 2.0 * q)))


def _band(values: np.ndarray) -> tuple[float, float]:
    lo, hi = np.quantile(values, [(1 - BAND) / 2, (1 + BAND) / 2])
    return float(lo), float(hi)


def _share_band(n: int, total: int) -> Estimate:
    a = (1 - BAND) / 2
    low = 0.0 if n == 0 else float(beta_dist.ppf(a, n, total - n + 1))
    high = 1.0 if n == total else float(beta_dist.ppf(1 - a, n + 1, total - n))
    return Estimate(n / total, low, high)


def judge_regime(point: np.ndarray | torch.Tensor, reference: np.ndarray | torch.Tensor,
                 gram: np.ndarray | torch.Tensor | None = None, concentration: np.ndarray | None = None, *,
                 norm_by_std: bool = True, eps: float = 1e-6, degenerate_rtol: float = DEGENERATE_RTOL,
                 resamples: int = 2000, seed: int = 0) -> Regime:
    """The judge's regime from two scorings of every response (docs/record.md#the-judges-regime).

    Args:
        point, reference: ``[G, K]`` the two scorings of each response (reward units).
        gram: ``[G, K, K]`` per-group Gram matrices of the responses' gradients, or None for the identity (the
            reversal then reads the coefficients' own inner product).
        concentration: ``[G]`` :func:`criterion_concentration` of each group's rubric, or None: then no flip rate.
        norm_by_std, eps, degenerate_rtol: the GRPO map and degeneracy test of the run (the record's).
        resamples: bootstrap resamples of the groups for the bands; seed: their generator's seed.

    Returns:
        :class:`Regime`.

    Raises:
        ValueError: shapes that do not fit, fewer than 2 groups or K < 2, non-finite scores, or no group with spread.
    """
    r1 = torch.as_tensor(point, dtype=torch.float64)
    r2 = torch.as_tensor(reference, dtype=torch.float64)
    if r1.ndim != 2 or r1.shape != r2.shape or r1.shape[0] < 2 or r1.shape[1] < 2:
        raise ValueError(f"point {tuple(r1.shape)} and reference {tuple(r2.shape)}: need the same [G, K] shape, "
                         "G >= 2 groups of K >= 2 responses")
    if not (torch.isfinite(r1).all() and torch.isfinite(r2).all()):
        raise ValueError("non-finite scores: the regime needs both scorings of every response")
    g, k = r1.shape
    if gram is None:
        m = torch.eye(k, dtype=torch.float64).expand(g, k, k)
    else:
        m = torch.as_tensor(gram, dtype=torch.float64)
        if m.shape != (g, k, k):
            raise ValueError(f"gram {tuple(m.shape)}: need [G, K, K] = {(g, k, k)}")
    d2 = ((r1 - r2) ** 2).sum(1).numpy()  # [G] summed squared differences
    within = 0.5 * (r1.var(1) + r2.var(1)).numpy()  # [G] one scoring's within-group variance
    counts = np.random.default_rng(seed).multinomial(g, np.full(g, 1.0 / g), size=resamples).astype(np.float64)
    counts = np.vstack([np.ones(g), counts])  # row 0: the sample itself
    noise = counts @ d2 / (2.0 * k * g)
    spread = counts @ within / g
    share = noise / np.where(spread > 0, spread, np.nan)
    noise_var = Estimate(float(noise[0]), *_band(noise[1:]))
    noise_share = Estimate(float(share[0]), *_band(share[1:]))
    flip = None
    if concentration is not None:
        h = np.asarray(concentration, dtype=np.float64)
        if h.shape != (g,) or not np.all(np.isfinite(h)) or np.any(h <= 0):
            raise ValueError(f"concentration {h.shape}: need [G] = ({g},) positive values, one per group's rubric")
        p = np.vectorize(flip_from_disagreement)(counts @ d2 / (k * (counts @ h)))
        flip = Estimate(float(p[0]), *_band(p[1:]))
    a = grpo_coefficients(r1, norm_by_std, eps)
    b = reference_coefficients(r2, norm_by_std=norm_by_std, eps=eps, degenerate_rtol=degenerate_rtol)
    updates = ~degenerate_groups(r1, degenerate_rtol)
    n = int(updates.sum())
    if n == 0:
        raise ValueError(f"no group of {g} has spread in its first scoring: no GRPO update to reverse")
    reversed_ = int((updates & (torch.einsum("gi,gij,gj->g", a, m, b) < 0)).sum())
    return Regime(groups=g, k=k, noise_var=noise_var, noise_share=noise_share, flip_rate=flip,
                  reversed_share=_share_band(reversed_, n), reversed=reversed_, updates=n)
