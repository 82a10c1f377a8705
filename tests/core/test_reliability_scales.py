"""The reliability variant's noise level per rubric scale (docs/algorithm.md#94-rubrics-of-different-scales): a batch
that mixes plain rubric rows with rows carrying a large penalty criterion keeps the plain groups' weights at what
they are in a batch of plain rows alone, instead of lending them the penalty rows' noise."""

from __future__ import annotations

import math

import pytest
import torch

from setgrpo_verl.core.reliability import noise_scale, reliability_coefficients, reliability_weights


def _flips(points, truth_met, flip, gen):
    """A score of a row whose criteria's verdicts are each flipped with probability ``flip``."""
    met = truth_met ^ (torch.rand(truth_met.shape, generator=gen) < flip)
    pts = torch.tensor(points, dtype=torch.float64)
    return (met.double() * pts).sum(-1) / pts.clamp(min=0).sum()


def _batch(gen, penalty: int | None, groups=8, k=4, flip=0.06):
    """Half the groups plain (four 1-point criteria), half with one more criterion at ``penalty`` points."""
    point, reference, scale = [], [], []
    for g in range(groups):
        points = [1.0] * 4 + ([float(penalty)] if penalty is not None and g >= groups // 2 else [])
        truth = torch.rand(k, len(points), generator=gen) < 0.5
        point.append(_flips(points, truth, flip, gen))
        reference.append(_flips(points, truth, flip, gen))
        scale.append(noise_scale(points))
    return torch.stack(point), torch.stack(reference), torch.tensor(scale)


def test_the_noise_scale_of_a_rubric_row():
    assert noise_scale([1, 1, 1, 1]) == pytest.approx(0.5)
    assert noise_scale([1, 1, 1, 1, -10]) == pytest.approx(math.sqrt(104) / 4)
    with pytest.raises(ValueError, match="needs a positive point"):
        noise_scale([0, -1])


def test_plain_groups_keep_their_weight_beside_penalty_rows():
    plain_alone, plain_mixed, plain_pooled = [], [], []
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        p, r, s = _batch(gen, None)
        plain_alone.append(reliability_weights(p, r, scale=s)[0][:4].mean())
        p, r, s = _batch(gen, -10)
        plain_mixed.append(reliability_weights(p, r, scale=s)[0][:4].mean())
        plain_pooled.append(reliability_weights(p, r)[0][:4].mean())
    alone, mixed, pooled = (float(torch.stack(x).mean()) for x in (plain_alone, plain_mixed, plain_pooled))
    assert abs(mixed - alone) < 0.05, (alone, mixed)
    assert pooled < alone - 0.2, (alone, pooled)  # one pooled variance weights the plain groups down


def test_one_scale_for_every_group_is_the_pooled_estimate():
    gen = torch.Generator().manual_seed(1)
    p, r, _ = _batch(gen, None)
    w, v = reliability_weights(p, r)
    ws, vs = reliability_weights(p, r, scale=torch.full((8,), 0.5))
    assert torch.allclose(w, ws) and vs == pytest.approx(v)
    assert torch.allclose(reliability_coefficients(p, r), reliability_coefficients(p, r, scale=torch.full((8,), 3.0)))
    with pytest.raises(ValueError, match="one finite value > 0 per group"):
        reliability_weights(p, r, scale=torch.zeros(8))


def test_the_trainers_step_reads_each_responses_noise_scale():
    """reliability_step takes the reward manager's per-response ``noise_scale`` (one per row, read per group)."""
    from setgrpo_verl.integration.estimator import reliability_step

    gen = torch.Generator().manual_seed(2)
    p, r, s = _batch(gen, -10)
    g, k = p.shape
    rewards = torch.zeros(g * k, 3)
    rewards[:, -1] = p.reshape(-1).float()
    mask = torch.ones(g * k, 3)
    uid = [f"g{i}" for i in range(g) for _ in range(k)]
    scaled = reliability_step(rewards, mask, uid, r.reshape(-1), k, noise_scales=s.repeat_interleave(k).numpy())
    pooled = reliability_step(rewards, mask, uid, r.reshape(-1), k)
    assert torch.allclose(scaled.weights, reliability_weights(p, r, scale=s)[0], atol=1e-6)
    assert torch.allclose(pooled.weights, reliability_weights(p, r)[0], atol=1e-6)
