"""GGSR: safe anchor, projections and recovery (docs/algorithm.md#3-ggsr)."""

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from setgrpo_verl.core import grpo_coefficients
from setgrpo_verl.core.ggsr import path_point, projections, recovery_ratios, safe_anchor
from setgrpo_verl.core.jrsc import CoefficientSets, set_shape

from .synthetic import make_groups


def _sets(point, radius, rho=0.1):
    root, pinv = set_shape(point, rho=rho)
    return CoefficientSets(center=grpo_coefficients(point), root=root, pinv=pinv, radius=radius)


def _boundary(sets, n, seed=0):
    """n points on each set's boundary: [G, n, K]."""
    g, k = sets.center.shape
    z = torch.randn(g, n, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    z = z - z.mean(-1, keepdim=True)
    z = sets.radius * z / z.norm(dim=-1, keepdim=True)
    return sets.center[:, None] + torch.einsum("gij,gnj->gni", sets.root, z)


@pytest.mark.parametrize("radius", [0.05, 0.4, 3.0])
def test_anchor_matches_scipy_and_kkt(radius):
    point, _, gram = make_groups(12, k=5, dim=7, seed=4)  # full-rank M: unique anchor
    sets = _sets(point, radius)
    anchor, kkt = safe_anchor(sets, gram)
    assert kkt.max() < 1e-8
    for g in range(point.shape[0]):
        a, root, m = sets.center[g].numpy(), sets.root[g].numpy(), gram[g].numpy()

        def obj(z):
            c = a + root @ z
            return c @ m @ c

        res = minimize(obj, np.zeros(5), method="SLSQP", jac=lambda z: 2 * root @ m @ (a + root @ z),
                       constraints=[{"type": "ineq", "fun": lambda z: radius**2 - z @ z, "jac": lambda z: -2 * z}],
                       options={"ftol": 1e-14, "maxiter": 500})
        ours = float(anchor[g] @ gram[g] @ anchor[g])
        assert ours <= res.fun + 1e-9 * max(1.0, abs(res.fun))
        assert ours == pytest.approx(res.fun, rel=1e-6, abs=1e-9)
        assert np.allclose(anchor[g].numpy(), a + root @ res.x, atol=1e-4)
    # anchor lies in its set
    assert sets.contains(anchor).all()


def test_anchor_never_reverses_any_plausible_update():
    """<u(b0), u(c)> >= ||u(b0)||^2 for c in C (sampled on the boundary and inside)."""
    point, _, gram = make_groups(10, k=6, dim=3, seed=8)  # rank-deficient M, like real sketches
    sets = _sets(point, 1.5)
    anchor, _ = safe_anchor(sets, gram)
    pts = torch.cat([_boundary(sets, 4000), sets.center[:, None] + 0.5 * (_boundary(sets, 1000, 1) - sets.center[:, None])], 1)
    ub0 = torch.einsum("gi,gij->gj", anchor, gram)
    inner = torch.einsum("gj,gnj->gn", ub0, pts)
    norm2 = (ub0 * anchor).sum(-1)
    assert (inner >= norm2[:, None] - 1e-9 * (1 + norm2[:, None])).all()


def test_projections_match_brute_force_on_the_boundary():
    point, _, gram = make_groups(6, k=5, dim=4, seed=9)
    sets = _sets(point, 0.8)
    b = sets.center + 0.3 * torch.randn(6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    m_full, m_reward = projections(b, sets, gram)
    pts = _boundary(sets, 50000)
    ub, ua = torch.einsum("gij,gj->gi", gram, b), torch.einsum("gij,gj->gi", gram, sets.center)
    full_bf = torch.einsum("gi,gni->gn", ub, pts).amin(1) / ((ub * b).sum(-1).sqrt() * (ua * sets.center).sum(-1).sqrt())
    rew_bf = torch.einsum("gi,gni->gn", b, pts).amin(1) / (b.norm(dim=-1) * sets.center.norm(dim=-1))
    # closed forms are exact minima: sampled minima are never below and come within sampling error
    assert (full_bf >= m_full - 1e-10).all() and (rew_bf >= m_reward - 1e-10).all()
    assert torch.allclose(full_bf, m_full, rtol=5e-3, atol=5e-3)
    assert torch.allclose(rew_bf, m_reward, rtol=5e-3, atol=5e-3)
    assert (m_full <= 1 + 1e-12).all() and (m_reward <= 1 + 1e-12).all()


def test_recovery_is_largest_feasible_ratio():
    point, _, gram = make_groups(300, k=6, dim=4, seed=12, noise=0.1)
    sets = _sets(point, 0.6)
    anchor, _ = safe_anchor(sets, gram)
    taus = torch.tensor([0.0, 0.2, 0.5])
    eta, feasible = recovery_ratios(sets, gram, anchor, taus)
    assert feasible.any() and (~feasible).any()  # the problem is non-trivial
    for j, tau in enumerate(taus.tolist()):
        for on_path, expect in ((eta[j], True), ((eta[j] + 1.5e-4).clamp_max(1.0), None)):
            b = path_point(anchor, sets.center, on_path)
            mf, mr = projections(b, sets, gram)
            ok = (mf >= tau) & (mf > 0) & (mr > 0)
            if expect:
                assert (ok | ~feasible[j]).all()  # eta* itself is feasible
        # beyond eta* (within the bisection tolerance of the next grid point) the path is infeasible
        step = (eta[j] + 1.5e-4)
        nxt = torch.ceil(eta[j] * 100 - 1e-9) / 100
        check = feasible[j] & (eta[j] < 1) & (step < nxt + 1e-12)
        mf, mr = projections(path_point(anchor, sets.center, step), sets, gram)
        assert not ((mf >= tau) & (mf > 0) & (mr > 0))[check].any()
        # no grid point above eta* is feasible
        grid = torch.linspace(0, 1, 101, dtype=torch.float64)
        for e in grid[grid > 0].tolist():
            mf, mr = projections(path_point(anchor, sets.center, torch.full_like(eta[j], e)), sets, gram)
            above = feasible[j] & (e > eta[j] + 1e-12)
            assert not ((mf >= tau) & (mf > 0) & (mr > 0))[above].any()
    # a stricter threshold never recovers more
    assert (eta[2] <= eta[0] + 1e-12).all() and (feasible[2] <= feasible[0]).all()


def test_anchor_projection_is_update_norm_ratio():
    """M_full(b0) = ||u(b0)|| / ||u(a_hat)|| because min_c <u(c), u(b0)> = ||u(b0)||^2."""
    point, _, gram = make_groups(20, k=4, dim=5, seed=2)
    sets = _sets(point, 0.5)
    anchor, _ = safe_anchor(sets, gram)
    mf, _ = projections(anchor, sets, gram)
    ratio = torch.einsum("gi,gij,gj->g", anchor, gram, anchor).sqrt() / torch.einsum(
        "gi,gij,gj->g", sets.center, gram, sets.center).sqrt()
    assert torch.allclose(mf, ratio, atol=1e-7)


def test_zero_radius_path_is_grpo():
    point, _, gram = make_groups(20, k=4, dim=5, seed=2)
    sets = _sets(point, 0.0)
    anchor, kkt = safe_anchor(sets, gram)
    assert torch.equal(anchor, sets.center) and kkt.max() == 0
    eta, feasible = recovery_ratios(sets, gram, anchor, torch.tensor([0.95]))
    assert feasible.all() and (eta == 1).all()
    assert torch.equal(path_point(anchor, sets.center, eta[0]), sets.center)
    assert math.isfinite(float(projections(anchor, sets, gram)[0].sum()))
