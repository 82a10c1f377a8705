"""Reliability-weighted GRPO on the mean of two scorings (docs/algorithm.md#9-reliability-weighting)."""

from __future__ import annotations

import math

import torch

from ._checks import check_scores
from .grpo import DEGENERATE_RTOL, degenerate_groups, grpo_coefficients

__all__ = ["noise_scale", "reliability_weights", "reliability_coefficients", "weights_from_noise"]


def noise_scale(points) -> float:
    """The score-noise scale of a rubric row, ``sqrt(sum_c points_c^2) / sum_{points_c > 0} points_c``
    (docs/algorithm.md#94-rubrics-of-different-scales): with every criterion's verdict wrong at one rate, the
    standard deviation of the row's score noise is proportional to it. A row with one -10-point penalty beside one
    positive point has scale ~10, a row of equal positive points ``1 / sqrt(n)``.

    Args:
        points: the row's criterion points (negative: penalties), at least one positive.

    Raises:
        ValueError: no positive point (the score is undefined).
    """
    points = [float(p) for p in points]
    positive = sum(p for p in points if p > 0)
    if positive <= 0:
        raise ValueError(f"points {points}: a rubric row needs a positive point for a score")
    return math.sqrt(sum(p * p for p in points)) / positive


def reliability_weights(point: torch.Tensor, reference: torch.Tensor, rtol: float = DEGENERATE_RTOL, *,
                        scale: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Per-group weights ``w_g = sqrt(max(0, 1 - s2_noise / s2_g))`` of GRPO on the mean of two scorings.

    Implements docs/algorithm.md#9-reliability-weighting. With ``m = (point + reference) / 2`` and
    ``d = point - reference``, ``s2_noise = mean(d^2) / 4`` over every response of the batch (the pooled estimate
    of the grader noise variance of ``m``) and ``s2_g`` the unbiased variance of ``m`` within group g. Under
    additive noise independent between the two scorings, with mean zero and one variance for the batch's
    responses, ``s2_noise`` is unbiased for that variance and ``E[s2_g] = tau2_g + s2_noise`` with ``tau2_g`` the
    group's true-reward variance, so ``w_g^2`` estimates the share of the group's observed spread that is signal.
    A group whose spread is all noise gets weight 0; a noiseless grader (``reference == point``) gives weight 1
    everywhere, i.e. plain GRPO. This is a plug-in estimate, not a certificate: no coverage or reversal-risk
    guarantee is claimed (docs/algorithm.md#92-what-it-guarantees).

    With ``scale`` (each group's :func:`noise_scale`, its rubric's), the noise is pooled in units of the scale and
    each group gets its own variance, ``s2_noise_g = scale_g^2 mean((d / scale)^2) / 4``
    (docs/algorithm.md#94-rubrics-of-different-scales): a batch that mixes rubrics whose point scales differ widely
    (a -10-point penalty criterion beside 1-point ones) no longer lends the large rows' noise to the small ones.

    Args:
        point: ``[G, K]`` float first scoring of every response (reward units).
        reference: ``[G, K]`` float second, independent scoring of the same responses.
        rtol: degeneracy tolerance of :func:`degenerate_groups`, applied to the mean of the two scorings.
        scale: ``[G]`` float > 0, each group's noise scale; None: one noise variance for the batch.

    Returns:
        ``(weights, noise_var)``: ``[G]`` float64 weights in [0, 1] (0 for degenerate groups) and the noise
        variance of the mean (float, reward units squared; with ``scale``, its mean over the groups).

    Raises:
        ValueError: wrong shapes, K < 2, or non-finite scores (see :func:`degenerate_groups`), or ``point`` and
            ``reference`` of different shapes.
    """
    check_scores(point, "point")
    check_scores(reference, "reference")
    if point.shape != reference.shape:
        raise ValueError(f"point {tuple(point.shape)} and reference {tuple(reference.shape)} must have one [G, K] "
                         "shape: score the same responses twice")
    p, r = point.to(torch.float64), reference.to(torch.float64)
    if scale is None:
        noise_var = float((p - r).square().mean() / 4)
        return weights_from_noise((p + r) / 2, noise_var, rtol), noise_var
    s = torch.as_tensor(scale, dtype=torch.float64).reshape(-1)
    if s.shape[0] != p.shape[0] or not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise ValueError(f"scale must hold one finite value > 0 per group ([{p.shape[0]}]), got {tuple(s.shape)}")
    per_group = ((p - r) / s[:, None]).square().mean() / 4 * s.square()
    return weights_from_noise((p + r) / 2, per_group, rtol), float(per_group.mean())


def weights_from_noise(point: torch.Tensor, noise_var: float | torch.Tensor,
                       rtol: float = DEGENERATE_RTOL) -> torch.Tensor:
    """Per-group weights ``w_g = sqrt(max(0, 1 - noise_var_g / s2_g))`` of GRPO on ``point``, given the grader
    noise variance of ``point`` (docs/algorithm.md#91-definition).

    :func:`reliability_weights` calls it with the pooled noise variance of the mean of two scorings; a caller
    that estimates the noise level another way (for example from a share of the groups scored twice) passes its
    own, one per batch or one per group. ``s2_g`` is the unbiased variance of ``point`` within group g; a group
    whose spread is all noise gets weight 0, a live group with zero noise variance weight 1.

    Args:
        point: ``[G, K]`` float training scores (reward units).
        noise_var: the noise variance of ``point`` (reward units squared): a float or a 0-d tensor for the
            whole batch, or a ``[G]`` tensor, one per group.
        rtol: degeneracy tolerance of :func:`degenerate_groups`.

    Returns:
        ``[G]`` float64 weights in [0, 1], 0 for degenerate groups.

    Raises:
        ValueError: wrong ``point`` shape, K < 2 or non-finite scores; a ``noise_var`` that is negative, not
            finite, or neither a scalar nor one value per group.
    """
    check_scores(point, "point")
    noise = torch.as_tensor(noise_var, dtype=torch.float64, device=point.device)
    if noise.ndim > 1 or (noise.ndim == 1 and noise.shape[0] != point.shape[0]):
        raise ValueError(f"noise_var has shape {tuple(noise.shape)}: pass one variance for the batch or one per "
                         f"group ([{point.shape[0]}])")
    if not bool(torch.isfinite(noise).all()) or bool((noise < 0).any()):
        raise ValueError(f"noise_var must be finite and >= 0 (a variance in reward units squared), got {noise_var!r}")
    scores = point.to(torch.float64)
    spread = scores.var(dim=-1, unbiased=True)
    live = ~degenerate_groups(scores, rtol) & (spread > 0)
    share = torch.where(live, 1.0 - noise / torch.where(live, spread, torch.ones_like(spread)),
                        torch.zeros_like(spread))
    return share.clamp(0.0, 1.0).sqrt()


def reliability_coefficients(point: torch.Tensor, reference: torch.Tensor, norm_by_std: bool = True,
                             eps: float = 1e-6, rtol: float = DEGENERATE_RTOL, *,
                             scale: torch.Tensor | None = None) -> torch.Tensor:
    """``[G, K]`` float64 coefficients ``w_g T((point + reference) / 2)``: GRPO on the mean of two scorings, each
    group scaled by its :func:`reliability_weights` (docs/algorithm.md#9-reliability-weighting).

    Args:
        point, reference: ``[G, K]`` float two independent scorings of the same responses.
        norm_by_std, eps: as :func:`grpo_coefficients` (verl's ``norm_adv_by_std_in_grpo`` and epsilon).
        rtol: degeneracy tolerance (see :func:`degenerate_groups`).
        scale: ``[G]`` each group's noise scale (see :func:`reliability_weights`), or None.

    Raises:
        ValueError: see :func:`reliability_weights`.
    """
    weights, _ = reliability_weights(point, reference, rtol, scale=scale)
    mean = (point.to(torch.float64) + reference.to(torch.float64)) / 2
    return grpo_coefficients(mean, norm_by_std, eps) * weights[:, None]
