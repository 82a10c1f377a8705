"""Input validation shared by the core modules: every failure is a ValueError that says what to fix."""

from __future__ import annotations

import numpy as np
import torch


def check_scores(scores: torch.Tensor, name: str) -> None:
    """Raise ValueError unless ``scores`` is a finite floating ``[G, K]`` tensor with K >= 2."""
    if not isinstance(scores, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [G, K], got {type(scores).__name__}")
    if scores.dim() != 2:
        raise ValueError(
            f"{name} must have shape [G, K] (groups x responses per group), got shape {tuple(scores.shape)}; "
            "reshape flat per-response scores with .view(-1, K)"
        )
    if scores.shape[1] < 2:
        raise ValueError(f"{name} has K={scores.shape[1]} responses per group; group-relative methods need K >= 2")
    if not scores.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got dtype {scores.dtype}")
    if not torch.isfinite(scores).all():
        bad = (~torch.isfinite(scores)).nonzero()[0].tolist()
        raise ValueError(
            f"{name} contains NaN/inf (first at group {bad[0]}, response {bad[1]}); "
            "a grader failure must be fixed or the group dropped, never scored as a number"
        )


def check_pair(point: torch.Tensor, reference: torch.Tensor) -> None:
    """Point and reference scorings must be finite ``[G, K]`` tensors of the same shape."""
    check_scores(point, "point")
    check_scores(reference, "reference")
    if point.shape != reference.shape:
        raise ValueError(
            f"point scores {tuple(point.shape)} and reference scores {tuple(reference.shape)} must have the "
            "same shape: both are scorings of the same responses"
        )


def check_gram(gram: torch.Tensor, groups: int, k: int, rtol: float = 1e-6) -> torch.Tensor:
    """Validate a batch of Gram matrices and return it as float64 ``[G, K, K]``.

    A Gram matrix must be finite, symmetric (``|M - M^T| <= rtol * max|M|``) and positive
    semidefinite (smallest eigenvalue ``>= -sqrt(rtol) * max eigenvalue``). The returned
    tensor is exactly symmetrised ``(M + M^T)/2``.
    """
    if not isinstance(gram, torch.Tensor):
        raise ValueError(f"gram must be a torch.Tensor of shape [G, K, K], got {type(gram).__name__}")
    if tuple(gram.shape) != (groups, k, k):
        raise ValueError(
            f"gram must have shape [G, K, K] = [{groups}, {k}, {k}] to match the scores, got {tuple(gram.shape)}"
        )
    if not gram.is_floating_point():
        raise ValueError(f"gram must be a floating tensor, got dtype {gram.dtype}")
    m = gram.to(torch.float64)
    if not torch.isfinite(m).all():
        g = int((~torch.isfinite(m)).flatten(1).any(dim=1).nonzero()[0])
        raise ValueError(f"gram contains NaN/inf (first in group {g}); check the gradient sketches of that group")
    scale = m.abs().flatten(1).amax(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    asym = (m - m.transpose(1, 2)).abs().flatten(1).amax(dim=1)
    if (asym > rtol * scale).any():
        g = int((asym > rtol * scale).nonzero()[0])
        raise ValueError(
            f"gram[{g}] is not symmetric (max |M - M^T| = {float(asym[g]):.3g}, max |M| = {float(scale[g]):.3g}); "
            "a Gram matrix is S S^T of the group's sketches"
        )
    m = 0.5 * (m + m.transpose(1, 2))
    eig = torch.linalg.eigvalsh(m)
    bad = eig[:, 0] < -(rtol**0.5) * eig[:, -1].clamp_min(0.0) - torch.finfo(torch.float64).tiny
    if bad.any():
        g = int(bad.nonzero()[0])
        raise ValueError(
            f"gram[{g}] is not positive semidefinite (smallest eigenvalue {float(eig[g, 0]):.3g}, "
            f"largest {float(eig[g, -1]):.3g}); a Gram matrix is S S^T of the group's sketches"
        )
    return m


def check_counts(values, name: str) -> np.ndarray:
    """``values`` as an int64 array; refuses non-integer values (a count of 1.5 reversals is a caller's bug)."""
    arr = np.asarray(values)
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(f"{name} must be integer counts, got {values!r} (dtype {arr.dtype})")
    if np.issubdtype(arr.dtype, np.floating):
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            raise ValueError(f"{name} must be integer counts, got {float(arr[bad].ravel()[0])!r} among {values!r}; count "
                             "whole groups (a Clopper-Pearson bound is defined for integer counts only)")
    return arr.astype(np.int64)
