"""JRSC: set shape, nonconformity scores, conformal radius and coverage (docs/algorithm.md#2-jrsc)."""

import math

import pytest
import torch

from setgrpo_verl.core import grpo_coefficients, grpo_jacobian
from setgrpo_verl.core.jrsc import (
    CoefficientSets,
    conformal_radius,
    min_calibration_groups,
    nonconformity_scores,
    set_shape,
)
from setgrpo_verl.core.grpo import centering_projector

from .synthetic import make_groups


def test_shape_matches_definition():
    point, _, _ = make_groups(5, k=6, seed=3)
    rho = 0.1
    root, pinv = set_shape(point, rho=rho)
    jac = grpo_jacobian(point)
    jjt = jac @ jac.transpose(1, 2)
    lam = rho * jjt.diagonal(dim1=1, dim2=2).sum(-1) / 5
    sigma = jjt + lam[:, None, None] * centering_projector(6)
    assert torch.allclose(root @ root, sigma, atol=1e-9 * sigma.abs().max())
    assert torch.allclose(root, root.transpose(1, 2), atol=1e-12)
    # pseudo-inverse on the zero-sum subspace: Sigma Sigma^+ = P
    assert torch.allclose(sigma @ pinv, centering_projector(6).expand(5, 6, 6), atol=1e-8)
    assert (root @ torch.ones(5, 6, 1, dtype=torch.float64)).abs().max() < 1e-10


def test_rho_zero_refused_for_grpo_but_allowed_for_dr_grpo():
    point, _, _ = make_groups(3, seed=1)
    with pytest.raises(ValueError, match="rho must be"):
        set_shape(point, rho=0.0)
    root, _ = set_shape(point, rho=0.0, norm_by_std=False)
    assert torch.allclose(root, centering_projector(6).expand(3, 6, 6), atol=1e-12)


def test_support_function_matches_sampled_minimum():
    point, _, _ = make_groups(4, k=5, seed=7)
    root, pinv = set_shape(point, rho=0.2)
    sets = CoefficientSets(center=grpo_coefficients(point), root=root, pinv=pinv, radius=0.7)
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    z = torch.randn(4, 20000, 5, generator=gen, dtype=torch.float64)
    z = z - z.mean(-1, keepdim=True)  # L acts on the zero-sum subspace
    z = 0.7 * z / z.norm(dim=-1, keepdim=True)  # boundary points
    c = sets.center[:, None] + torch.einsum("gij,gnj->gni", root, z)
    sampled = torch.einsum("gni,gi->gn", c, v).amin(1)
    exact = sets.support(v)
    assert (sampled >= exact - 1e-10).all()
    assert torch.allclose(sampled, exact, atol=2e-3 * exact.abs().max())
    assert sets.contains(c[:, 0]).all()


def test_conformal_index_and_too_few_groups():
    scores = torch.arange(1, 20, dtype=torch.float64)  # n = 19
    assert conformal_radius(scores, 0.05) == 19.0  # ceil(20 * 0.95) = 19
    assert conformal_radius(scores, 0.1) == 18.0  # ceil(20 * 0.9) = 18
    assert min_calibration_groups(0.05) == 19 and min_calibration_groups(0.1) == 9
    with pytest.raises(ValueError, match="at least 19 coverage groups"):
        conformal_radius(scores[:18], 0.05)
    with pytest.raises(ValueError, match="alpha"):
        conformal_radius(scores, 1.0)


def test_scores_equal_mahalanobis_and_dr_grpo_reward_units():
    point, reference, _ = make_groups(8, seed=2)
    s = nonconformity_scores(point, reference, rho=0.1, norm_by_std=False)
    # Dr.GRPO: Sigma = (1 + rho) P, so S = ||P (r' - r)|| / sqrt(1 + rho)
    diff = reference - point
    expected = (diff - diff.mean(-1, keepdim=True)).norm(dim=-1) / math.sqrt(1.1)
    assert torch.allclose(s, expected, atol=1e-12)


@pytest.mark.parametrize("alpha", [0.1, 0.2])
def test_coverage_over_random_splits(alpha):
    """E[coverage] lies in [1 - alpha, 1 - alpha + 1/(n+1)]; checked over many random splits."""
    point, reference, _ = make_groups(6000, k=6, noise=0.15, seed=11, levels=20)
    keep = point.amax(-1) > point.amin(-1)
    scores = nonconformity_scores(point[keep], reference[keep], rho=0.1)
    n = 56  # expected coverage ceil((n+1)(1-alpha))/(n+1) is strictly above 1 - alpha for both alphas
    gen = torch.Generator().manual_seed(5)
    cover = []
    for _ in range(400):
        perm = torch.randperm(scores.numel(), generator=gen)
        q = conformal_radius(scores[perm[:n]], alpha)
        cover.append(float((scores[perm[n:n + 500]] <= q).double().mean()))
    mean = sum(cover) / len(cover)
    assert 1 - alpha <= mean <= 1 - alpha + 2 / (n + 1), mean
    # and the coverage statement is about T(r') in C: check it directly for one split
    q = conformal_radius(scores[:n], alpha)
    root, pinv = set_shape(point[keep][n:], rho=0.1)
    sets = CoefficientSets(center=grpo_coefficients(point[keep][n:]), root=root, pinv=pinv, radius=q)
    direct = sets.contains(grpo_coefficients(reference[keep][n:]))
    assert torch.equal(direct, scores[n:] <= q * (1 + 1e-12))
