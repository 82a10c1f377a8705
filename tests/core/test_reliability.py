"""Reliability-weighted GRPO on the mean of two scorings (docs/algorithm.md#9-reliability-weighting): the noiseless
case against verl's GRPO, and its stated properties against simulation."""

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from setgrpo_verl.core import grpo_coefficients, reliability_coefficients, reliability_weights
from setgrpo_verl.core.reliability import weights_from_noise


def _simulate(batches: int, sigma: float, seed: int = 0, groups: int = 64, k: int = 4):
    """Batches of truth scores (the first half of the groups without spread: all signal is noise there) and two
    scorings with independent N(0, sigma^2) noise."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(batches):
        truth = torch.rand(groups, k, generator=gen, dtype=torch.float64)
        truth[: groups // 2] = truth[: groups // 2, :1]
        point = truth + sigma * torch.randn(groups, k, generator=gen, dtype=torch.float64)
        reference = truth + sigma * torch.randn(groups, k, generator=gen, dtype=torch.float64)
        yield truth, point, reference


def test_noiseless_grader_is_verls_grpo():
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(20, 4, generator=gen, dtype=torch.float64)
    scores[3] = 0.25  # degenerate: weight 0 and verl's zero advantage
    weights, noise = reliability_weights(scores, scores.clone())
    assert noise == 0.0
    assert weights[3] == 0 and torch.all(weights[torch.arange(20) != 3] == 1)
    rewards = torch.zeros(80, 2, dtype=torch.float64)
    rewards[:, -1] = scores.reshape(-1)
    verl_adv, _ = compute_grpo_outcome_advantage(rewards, torch.ones_like(rewards), np.repeat(np.arange(20), 4))
    ours = reliability_coefficients(scores, scores.clone())
    torch.testing.assert_close(ours, verl_adv[:, 0].reshape(20, 4), rtol=1e-12, atol=1e-12)


def test_pooled_noise_variance_is_unbiased():
    sigma = 0.15
    noise = np.array([reliability_weights(p, r)[1] for _, p, r in _simulate(400, sigma)])
    # the noise variance of the mean of two scorings is sigma^2 / 2
    assert abs(noise.mean() - sigma**2 / 2) < 3 * noise.std(ddof=1) / np.sqrt(noise.size)


def test_weights_follow_the_share_of_signal():
    zero, signal = [], []
    for _, p, r in _simulate(200, 0.15, seed=2):
        w, _ = reliability_weights(p, r)
        zero.append(float(w[:32].mean()))
        signal.append(float(w[32:].mean()))
    # truth spread 1/12 against noise 0.011: the signal groups keep most of their update, the noise-only ones little
    assert np.mean(signal) > 0.8
    assert np.mean(zero) < 0.3


def test_closer_to_the_truth_update_than_grpo_on_the_mean():
    err_weighted, err_mean = [], []
    for truth, p, r in _simulate(200, 0.15, seed=3):
        target = grpo_coefficients(truth)  # 0 for the groups without true spread
        err_weighted.append(float((reliability_coefficients(p, r) - target).square().mean()))
        err_mean.append(float((grpo_coefficients((p + r) / 2) - target).square().mean()))
    # measured: 0.11 against 0.43 (the mean's GRPO gives noise-only groups unit-scale coefficients)
    assert np.mean(err_weighted) < 0.5 * np.mean(err_mean)


def test_weight_is_the_linear_shrinkage_of_the_truths_grpo_coefficients():
    """docs/algorithm.md#92-what-it-guarantees, "why the square root": with Gaussian truths of spread tau2 and noise of
    variance sigma2 on the mean, the regression of the truth's deviations on the observed ones has slope
    tau2 / (tau2 + sigma2), so the truth's deviations over sqrt(tau2) are best predicted by
    sqrt(tau2 / (tau2 + sigma2)) times the observed deviations over their spread: the weight at population values."""
    gen = torch.Generator().manual_seed(5)
    tau2, sigma2, groups, k = 0.04, 0.02, 200_000, 4
    truth = 0.5 + tau2 ** 0.5 * torch.randn(groups, k, generator=gen, dtype=torch.float64)
    mean = truth + sigma2 ** 0.5 * torch.randn(groups, k, generator=gen, dtype=torch.float64)
    dt, dm = truth - truth.mean(1, keepdim=True), mean - mean.mean(1, keepdim=True)
    slope = float((dt * dm).sum() / (dm * dm).sum())
    assert slope == pytest.approx(tau2 / (tau2 + sigma2), abs=0.005)
    # as a scale of the observed deviations over the population spread sqrt(tau2 + sigma2)
    target, observed = dt / tau2 ** 0.5, dm / (tau2 + sigma2) ** 0.5
    scale = float((target * observed).sum() / (observed * observed).sum())
    assert scale == pytest.approx((tau2 / (tau2 + sigma2)) ** 0.5, abs=0.005)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="one \\[G, K\\] shape"):
        reliability_weights(torch.zeros(3, 4), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="reference"):
        reliability_weights(torch.zeros(3, 4), torch.full((3, 4), float("nan")))


def test_weights_from_a_given_noise_variance_closed_form():
    """[0, 1, 0, 1] has unbiased variance 1/3: a noise variance of 1/4 leaves a signal share of 1/4, weight 1/2."""
    point = torch.tensor([[0.0, 1.0, 0.0, 1.0]] * 3 + [[0.5] * 4], dtype=torch.float64)
    per_group = torch.tensor([0.25, 0.0, 1.0, 0.0], dtype=torch.float64)
    assert weights_from_noise(point, per_group).tolist() == pytest.approx([0.5, 1.0, 0.0, 0.0], abs=1e-15)
    assert weights_from_noise(point, 0.25).tolist() == pytest.approx([0.5, 0.5, 0.5, 0.0], abs=1e-15)
    # the pooled estimate of two scorings is the noise variance of their mean, which reliability_weights passes on
    gen = torch.Generator().manual_seed(3)
    p, r = torch.rand(8, 4, generator=gen, dtype=torch.float64), torch.rand(8, 4, generator=gen, dtype=torch.float64)
    w, noise = reliability_weights(p, r)
    assert noise == pytest.approx(float(((p - r) ** 2).mean() / 4), rel=1e-15)
    assert torch.equal(w, weights_from_noise((p + r) / 2, noise))


def test_weights_from_noise_refuses_a_variance_it_cannot_read():
    point = torch.rand(3, 4, dtype=torch.float64)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite and >= 0"):
            weights_from_noise(point, bad)
    with pytest.raises(ValueError, match="one per group"):
        weights_from_noise(point, torch.zeros(4))
