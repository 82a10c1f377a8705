"""The GRPO coefficient map T and its Jacobian J (docs/algorithm.md#1-grpo-map)."""

from __future__ import annotations

import torch

from ._checks import check_scores

__all__ = ["DEGENERATE_RTOL", "grpo_coefficients", "grpo_jacobian", "degenerate_groups", "centering_projector"]


#: Default relative tolerance of the degeneracy test (docs/algorithm.md#1-grpo-map), recorded in every calibration record.
#: 1e-6 is about 8 float32 ulps: it absorbs the rounding of sums of fractional points (0.1 + 0.2 vs 0.3) and of the
#: float32 token rewards, far below any real score difference of a rubric (points / total points).
DEGENERATE_RTOL = 1e-6


def degenerate_groups(scores: torch.Tensor, rtol: float = DEGENERATE_RTOL) -> torch.Tensor:
    """Groups whose point scores have no spread beyond rounding (docs/algorithm.md#1-grpo-map).

    A group is degenerate when ``max(r) - min(r) <= rtol * max|r|``, computed on the scores rounded to float32
    (the precision of verl's token-level rewards). The decision therefore depends only on the float32 values: the
    float64 scores of the calibration phase and the float32 rewards of the same responses in training always get
    the same answer, and scores that are equal up to float rounding (``0.1 + 0.2`` vs ``0.3``) count as equal.
    The tolerance is relative to the group's reward scale ``max|r|``, so it does not depend on the reward units;
    an all-zero group is degenerate.

    Args:
        scores: ``[G, K]`` float tensor of rewards (reward units), finite, within the float32 range. For
            bfloat16/float16 rewards the decision is the one for their exact float32 values.
        rtol: relative tolerance, finite and ``>= 0`` (0: only groups that are equal in float32). Calibration
            records store the value they used (``CalibrationRecord.degenerate_rtol``) and training applies it.

    Returns:
        ``[G]`` bool tensor, True for degenerate groups. GRPO's update of such a group is zero up to rounding;
        SetGRPO writes zeros, marks it ``degenerate`` and leaves it out of calibration.

    Raises:
        ValueError: wrong shape, K < 2, non-finite scores, scores beyond the float32 range, or a bad ``rtol``.
    """
    check_scores(scores, "scores")
    if not (isinstance(rtol, (int, float)) and 0.0 <= float(rtol) < 1.0):
        raise ValueError(f"rtol must be a number in [0, 1), got {rtol!r} (default {DEGENERATE_RTOL})")
    r32 = scores.to(torch.float32)
    if not torch.isfinite(r32).all():
        g = int((~torch.isfinite(r32)).any(dim=-1).nonzero()[0])
        raise ValueError(f"scores of group {g} exceed the float32 range (|r| > 3.4e38); rewards must fit verl's "
                         "float32 token rewards - rescale them")
    r = r32.to(torch.float64)
    spread = r.amax(dim=-1) - r.amin(dim=-1)
    return spread <= float(rtol) * r.abs().amax(dim=-1)


def grpo_coefficients(scores: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (or Dr.GRPO) response-level advantages of each group: a = T(r).

    Implements docs/algorithm.md#1-grpo-map with exactly the operations of verl's
    ``compute_grpo_outcome_advantage``: ``(r - mean(r)) / (std(r) + eps)`` with the unbiased
    ``torch.std`` when ``norm_by_std`` (GRPO), ``r - mean(r)`` otherwise (Dr.GRPO). The
    arithmetic runs in the input's dtype, so a float32 input reproduces verl's float32 result.

    Args:
        scores: ``[G, K]`` float tensor, rewards of the K responses of each of G groups.
        norm_by_std: divide by the group's unbiased standard deviation (GRPO) or not (Dr.GRPO).
        eps: the ``epsilon`` of verl's estimator (default 1e-6, verl's default).

    Returns:
        ``[G, K]`` tensor, same dtype as ``scores``: the training coefficients (dimensionless
        for GRPO; reward units for Dr.GRPO). Degenerate groups (all scores equal) come out as
        (near-)zero, exactly as in verl.

    Raises:
        ValueError: wrong shape, K < 2, non-finite scores, or ``eps < 0``.
    """
    check_scores(scores, "scores")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    mean = scores.mean(dim=-1, keepdim=True)
    if not norm_by_std:
        return scores - mean
    std = scores.std(dim=-1, keepdim=True)
    # torch's batched std is exactly 0 on a constant row, while verl's per-group 1-D torch.std sees
    # the rounding of the mean; redo those rows the 1-D way so the result stays bit-identical.
    for i in (scores.amax(dim=-1) == scores.amin(dim=-1)).nonzero().flatten().tolist():
        std[i, 0] = torch.std(scores[i])
    return (scores - mean) / (std + eps)


def centering_projector(k: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The centring projector P = I - 11^T / K, ``[K, K]`` (docs/algorithm.md#1-grpo-map)."""
    return torch.eye(k, dtype=dtype) - torch.full((k, k), 1.0 / k, dtype=dtype)


def grpo_jacobian(scores: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Closed-form Jacobian J = dT/dr of the GRPO map, batched (docs/algorithm.md#1-grpo-map).

    With P = I - 11^T/K, c = P r and s = ||c|| / sqrt(K-1) (the unbiased std):

    * GRPO:    ``J = (1/(s+eps)) * [P - c c^T / ((K-1) s (s+eps))]`` (symmetric; null space
      contains 1 and, up to eps, the coefficient vector a itself);
    * Dr.GRPO: ``J = P``.

    Args:
        scores: ``[G, K]`` float tensor of rewards.
        norm_by_std: GRPO (True) or Dr.GRPO (False).
        eps: verl's epsilon.

    Returns:
        ``[G, K, K]`` float64 tensor, units 1/reward for GRPO, dimensionless for Dr.GRPO.
        For exactly constant groups (zero spread) T is not differentiable in the GRPO mode; their
        Jacobian is returned as zeros (they, and the other degenerate groups of
        :func:`degenerate_groups`, are excluded from calibration and training).

    Raises:
        ValueError: wrong shape, K < 2, non-finite scores, or ``eps < 0``.
    """
    check_scores(scores, "scores")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = scores.to(torch.float64)
    g, k = r.shape
    proj = centering_projector(k).expand(g, k, k)
    if not norm_by_std:
        return proj.clone()
    c = r - r.mean(dim=-1, keepdim=True)
    s = c.norm(dim=-1) / (k - 1) ** 0.5
    degenerate = scores.amax(dim=-1) == scores.amin(dim=-1)  # exactly constant: T is not differentiable there
    s_safe = torch.where(degenerate, torch.ones_like(s), s)
    outer = c.unsqueeze(-1) * c.unsqueeze(-2) / ((k - 1) * s_safe * (s_safe + eps))[:, None, None]
    jac = (proj - outer) / (s_safe + eps)[:, None, None]
    return torch.where(degenerate[:, None, None], torch.zeros_like(jac), jac)
