"""The worker's sketch path without Ray: verl's micro-batching, order restoration and the engine's autocast."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import torch

from verl.utils import tensordict_utils as tu

from setgrpo_verl.integration.worker import _engine_autocast, _padded_layout, sketch_and_log_probs, sketch_batch
from setgrpo_verl.sketch import compute_sketches

from .test_ray_cpu import SKETCH, _batch, _tiny_model


def test_sketch_batch_matches_whole_batch_hook_and_bf16_autocast_keeps_the_geometry():
    model = _tiny_model()
    data = _batch()
    ids, am, rm = _padded_layout(data)
    exact = compute_sketches(model, ids, am, rm, SKETCH).sketches
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=20, use_remove_padding=True)
    torch.testing.assert_close(sketch_batch(model, data, SKETCH, loss_agg_mode="token-mean"), exact,
                               rtol=1e-4, atol=1e-5)

    for engine in (SimpleNamespace(_autocast_dtype=torch.float32), SimpleNamespace()):  # fp32 engine / no autocast
        assert isinstance(_engine_autocast(engine, model), nullcontext)
    with _engine_autocast(SimpleNamespace(_autocast_dtype=torch.bfloat16), model):
        assert torch.is_autocast_enabled("cpu")
        bf16 = sketch_batch(model, data, SKETCH, loss_agg_mode="token-mean")
    assert bf16.dtype == torch.float32
    gram, gram_bf16 = exact @ exact.T, bf16 @ bf16.T
    assert float((gram - gram_bf16).abs().max() / gram.abs().max()) < 0.03  # far below the sketch's own error


def test_fused_log_probs_equal_an_independent_forward():
    model = _tiny_model()
    data = _batch()
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=20, use_remove_padding=True, temperature=0.7)
    _, log_probs = sketch_and_log_probs(model, data, SKETCH, loss_agg_mode="token-mean")
    for i, (p, r) in enumerate(zip(data["prompts"].unbind(), data["responses"].unbind())):
        with torch.no_grad():  # one unpadded sequence at a time: no masking or packing involved
            logits = model(input_ids=torch.cat([p, r])[None]).logits[0, p.numel() - 1 : -1] / 0.7
        expected = torch.log_softmax(logits.float(), -1).gather(-1, r[:, None]).squeeze(-1)
        torch.testing.assert_close(log_probs.unbind()[i], expected, rtol=1e-4, atol=1e-5)
