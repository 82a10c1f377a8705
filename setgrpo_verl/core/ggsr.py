"""GGSR - Geometry-Guided Safe Recovery (docs/algorithm.md#3-ggsr), batched over groups in float64."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .grpo import grpo_coefficients
from .jrsc import CoefficientSets, set_shape

# u(b0) counts as the null update when ||u(b0)||^2 <= NULL_TOL * ||u(a_hat)||^2.
NULL_TOL = 1e-10
_SECULAR_ITERS = 100


def safe_anchor(sets: CoefficientSets, gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Safe anchor ``b0 = argmin_{c in C} c^T M c`` of every group, with a KKT certificate.

    Implements docs/algorithm.md#31-safe-anchor. With ``c = a_hat + L z``, ``A = L M L`` and
    ``h = L M a_hat`` this is the convex trust-region subproblem
    ``min z^T A z + 2 h^T z  s.t. ||z|| <= Q``. ``h`` lies in ``range(A)``, so the unconstrained
    minimiser ``-A^+ h`` exists; if it is inside the ball it is the answer, otherwise the
    solution is ``z = -(A + lam I)^{-1} h`` with ``lam > 0`` the root of the secular equation
    ``1/||z(lam)|| = 1/Q``, found by Newton steps from ``lam = 0`` (More-Sorensen; monotone for
    this concave, increasing function), safeguarded by bisection inside ``[0, ||h||/Q]``, on the
    eigendecomposition of A. Because b0 is the M-minimum-norm
    point of a convex set, ``<u(b0), u(c)> >= ||u(b0)||^2`` for every c in C.

    Args:
        sets: G coefficient sets (center ``[G, K]``, root ``[G, K, K]``, radius Q).
        gram: ``[G, K, K]`` float64 Gram matrices M (symmetric PSD).

    Returns:
        ``(anchor, kkt_residual)``: ``[G, K]`` float64 anchors b0 and ``[G]`` float64 relative
        KKT residuals ``max(stationarity, complementarity, infeasibility)``, each divided by
        ``||h|| + ||A|| Q`` (dimensionless; ~1e-12 when solved).
    """
    root, a, q = sets.root, sets.center, sets.radius
    mat_a = root @ gram @ root
    mat_a = 0.5 * (mat_a + mat_a.transpose(1, 2))
    h = torch.einsum("gij,gj->gi", root @ gram, a)
    mu, vecs = torch.linalg.eigh(mat_a)
    mu = mu.clamp_min(0.0)
    ht = torch.einsum("gji,gj->gi", vecs, h)
    mu_max = mu[:, -1:].clamp_min(torch.finfo(torch.float64).tiny)
    positive = mu > mu.shape[-1] * 1e-13 * mu_max
    z_int = torch.where(positive, -ht / torch.where(positive, mu, torch.ones_like(mu)), torch.zeros_like(ht))
    interior = z_int.norm(dim=-1) <= q

    lam = torch.zeros_like(mu[:, 0])
    if q > 0:
        # h is orthogonal to null(A): drop its rounding-level components there, so that
        # phi(lam) = 1/||z(lam)|| - 1/Q is finite at lam = 0. phi is increasing and concave, so
        # Newton steps from lam = 0 (phi < 0 for every boundary group) increase monotonically
        # to the root (More & Sorensen 1983); the bracket [lo, hi] only guards rounding.
        ht = torch.where(positive, ht, torch.zeros_like(ht))
        lo = torch.zeros_like(lam)
        hi = ht.norm(dim=-1) / q
        for _ in range(_SECULAR_ITERS):
            denom = mu + lam[:, None]
            denom = torch.where(denom > 0, denom, torch.ones_like(denom))  # only where ht == 0
            zn = (ht / denom).norm(dim=-1)
            phi = 1.0 / zn.clamp_min(torch.finfo(torch.float64).tiny) - 1.0 / q
            done = interior | (phi.abs() * q <= 1e-14)
            if bool(done.all()):
                break
            lo = torch.where(phi < 0, lam, lo)
            hi = torch.where(phi > 0, lam, hi)
            dphi = (ht**2 / denom**3).sum(-1) / zn**3
            newton = lam - phi / dphi.clamp_min(torch.finfo(torch.float64).tiny)
            inside = (newton >= lo) & (newton <= hi)
            lam = torch.where(done, lam, torch.where(inside, newton, 0.5 * (lo + hi)))
        denom = mu + lam[:, None]
        z_bnd = -ht / torch.where(denom > 0, denom, torch.ones_like(denom))
        zt = torch.where(interior[:, None], z_int, z_bnd)
        lam = torch.where(interior, torch.zeros_like(lam), lam)
    else:
        zt = torch.zeros_like(ht)
    z = torch.einsum("gij,gj->gi", vecs, zt)
    anchor = a + torch.einsum("gij,gj->gi", root, z)

    znorm = z.norm(dim=-1)
    stationarity = (torch.einsum("gij,gj->gi", mat_a, z) + lam[:, None] * z + h).norm(dim=-1)
    complementarity = (lam * (q - znorm)).abs()
    infeasibility = (znorm - q).clamp_min(0.0)
    scale = h.norm(dim=-1) + mu[:, -1] * max(q, 1e-300) + torch.finfo(torch.float64).tiny
    kkt = torch.stack([stationarity / scale, complementarity / scale, infeasibility / max(q, 1.0)]).amax(0)
    if q == 0:  # the set is the single point a_hat: optimal by definition, no multiplier to certify
        kkt = torch.zeros_like(kkt)
    return anchor, kkt


