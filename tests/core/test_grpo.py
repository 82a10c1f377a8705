"""GRPO map and Jacobian against verl and autograd (docs/algorithm.md#1-grpo-map)."""

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from setgrpo_verl.core import grpo_coefficients, grpo_jacobian
from setgrpo_verl.core.grpo import degenerate_groups


def _verl_grpo(scores: torch.Tensor, norm_by_std: bool) -> torch.Tensor:
    g, k = scores.shape
    length = 3
    rewards = torch.zeros(g * k, length, dtype=scores.dtype)
    rewards[:, -1] = scores.reshape(-1)
    mask = torch.ones(g * k, length, dtype=scores.dtype)
    index = np.repeat(np.arange(g), k)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm_by_std)
    return adv[:, 0].reshape(g, k)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_matches_verl_bit_for_bit_in_float32(norm_by_std):
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(40, 8, generator=gen)
    scores[3] = 0.5  # degenerate group
    scores[4, :4] = 1.0  # ties
    scores[5] = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])  # degenerate with inexact mean
    scores[6] = torch.round(scores[6] * 4) / 4  # rubric-like levels
    ours = grpo_coefficients(scores, norm_by_std=norm_by_std)
    theirs = _verl_grpo(scores.clone(), norm_by_std)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, theirs)
    assert degenerate_groups(scores).nonzero().flatten().tolist() == [3, 5]
    assert ours[3].abs().max() == 0
    # verl's float32 GRPO turns the rounding of a constant group's mean into a non-zero advantage
    # (|a| ~ 7e-3 here, divided by eps); SetGRPO marks such groups degenerate and writes zeros.
    assert ours[5].abs().max() > (1e-3 if norm_by_std else 0.0)


def test_float64_close_to_verl_and_k2():
    scores = torch.tensor([[0.0, 1.0], [2.0, -1.0]], dtype=torch.float64)
    a = grpo_coefficients(scores)
    # K=2: std = |r1 - r2| / sqrt(2), so coefficients are -+1/sqrt(2) up to eps
    expected = torch.tensor([[-1.0, 1.0], [1.0, -1.0]], dtype=torch.float64) / 2**0.5
    assert torch.allclose(a, expected, atol=1e-5)
    assert torch.allclose(a, _verl_grpo(scores.clone(), True), atol=1e-12)


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("k", [2, 5, 8])
def test_jacobian_matches_autograd(norm_by_std, k):
    gen = torch.Generator().manual_seed(k)
    scores = torch.rand(6, k, generator=gen, dtype=torch.float64)
    jac = grpo_jacobian(scores, norm_by_std=norm_by_std)
    for g in range(scores.shape[0]):
        auto = torch.autograd.functional.jacobian(
            lambda r: grpo_coefficients(r[None], norm_by_std=norm_by_std)[0], scores[g]
        )
        assert torch.allclose(jac[g], auto, atol=1e-10, rtol=1e-9)
    assert torch.allclose(jac, jac.transpose(1, 2), atol=1e-12)
    ones = torch.ones(6, k, dtype=torch.float64)
    assert torch.einsum("gij,gj->gi", jac, ones).abs().max() < 1e-10  # 1 is in the null space
    if norm_by_std:  # a is in the null space up to eps effects
        a = grpo_coefficients(scores)
        assert torch.einsum("gij,gj->gi", jac, a).abs().max() < 1e-4


def test_degenerate_jacobian_is_zero():
    scores = torch.tensor([[0.3, 0.3, 0.3], [0.1, 0.2, 0.3]], dtype=torch.float64)
    jac = grpo_jacobian(scores)
    assert jac[0].abs().max() == 0 and jac[1].abs().max() > 1
