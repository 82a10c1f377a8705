"""JRSC - Joint Reward Set Calibration (docs/algorithm.md#2-jrsc).

The coefficient set of a group is the ellipsoid ``C = {a_hat + L z : ||z|| <= Q}`` with
``a_hat = T(r)``, ``L = Sigma^{1/2}`` and ``Sigma = J J^T + lambda P`` on the zero-sum subspace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .grpo import centering_projector, grpo_coefficients, grpo_jacobian

SET_SHAPES = ("jacobian", "spherical")


@dataclass(frozen=True)
class CoefficientSets:
    """A batch of G ellipsoidal coefficient sets ``{center + root @ z : ||z|| <= radius}``.

    Attributes:
        center: ``[G, K]`` float64, the point coefficients a_hat = T(r).
        root: ``[G, K, K]`` float64, symmetric PSD root L of Sigma (range = zero-sum subspace).
        pinv: ``[G, K, K]`` float64, pseudo-inverse Sigma^+ on the zero-sum subspace.
        radius: conformal radius Q_alpha (reward units for the Jacobian shape), >= 0.
    """

    center: torch.Tensor
    root: torch.Tensor
    pinv: torch.Tensor
    radius: float

    def support(self, v: torch.Tensor) -> torch.Tensor:
        """Support function ``min_{c in C} v^T c = v^T a_hat - Q ||L v||`` (docs/algorithm.md#2-jrsc).

        Args:
            v: ``[G, K]`` float64 directions.

        Returns:
            ``[G]`` float64, the minimum of ``v^T c`` over each group's set.
        """
        lv = torch.einsum("gij,gj->gi", self.root, v)
        return (v * self.center).sum(-1) - self.radius * lv.norm(dim=-1)

    def contains(self, coefficients: torch.Tensor) -> torch.Tensor:
        """``[G]`` bool: whether ``coefficients`` (``[G, K]``) lie in each set (Mahalanobis radius <= Q)."""
        return mahalanobis(coefficients - self.center, self.pinv) <= self.radius * (1 + 1e-12)


def _zero_sum_basis(k: int) -> torch.Tensor:
    """``[K, K-1]`` float64 orthonormal basis of the zero-sum subspace {x : 1^T x = 0}."""
    evals, evecs = torch.linalg.eigh(centering_projector(k))
    return evecs[:, evals > 0.5]


def set_shape(
    point: torch.Tensor,
    *,
    rho: float,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    shape: str = "jacobian",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shape matrix of each group's coefficient set, as its root L and pseudo-inverse Sigma^+.

    Implements docs/algorithm.md#21-shape: ``Sigma = J J^T + lambda P`` with the scale-free
    ridge ``lambda = rho * tr(J J^T) / (K - 1)``; ``shape="spherical"`` is the ablation
    ``spherical_set`` (docs/algorithm.md#6-diagnostics), ``Sigma = P``. Both matrices are formed in an orthonormal basis B of the
    zero-sum subspace: ``Sigma_B = B^T Sigma B`` is positive definite, ``L = B Sigma_B^{1/2} B^T``
    and ``Sigma^+ = B Sigma_B^{-1} B^T``.

    Args:
        point: ``[G, K]`` point scores (reward units), non-degenerate groups.
        rho: ridge factor, > 0 for GRPO (J is singular along a), >= 0 for Dr.GRPO.
        norm_by_std, eps: the coefficient map T (docs/algorithm.md#1-grpo-map).
        shape: ``"jacobian"`` (JRSC) or ``"spherical"`` (ablation).

    Returns:
        ``(L, Sigma^+)``: two ``[G, K, K]`` float64 tensors. For GRPO, L has units of
        1/reward, Sigma^+ of reward^2.

    Raises:
        ValueError: unknown shape, or a ridge that leaves Sigma singular on the zero-sum subspace.
    """
    if shape not in SET_SHAPES:
        raise ValueError(f"set shape must be one of {SET_SHAPES}, got {shape!r}")
    if not math.isfinite(rho) or rho < 0 or (rho == 0 and norm_by_std and shape == "jacobian"):
        raise ValueError(
            f"rho must be finite and > 0 for the GRPO coefficient map (its Jacobian is singular along the "
            f"coefficient vector), >= 0 for Dr.GRPO; got {rho}"
        )
    g, k = point.shape
    basis = _zero_sum_basis(k)
    if shape == "spherical":
        sigma = centering_projector(k).expand(g, k, k)
    else:
        jac = grpo_jacobian(point, norm_by_std=norm_by_std, eps=eps)
        jjt = jac @ jac.transpose(1, 2)
        ridge = rho * jjt.diagonal(dim1=1, dim2=2).sum(-1) / (k - 1)
        sigma = jjt + ridge[:, None, None] * centering_projector(k)
    sigma_b = basis.T @ sigma @ basis
    sigma_b = 0.5 * (sigma_b + sigma_b.transpose(1, 2))
    evals, evecs = torch.linalg.eigh(sigma_b)
    if (evals[:, 0] <= 0).any():
        bad = int((evals[:, 0] <= 0).nonzero()[0])
        raise ValueError(
            f"coefficient-set shape of group {bad} is singular on the zero-sum subspace (smallest eigenvalue "
            f"{float(evals[bad, 0]):.3g}); degenerate groups must be excluded first, or raise rho"
        )
    root_b = evecs @ torch.diag_embed(evals.sqrt()) @ evecs.transpose(1, 2)
    pinv_b = evecs @ torch.diag_embed(1.0 / evals) @ evecs.transpose(1, 2)
    return basis @ root_b @ basis.T, basis @ pinv_b @ basis.T


def mahalanobis(residual: torch.Tensor, pinv: torch.Tensor) -> torch.Tensor:
    """``sqrt(delta^T Sigma^+ delta)`` per group: ``[G, K]`` x ``[G, K, K]`` -> ``[G]`` float64."""
    quad = torch.einsum("gi,gij,gj->g", residual, pinv, residual)
    return quad.clamp_min(0.0).sqrt()


def nonconformity_scores(
    point: torch.Tensor,
    reference: torch.Tensor,
    *,
    rho: float,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    shape: str = "jacobian",
) -> torch.Tensor:
    """JRSC nonconformity score of each calibration group (docs/algorithm.md#2-jrsc).

    ``S = sqrt(delta^T Sigma^+ delta)`` with ``delta = T(r') - T(r)`` and Sigma from the point
    scores. Roughly pivotal under homoscedastic grader noise.

    Args:
        point, reference: ``[G, K]`` paired scorings of the same responses, non-degenerate point groups.
        rho, norm_by_std, eps, shape: as in :func:`set_shape`.

    Returns:
        ``[G]`` float64 scores, reward units for the Jacobian shape (coefficient units for spherical).
    """
    p = point.to(torch.float64)
    delta = grpo_coefficients(reference.to(torch.float64), norm_by_std, eps) - grpo_coefficients(p, norm_by_std, eps)
    _, pinv = set_shape(p, rho=rho, norm_by_std=norm_by_std, eps=eps, shape=shape)
    return mahalanobis(delta, pinv)


def min_calibration_groups(alpha: float) -> int:
    """Smallest n with ``ceil((n+1)(1-alpha)) <= n``: the fewest coverage groups alpha allows."""
    n = max(1, math.ceil((1 - alpha) / alpha) - 1)
    while math.ceil((n + 1) * (1 - alpha) - 1e-12) > n:
        n += 1
    return n


def conformal_radius(scores: torch.Tensor, alpha: float) -> float:
    """Split-conformal quantile Q_alpha (docs/algorithm.md#23-radius).

    ``Q_alpha`` is the ``ceil((n+1)(1-alpha))``-th smallest of the n calibration scores.
    Guarantee (exchangeability of calibration and new groups):
    ``P(T(r'_new) in C_new) >= 1 - alpha``; for continuous scores coverage is also
    ``<= 1 - alpha + 1/(n+1)``.

    Args:
        scores: ``[n]`` nonconformity scores (float64, finite, >= 0).
        alpha: miscoverage level in (0, 1).

    Returns:
        Q_alpha as a Python float (units of the scores).

    Raises:
        ValueError: alpha outside (0, 1), or fewer groups than the finite-sample index needs.
    """
    if not (0.0 < alpha < 1.0):
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    n = int(scores.numel())
    index = math.ceil((n + 1) * (1 - alpha) - 1e-12)
    if index > n:
        raise ValueError(
            f"too few coverage-calibration groups for alpha={alpha}: have {n} non-degenerate groups, the conformal "
            f"index ceil((n+1)(1-alpha)) = {index} exceeds n; need at least {min_calibration_groups(alpha)} "
            "coverage groups (add calibration prompts or raise alpha)"
        )
    return float(torch.sort(scores.to(torch.float64)).values[index - 1])
