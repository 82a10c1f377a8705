"""Sketches under FSDP2 (verl's apply_fsdp2) on two gloo CPU ranks equal a single-process run
(docs/sketch.md#mechanics).

Each rank builds the same tiny random Llama, computes single-process reference sketches for its responses, wraps
the model with ``verl.utils.fsdp_utils.apply_fsdp2`` (decoder layers, untied embedding and LM head, root) and
recomputes the sketches (padded and packed layouts).  Afterwards a normal backward must still work and produce the
data-parallel mean gradient, i.e. the sketch pass left FSDP's gradient state untouched.
"""

from __future__ import annotations

import copy

import pytest
import torch

from setgrpo_verl.sketch import SketchConfig, compute_sketches
from tests.gloo_ranks import run_two_gloo_ranks, wrap_like_verl
from tests.sketch._tiny import tiny_llama, verl_batch


def _objective(model, ids, am, rm):
    pos = torch.clip(am.cumsum(-1) - 1, min=0)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
    t_resp = rm.shape[1]
    lp = torch.log_softmax(logits[:, -t_resp - 1 : -1].float(), -1).gather(-1, ids[:, -t_resp:, None]).squeeze(-1)
    return (lp * rm).sum()


def fsdp2_rank(rank: int, world: int) -> dict:
    """One rank of :func:`test_fsdp2_two_gloo_ranks_match_single_process`."""
    result = {}
    model = tiny_llama(dtype=torch.float32)
    reference = copy.deepcopy(model)
    ids, am, rm = verl_batch(bsz=2 * world)
    mine = slice(2 * rank, 2 * rank + 2)
    cfg = SketchConfig(rank_out=2, rank_in=2, copies=4, seed=7, include_embeddings=True)
    ref = compute_sketches(reference, ids[mine], am[mine], rm[mine], cfg)
    ref_full = compute_sketches(reference, ids, am, rm, cfg)

    model = wrap_like_verl(model, "fsdp2", world)
    sharded = [p for p in model.parameters() if type(p.data).__name__ == "DTensor"]
    result["num_dtensor_params"] = len(sharded)

    errors = {}
    for packed in (False, True):
        out = compute_sketches(model, ids[mine], am[mine], rm[mine], cfg, use_remove_padding=packed)
        scale = ref.sketches.abs().max().item()
        errors[f"packed={packed}"] = (out.sketches - ref.sketches).abs().max().item() / scale
        errors[f"packed={packed}/vs_full"] = (out.sketches - ref_full.sketches[mine]).abs().max().item() / scale
        errors[f"packed={packed}/log_probs"] = (out.log_probs - ref.log_probs).abs().max().item()
    result["errors"] = errors
    result["grad_none_after_sketch"] = all(p.grad is None for p in model.parameters())

    # FSDP state untouched: a normal backward gives the data-parallel mean of the per-rank gradients.
    _objective(model, ids[mine], am[mine], rm[mine]).backward()
    grads = []
    for b in range(world):
        reference.zero_grad(set_to_none=True)
        sl = slice(2 * b, 2 * b + 2)
        _objective(reference, ids[sl], am[sl], rm[sl]).backward()
        grads.append({n: p.grad.clone() for n, p in reference.named_parameters()})
    worst = 0.0
    for n, p in model.named_parameters():
        full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        expect = sum(g[n] for g in grads) / world
        worst = max(worst, (full - expect).abs().max().item() / (expect.abs().max().item() + 1e-12))
    result["dp_grad_rel_err"] = worst
    result["ok"] = (result["grad_none_after_sketch"] and len(sharded) > 0 and all(v < 1e-4 for v in errors.values())
                    and worst < 1e-4)
    return result


@pytest.mark.slow
def test_fsdp2_two_gloo_ranks_match_single_process(tmp_path):
    results, proc = run_two_gloo_ranks(f"{__name__}:fsdp2_rank", tmp_path)
    for res in results:
        assert "traceback" not in res, res["traceback"]
        assert res["num_dtensor_params"] > 0  # the model really was sharded
        assert res["grad_none_after_sketch"]
        for key, err in res["errors"].items():
            assert err < 1e-4, (res["rank"], key, err)
        assert res["dp_grad_rel_err"] < 1e-4
        assert res["ok"]
    assert proc.returncode == 0, proc.stderr[-5000:]
