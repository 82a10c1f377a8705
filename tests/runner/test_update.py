"""The runner's PPO update: verl's policy loss + agg_loss on a DataProto, checked against exact per-response
gradients (docs/algorithm.md#0-notation: at ratio 1 the update is sum_i c_i g_i up to one global constant)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl import DataProto

from setgrpo_verl.runner import RunConfig, _forward_log_probs, policy_update
from setgrpo_verl.sketch import SketchConfig, compute_sketches
from tests.sketch._tiny import tiny_llama, verl_batch


def _batch(model, coefficients: torch.Tensor, t_resp: int = 5) -> DataProto:
    input_ids, attention_mask, response_mask = verl_batch(bsz=len(coefficients), t_resp=t_resp)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    data = DataProto.from_dict(
        tensors=dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     responses=input_ids[:, -t_resp:], response_mask=response_mask),
        non_tensors=dict(uid=np.array(["0"] * len(coefficients), dtype=object)))
    with torch.no_grad():
        old, _ = _forward_log_probs(model, data, with_entropy=False)
    data.batch["old_log_probs"] = old
    data.batch["advantages"] = coefficients[:, None].to(old.dtype) * response_mask
    return data


def _cfg(**kw) -> RunConfig:
    base = dict(rollout_n=2, micro_batch_size=3, grad_clip=1e12, weight_decay=0.0, entropy_coeff=0.0)
    return RunConfig.from_profile("smoke", **{**base, **kw})


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_update_equals_coefficient_weighted_gradients(loss_agg_mode):
    """SGD(lr=1) step of verl's vanilla PPO loss at ratio 1 == (1/const) * sum_i c_i g_i, block by block, with the
    exact g_i from the sketch module's identity projections; micro-batching (3 + 1 rows) must not change it."""
    model = tiny_llama(dtype=torch.float64)
    c = torch.tensor([1.5, -0.5, 0.25, -1.25], dtype=torch.float64)
    data = _batch(model, c)
    exact = compute_sketches(model, data.batch["input_ids"], data.batch["attention_mask"],
                             data.batch["response_mask"], SketchConfig(identity=True),
                             position_ids=data.batch["position_ids"], loss_agg_mode=loss_agg_mode)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = policy_update(model, opt, data, _cfg(loss_agg_mode=loss_agg_mode))
    assert metrics["actor/update_skipped"] == 0.0
    assert metrics["actor/pg_clipfrac"] == 0.0 and abs(metrics["actor/ppo_kl"]) < 1e-12
    const = float(data.batch["response_mask"].sum()) if loss_agg_mode == "token-mean" else len(c)
    expected = (c[:, None] * exact.sketches.double()).sum(0) / const  # = -grad = parameter change
    offset = 0
    params = dict(model.named_parameters())
    checked = 0
    for name in exact.block_names:
        w = params[f"{name}.weight"]
        delta = (w.detach() - before[f"{name}.weight"]).flatten()
        torch.testing.assert_close(delta, expected[offset:offset + w.numel()], rtol=1e-4, atol=1e-8)  # sketches are float32
        offset += w.numel()
        checked += 1
    assert offset == expected.numel() and checked >= 14  # every Linear incl. the LM head


def test_all_zero_coefficients_take_no_optimizer_step():
    """Every group rejected -> no forward, no optimizer step: parameters and AdamW state bit-identical."""
    model = tiny_llama(dtype=torch.float32)
    data = _batch(model, torch.zeros(4))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    metrics = policy_update(model, opt, data, _cfg())
    assert metrics["actor/update_skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    # one nonzero coefficient does move the weights (the test above is not vacuous)
    data.batch["advantages"][0] = data.batch["response_mask"][0].float()
    assert policy_update(model, opt, data, _cfg())["actor/update_skipped"] == 0.0
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_clipping_matches_verl_ratio_bounds():
    """After one large step, a second update on the same batch sees ratios != 1 and verl's clip fraction > 0."""
    torch.manual_seed(0)
    model = tiny_llama(dtype=torch.float32)
    data = _batch(model, torch.tensor([2.0, -2.0, 1.0, -1.0]))
    opt = torch.optim.SGD(model.parameters(), lr=50.0)
    policy_update(model, opt, data, _cfg(clip_ratio=0.01))
    m = policy_update(model, opt, data, _cfg(clip_ratio=0.01))
    assert m["actor/pg_clipfrac"] > 0.0 and m["actor/ppo_kl"] != 0.0
