"""The reversal event of SRGO (docs/algorithm.md#4-srgo): one definition for calibration, re-splits, validation
and the online monitor."""

from __future__ import annotations

import torch

from .grpo import degenerate_groups, grpo_coefficients


def reference_coefficients(reference: torch.Tensor, *, norm_by_std: bool, eps: float,
                           degenerate_rtol: float) -> torch.Tensor:
    """``a' = T(r')`` of the reference scores, with degenerate reference groups set to exactly zero
    (docs/algorithm.md#4-srgo).

    A reference group without spread (all K scores equal up to rounding, :func:`degenerate_groups` with the
    record's tolerance) names no direction: its GRPO coefficients are zero in exact arithmetic, but the float mean
    of K = 3, 5 or 6 equal scores does not cancel, and the sign of ``b^T M a'`` would then be noise. Such a group is
    never a reversal.

    Args:
        reference: ``[G, K]`` float reference scores (reward units).
        norm_by_std, eps: the coefficient map (GRPO / Dr.GRPO, verl's eps).
        degenerate_rtol: relative tolerance of the degeneracy test, the record's ``degenerate_rtol``.

    Returns:
        ``[G, K]`` float64 coefficients, zero rows for degenerate reference groups.

    Raises:
        ValueError: bad shape, non-finite scores, or a bad ``eps`` / ``degenerate_rtol``.
    """
    a = grpo_coefficients(reference.to(torch.float64), norm_by_std, eps)
    flat = degenerate_groups(reference, degenerate_rtol)
    return torch.where(flat[:, None], 0.0, a)


def reversal_events(coefficients: torch.Tensor, gram: torch.Tensor, reference: torch.Tensor,
                    accepted: torch.Tensor, *, norm_by_std: bool, eps: float,
                    degenerate_rtol: float) -> torch.Tensor:
    """Accepted groups whose update reverses the reference direction: ``accepted & (b^T M a' < 0)``
    (docs/algorithm.md#4-srgo), with ``a'`` from :func:`reference_coefficients` (degenerate reference groups never
    reverse).

    Args:
        coefficients: ``[..., G, K]`` float updates b (e.g. ``[m, G, K]``, one per threshold, in calibration).
        gram: ``[G, K, K]`` float64 Gram matrices M (the true geometry).
        reference: ``[G, K]`` float reference scores r'.
        accepted: ``[..., G]`` bool, the groups that were accepted (same leading shape as ``coefficients``).
        norm_by_std, eps, degenerate_rtol: the record's coefficient map and degeneracy tolerance.

    Returns:
        ``[..., G]`` bool reversal events.

    Raises:
        ValueError: as :func:`reference_coefficients`, or shapes that do not match.
    """
    a_ref = reference_coefficients(reference, norm_by_std=norm_by_std, eps=eps, degenerate_rtol=degenerate_rtol)
    if tuple(coefficients.shape[-2:]) != tuple(a_ref.shape) or tuple(accepted.shape) != tuple(coefficients.shape[:-1]):
        raise ValueError(f"coefficients {tuple(coefficients.shape)}, accepted {tuple(accepted.shape)} and reference "
                         f"{tuple(reference.shape)} must describe the same [..., G, K] groups")
    inner = torch.einsum("...gi,gij,gj->...g", coefficients.to(torch.float64), gram.to(torch.float64), a_ref)
    return accepted & (inner < 0)
