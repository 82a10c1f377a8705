"""Exchangeable synthetic groups with a noisy grader, shared by the core tests."""

from __future__ import annotations

import torch


def make_groups(n_groups: int, k: int = 6, *, noise: float = 0.15, dim: int = 4, seed: int = 0,
                levels: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(point [G,K], reference [G,K], gram [G,K,K]) float64.

    True response qualities mu ~ U(0, 1); each scoring adds independent N(0, noise^2) grader noise
    (rounded to ``levels`` rubric steps when levels > 0, which creates ties). Per-response gradients
    are ``dim``-dimensional with a shared group component, so Gram matrices are correlated and, for
    dim < K, rank-deficient like real sketches of K responses.
    """
    g = torch.Generator().manual_seed(seed)
    mu = torch.rand(n_groups, k, generator=g, dtype=torch.float64)
    point = mu + noise * torch.randn(n_groups, k, generator=g, dtype=torch.float64)
    reference = mu + noise * torch.randn(n_groups, k, generator=g, dtype=torch.float64)
    if levels:
        point, reference = (torch.round(x * levels) / levels for x in (point, reference))
    shared = torch.randn(n_groups, 1, dim, generator=g, dtype=torch.float64)
    grads = 0.8 * shared + torch.randn(n_groups, k, dim, generator=g, dtype=torch.float64)
    return point, reference, grads @ grads.transpose(1, 2)