def projections(
    b: torch.Tensor, sets: CoefficientSets, gram: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-geometry and reward-space minimum projections of candidate coefficients b.

    docs/algorithm.md#32-projections, both scale-free and <= 1:

    * ``M_full(b)   = (b^T M a_hat - Q ||L M b||) / (sqrt(b^T M b) sqrt(a_hat^T M a_hat))``
      = ``min_{c in C} <u(c), u(b)> / (||u(b)|| ||u(a_hat)||)``;
    * ``M_reward(b) = (b^T a_hat - Q ||L b||) / (||b|| ||a_hat||)`` = ``min_{c in C} <c, b> / (||b|| ||a_hat||)``.

    Args:
        b: ``[G, K]`` float64 candidate coefficients.
        sets: the groups' coefficient sets.
        gram: ``[G, K, K]`` float64 Gram matrices.

    Returns:
        ``(m_full, m_reward)``, two ``[G]`` float64 tensors; ``-inf`` where a norm in the
        denominator is zero (a null update has no direction).
    """
    a, root, q = sets.center, sets.root, sets.radius
    mb = torch.einsum("gij,gj->gi", gram, b)
    ma = torch.einsum("gij,gj->gi", gram, a)
    bmb, ama = (b * mb).sum(-1), (a * ma).sum(-1)
    lmb = torch.einsum("gij,gj->gi", root, mb).norm(dim=-1)
    lb = torch.einsum("gij,gj->gi", root, b).norm(dim=-1)
    full_den = (bmb.clamp_min(0) * ama.clamp_min(0)).sqrt()
    rew_den = b.norm(dim=-1) * a.norm(dim=-1)
    m_full = torch.where(full_den > 0, ((b * ma).sum(-1) - q * lmb) / full_den, -math.inf)
    m_reward = torch.where(rew_den > 0, ((b * a).sum(-1) - q * lb) / rew_den, -math.inf)
    return m_full, m_reward


@dataclass(frozen=True)
class _PathTerms:
    """Scalars ([G, 1], float64) that make M_full and M_reward along b(eta) closed forms in eta."""

    b0ma: torch.Tensor
    dma: torch.Tensor
    b0mb0: torch.Tensor
    b0md: torch.Tensor
    dmd: torch.Tensor
    p0: torch.Tensor
    p1: torch.Tensor
    p2: torch.Tensor
    ama: torch.Tensor
    b0a: torch.Tensor
    da: torch.Tensor
    b0b0: torch.Tensor
    b0d: torch.Tensor
    dd: torch.Tensor
    q0: torch.Tensor
    q1: torch.Tensor
    q2: torch.Tensor
    a_norm: torch.Tensor
    radius: float


def _path_terms(sets: CoefficientSets, gram: torch.Tensor, anchor: torch.Tensor) -> _PathTerms:
    a, root = sets.center, sets.root
    d = a - anchor

    def mv(mat, v):
        return torch.einsum("gij,gj->gi", mat, v)

    def dot(x, y):
        return (x * y).sum(-1, keepdim=True)

    ma, mb0, md = mv(gram, a), mv(gram, anchor), mv(gram, d)
    lmb0, lmd = mv(root, mb0), mv(root, md)
    lb0, ld = mv(root, anchor), mv(root, d)
    return _PathTerms(
        b0ma=dot(anchor, ma), dma=dot(d, ma), b0mb0=dot(anchor, mb0), b0md=dot(anchor, md), dmd=dot(d, md),
        p0=dot(lmb0, lmb0), p1=dot(lmb0, lmd), p2=dot(lmd, lmd), ama=dot(a, ma),
        b0a=dot(anchor, a), da=dot(d, a), b0b0=dot(anchor, anchor), b0d=dot(anchor, d), dd=dot(d, d),
        q0=dot(lb0, lb0), q1=dot(lb0, ld), q2=dot(ld, ld), a_norm=a.norm(dim=-1, keepdim=True),
        radius=sets.radius,
    )


def _path_projections(eta: torch.Tensor, t: _PathTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """M_full and M_reward of ``b(eta) = b0 + eta (a_hat - b0)``; eta ``[..., G, E]`` -> two ``[..., G, E]``."""
    q = t.radius
    bmb = (t.b0mb0 + 2 * eta * t.b0md + eta**2 * t.dmd).clamp_min(0)
    lmb = (t.p0 + 2 * eta * t.p1 + eta**2 * t.p2).clamp_min(0).sqrt()
    full_num = t.b0ma + eta * t.dma - q * lmb
    null = bmb <= NULL_TOL * t.ama
    m_full = torch.where(null, -math.inf, full_num / (bmb.sqrt() * t.ama.clamp_min(0).sqrt()))
    bb = (t.b0b0 + 2 * eta * t.b0d + eta**2 * t.dd).clamp_min(0)
    lb = (t.q0 + 2 * eta * t.q1 + eta**2 * t.q2).clamp_min(0).sqrt()
    rew_den = bb.sqrt() * t.a_norm
    m_reward = torch.where(rew_den > 0, (t.b0a + eta * t.da - q * lb) / rew_den, -math.inf)
    return m_full, m_reward


def _feasible(m_full: torch.Tensor, m_reward: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    return (m_full >= tau) & (m_full > 0) & (m_reward > 0)


def recovery_ratios(
    sets: CoefficientSets,
    gram: torch.Tensor,
    anchor: torch.Tensor,
    taus: torch.Tensor,
    *,
    grid_size: int = 100,
    tol: float = 1e-4,
    anchor_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest safe recovery ratio eta*(tau) of every group for every threshold tau.

    docs/algorithm.md#33-recovery-path: ``b(eta) = b0 + eta (a_hat - b0)`` is feasible iff
    ``M_full >= tau``, ``M_full > 0`` and ``M_reward > 0``. eta* is the largest feasible eta on
    the grid ``{0, 1/N, ..., 1}``, refined by bisection (to ``tol``) towards the next, infeasible,
    grid point. ``anchor_only`` is the ``safe_anchor_only`` ablation (grid ``{0}``, eta* = 0).

    Args:
        sets: G coefficient sets; gram: ``[G, K, K]`` float64; anchor: ``[G, K]`` float64 b0.
        taus: ``[m]`` float64 thresholds.
        grid_size: N, number of grid intervals (>= 1).
        tol: bisection tolerance on eta (> 0).

    Returns:
        ``(eta_star, feasible)``: ``[m, G]`` float64 recovery ratios (0 where infeasible) and
        ``[m, G]`` bool, whether any eta is feasible.

    Raises:
        ValueError: grid_size < 1 or tol <= 0.
    """
    if grid_size < 1 or tol <= 0:
        raise ValueError(f"recovery grid needs grid_size >= 1 and tol > 0, got {grid_size}, {tol}")
    terms = _path_terms(sets, gram, anchor)
    taus = taus.to(torch.float64)
    n = 0 if anchor_only else grid_size
    grid = torch.linspace(0.0, 1.0, n + 1, dtype=torch.float64) if n else torch.zeros(1, dtype=torch.float64)
    m_full, m_reward = _path_projections(grid.expand(anchor.shape[0], -1), terms)  # [G, E]
    feas = _feasible(m_full[None], m_reward[None], taus[:, None, None])  # [m, G, E]
    any_feas = feas.any(-1)
    idx = torch.arange(grid.numel()).expand_as(feas)
    last = torch.where(feas, idx, -1).amax(-1)  # [m, G]
    eta = grid[last.clamp_min(0)]
    if n:
        lo, hi = eta.clone(), grid[(last + 1).clamp(0, n)]
        refine = any_feas & (last < n)
        for _ in range(max(0, math.ceil(math.log2((1.0 / n) / tol)))):
            mid = 0.5 * (lo + hi)
            mf, mr = _path_projections(mid[..., None], terms)
            ok = _feasible(mf[..., 0], mr[..., 0], taus[:, None])
            lo = torch.where(ok & refine, mid, lo)
            hi = torch.where(ok | ~refine, hi, mid)
        eta = lo
    return torch.where(any_feas, eta, torch.zeros_like(eta)), any_feas


def path_point(anchor: torch.Tensor, center: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """``b(eta) = b0 + eta (a_hat - b0)``: ``[..., G, K]`` for eta ``[..., G]`` (eta = 1 gives a_hat exactly)."""
    e = eta[..., None]
    return torch.where(e == 1.0, center.expand_as(anchor + e), anchor + e * (center - anchor))


@dataclass(frozen=True)
class GroupGeometry:
    """GGSR's per-group quantities, shared by calibration and application (non-degenerate groups only).

    Attributes:
        sets: the groups' coefficient sets (docs/algorithm.md#2-jrsc).
        gram: ``[G, K, K]`` float64 geometry used for recovery (the identity under ``identity_geometry``).
        anchor: ``[G, K]`` float64 safe anchors b0 (docs/algorithm.md#31-safe-anchor).
        kkt: ``[G]`` float64 KKT residuals of the anchors.
        null: ``[G]`` bool, groups whose anchor is the null update.
    """

    sets: CoefficientSets
    gram: torch.Tensor  # geometry used for recovery (identity under identity_geometry)
    anchor: torch.Tensor
    kkt: torch.Tensor
    null: torch.Tensor


def group_geometry(point: torch.Tensor, gram: torch.Tensor, *, q: float, rho: float, norm_by_std: bool, eps: float,
                   ablation: str | None) -> GroupGeometry:
    """Coefficient sets of radius ``q`` around ``T(point)`` and their safe anchors under ``gram``
    (docs/algorithm.md#3-ggsr); ``ablation`` picks a spherical set (``spherical_set``) or the identity geometry
    (``identity_geometry``).

    Args:
        point: ``[G, K]`` float64 point scores of non-degenerate groups.
        gram: ``[G, K, K]`` float64 Gram matrices.
        q, rho, norm_by_std, eps: the radius and the set shape's settings (docs/algorithm.md#4-srgo).
        ablation: None or one of ``core.settings.ABLATIONS``.

    Returns:
        :class:`GroupGeometry`.
    """
    shape = "spherical" if ablation == "spherical_set" else "jacobian"
    center = grpo_coefficients(point, norm_by_std, eps)
    root, pinv = set_shape(point, rho=rho, norm_by_std=norm_by_std, eps=eps, shape=shape)
    sets = CoefficientSets(center=center, root=root, pinv=pinv, radius=q)
    if ablation == "identity_geometry":
        gram = torch.eye(point.shape[1], dtype=torch.float64).expand_as(gram)
    anchor, kkt = safe_anchor(sets, gram)
    ama = torch.einsum("gi,gij,gj->g", center, gram, center)
    b0mb0 = torch.einsum("gi,gij,gj->g", anchor, gram, anchor)
    null = (ama <= 0) | (b0mb0 <= NULL_TOL * ama)
    return GroupGeometry(sets=sets, gram=gram, anchor=anchor, kkt=kkt, null=null)
