"""The sketch covers exactly the parameters the update trains, on every recipe family (docs/sketch.md#what-is-sketched).

Identity sketches are the exact per-response gradients, so on tiny random models of each family they must equal
autograd's gradients of the trainable text-model parameters, one response at a time: Qwen3 dense, Qwen3.5
(``Qwen3_5ForConditionalGeneration`` under verl 0.9.1's own monkey patch, which runs the vision tower on a dummy
image in every forward), Llama-3.2 with tied embeddings, and LoRA adapters (peft, wrapped as verl wraps them). A
model with trainable parameters the sketch cannot cover (3-D MoE experts) is refused, naming them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from setgrpo_verl.integration.support import verl_monkey_patched
from setgrpo_verl.sketch import GradientSketcher, SketchConfig, compute_sketches, sketch_coverage
from tests.sketch._tiny import (
    exact_gradients,
    tiny_llama,
    tiny_qwen3,
    tiny_qwen3_moe,
    tiny_qwen35_vl,
    with_per_sequence_delta_rule,
    verl_batch,
    with_lora,
)

FULL = SketchConfig(identity=True, include_embeddings=True, include_norms=True)

#: Gated DeltaNet's per-channel parameters, outside nn.Linear / norm modules (left out like norm weights).
DELTANET_PER_CHANNEL = ("linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias")


def _trainable(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _assert_identity_is_exact(model, config, atol_rel=1e-5, packed=False):  # sketches accumulate in float32
    ids, am, rm = verl_batch(vocab=96)
    out = compute_sketches(model, ids, am, rm, config, use_remove_padding=packed)
    exact = exact_gradients(model, ids, am, rm, out.block_names)
    assert out.sketches.shape == exact.shape
    assert exact.abs().max() > 0
    torch.testing.assert_close(out.sketches.double(), exact, rtol=0, atol=atol_rel * exact.abs().max().item())
    assert all(p.grad is None for p in model.parameters())
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_qwen3_dense_every_trainable_parameter(packed):
    """Every trainable parameter, the per-head q/k norms (RMSNorm over head_dim, [tokens * heads] rows) included."""
    model = tiny_qwen3()
    cov = sketch_coverage(model, FULL)
    assert set(cov.sketched) == _trainable(model) and not (cov.left_out or cov.outside_text or cov.refused)
    assert any(n.endswith("self_attn.q_norm.weight") for n in cov.sketched)
    _assert_identity_is_exact(model, FULL, packed=packed)


def test_llama32_tied_embeddings_one_parameter_both_uses():
    model = tiny_llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    cov = sketch_coverage(model, FULL)
    assert set(cov.sketched) == _trainable(model) and not (cov.left_out or cov.refused)
    out = _assert_identity_is_exact(model, FULL)
    assert "model.embed_tokens" not in out.block_names  # the tied parameter is one block (named by the LM head)
    # default: nn.Linear blocks; the tied parameter is one of them, both uses sketched; the norms are left out
    cov = sketch_coverage(model)
    assert "model.embed_tokens.weight" in cov.sketched  # the tied parameter, through the LM head block
    assert set(cov.left_out) == {n for n, p in model.named_parameters() if p.dim() == 1}  # the norm weights


def test_tied_embedding_without_include_embeddings_sketches_the_tied_parameters_whole_gradient():
    """include_embeddings=False on a tied model: the LM head block's identity sketch is the per-response gradient
    of the tied weight (both uses), checked against torch.func per-response gradients."""
    model = tiny_llama(tie=True)
    ids, am, rm = verl_batch()
    out = compute_sketches(model, ids, am, rm, SketchConfig(identity=True), loss_agg_mode="token-mean")
    head = out.block_names.index("lm_head")
    weight = model.lm_head.weight
    offset = sum(model.get_submodule(n).weight.numel() for n in out.block_names[:head])
    sketched = out.sketches[:, offset : offset + weight.numel()].double()
    t_resp = rm.shape[1]

    def objective(w, ids_i, am_i, rm_i):
        logits = torch.func.functional_call(  # replaces the tied parameter in both of its uses
            model, {"model.embed_tokens.weight": w}, args=(),
            kwargs=dict(input_ids=ids_i[None], attention_mask=am_i[None],
                        position_ids=torch.clip(am_i.cumsum(-1) - 1, min=0)[None], use_cache=False),
            tie_weights=True, strict=False,
        ).logits[0, -t_resp - 1 : -1]
        lp = torch.log_softmax(logits.double(), -1).gather(-1, ids_i[-t_resp:, None]).squeeze(-1)
        return (lp * rm_i).sum()

    for i in range(ids.shape[0]):
        exact = torch.func.grad(objective)(weight.detach(), ids[i], am[i], rm[i].double()).flatten()
        torch.testing.assert_close(sketched[i], exact, rtol=1e-4, atol=1e-6 * float(exact.abs().max()))


def test_qwen35_vision_language_under_verls_monkey_patch():
    model = tiny_qwen35_vl()
    vision = {n for n in _trainable(model) if n.startswith("model.visual.")}
    assert vision
    with verl_monkey_patched(model, use_remove_padding=False):
        assert "forward_with_normal_backend" in type(model).forward.__qualname__
        cov = sketch_coverage(model, FULL)
        assert set(cov.outside_text) == vision
        assert not cov.refused
        assert set(cov.left_out) == {
            n for n in _trainable(model) if n.startswith("model.language_model.layers.") and
            n.endswith(DELTANET_PER_CHANNEL)
        }
        assert set(cov.sketched) == _trainable(model) - vision - set(cov.left_out)
        assert cov.left_out_numel / (cov.left_out_numel + cov.sketched_numel) < 0.05
        out = _assert_identity_is_exact(model, FULL)
        assert not any("visual" in n for n in out.block_names)
        assert any(n.endswith("linear_attn.norm") for n in out.block_names)  # per-head gated norm, 2 inputs


def test_qwen35_patched_sketches_equal_unpatched_text_model():
    """verl's patched forward (vision tower on a dummy image, added with weight 0) and the plain forward give the
    same sketches of the text model: the vision tower is neither hooked nor sketched."""
    model = tiny_qwen35_vl(dtype=torch.float32)
    ids, am, rm = verl_batch(vocab=96)
    plain = compute_sketches(model, ids, am, rm, SketchConfig())
    with verl_monkey_patched(model, use_remove_padding=False):
        patched = compute_sketches(model, ids, am, rm, SketchConfig())
    assert patched.block_names == plain.block_names
    assert not any("visual" in n for n in patched.block_names)
    torch.testing.assert_close(patched.sketches, plain.sketches, rtol=1e-4, atol=1e-5 * plain.sketches.abs().max())
    torch.testing.assert_close(patched.log_probs, plain.log_probs, rtol=0, atol=1e-5)


def test_qwen35_packed_is_refused_where_the_delta_rule_ignores_cu_seqlens_and_exact_where_it_splits():
    """Qwen3_5ForConditionalGeneration under verl's patch, packed: with transformers' torch delta rule (no
    flash-linear-attention) the packed responses share one recurrent state (refused); with a rule that runs each
    sequence alone, packed sketches and log-probs equal each sequence sketched alone."""
    model = tiny_qwen35_vl(dtype=torch.float32)
    ids, am, rm = verl_batch(vocab=96)
    rm = am[:, -rm.shape[1]:].clone()
    cfg = SketchConfig(rank_out=2, rank_in=2, copies=4)
    with verl_monkey_patched(model, use_remove_padding=True):
        with pytest.raises(ValueError, match=r"torch_chunk_gated_delta_rule.*flash-linear-attention"):
            compute_sketches(model, ids, am, rm, cfg, use_remove_padding=True)
        with_per_sequence_delta_rule(model)
        packed = compute_sketches(model, ids, am, rm, cfg, use_remove_padding=True)
        for i in range(ids.shape[0]):
            keep = am[i].bool()
            n_resp = int(am[i, -rm.shape[1]:].sum())
            alone = compute_sketches(model, ids[i][keep][None], torch.ones(1, int(keep.sum()), dtype=torch.long),
                                     torch.ones(1, n_resp, dtype=torch.long), cfg)
            rel = float((packed.sketches[i] - alone.sketches[0]).norm() / alone.sketches[0].norm())
            assert rel <= 1e-4, (i, rel)
            torch.testing.assert_close(packed.log_probs[i, :n_resp], alone.log_probs[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "qwen35_vl"])
def test_lora_sketches_the_adapters_only(family):
    base = tiny_qwen3() if family == "qwen3" else tiny_qwen35_vl()
    with verl_monkey_patched(base, use_remove_padding=False):
        model = with_lora(base)  # verl applies the patch first, then peft
        adapters = {n for n in _trainable(model) if ".lora_A." in n or ".lora_B." in n}
        assert adapters == _trainable(model)
        cov = sketch_coverage(model, FULL)
        text = {n for n in adapters if ".visual." not in n}
        assert set(cov.sketched) == text and set(cov.outside_text) == adapters - text
        assert not cov.left_out and not cov.refused
        for config in (FULL, SketchConfig(identity=True)):
            out = _assert_identity_is_exact(model, config)
            assert out.block_names and all(n.split(".")[-2] in ("lora_A", "lora_B") for n in out.block_names)


def test_trainable_bias_without_its_weight():
    model = tiny_llama(bias=True)
    for name, p in model.named_parameters():
        if name.endswith("q_proj.weight"):
            p.requires_grad_(False)
    _assert_identity_is_exact(model, SketchConfig(identity=True))


def test_moe_experts_are_refused_naming_them():
    model = tiny_qwen3_moe()
    cov = sketch_coverage(model)
    assert set(cov.refused) == {n for n in _trainable(model) if ".mlp.experts." in n or n.endswith(".mlp.gate.weight")}
    ids, am, rm = verl_batch(vocab=96)
    with pytest.raises(ValueError, match=r"cannot cover 6 trainable parameter\(s\).*model\.layers\.0\.mlp\.gate"):
        compute_sketches(model, ids, am, rm)
    with pytest.raises(ValueError, match="3-D MoE expert"):
        with GradientSketcher(model):
            pass
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0


def test_moe_with_lora_on_attention_only_is_sketched():
    """Frozen experts are not trained, so LoRA on the attention projections of an MoE model is fully sketched."""
    model = with_lora(tiny_qwen3_moe(), target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    cov = sketch_coverage(model)
    assert not cov.refused and set(cov.sketched) == _trainable(model)
    _assert_identity_is_exact(model, SketchConfig(identity=True))


_FSDP1_SCRIPT = r'''
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from verl.utils.fsdp_utils import get_fsdp_wrap_policy
from setgrpo_verl.sketch import SketchConfig, compute_sketches, sketch_coverage
from tests.sketch._tiny import tiny_llama, verl_batch
ids, am, rm = verl_batch()
cfg = SketchConfig(include_embeddings=True)
plain = tiny_llama(tie=True).float()
ref, ref_cov = compute_sketches(plain, ids, am, rm, cfg), sketch_coverage(plain, cfg)
for orig in (False, True):
    model = tiny_llama(tie=True).float()
    wrapped = FSDP(model, auto_wrap_policy=get_fsdp_wrap_policy(model, config={"min_num_params": 0}),
                   device_id=torch.device("cpu"), use_orig_params=orig)
    cov = sketch_coverage(wrapped, cfg)
    for group in ("sketched", "left_out", "outside_text", "refused"):
        assert sorted(getattr(cov, group)) == sorted(getattr(ref_cov, group)), (orig, group, getattr(cov, group))
    assert (cov.sketched_numel, cov.left_out_numel) == (ref_cov.sketched_numel, ref_cov.left_out_numel)
    out = compute_sketches(wrapped, ids, am, rm, cfg)
    assert out.block_names == ref.block_names
    torch.testing.assert_close(out.sketches, ref.sketches, rtol=0, atol=1e-6 * ref.sketches.abs().max().item())
    # one rank is FSDP1's NO_SHARD: the sketch backward leaves no plain-tensor parameter views behind, so the next
    # training step (the tied embedding is a shared parameter) runs, and its gradient is the unwrapped model's
    inner = wrapped._fsdp_wrapped_module
    if orig:
        assert all(type(m.weight) is torch.nn.Parameter for m in (inner.lm_head, inner.model.embed_tokens))
    wrapped.train()
    wrapped(input_ids=ids, attention_mask=am).logits.float().sum().backward()
    plain.zero_grad()
    plain.train()
    plain(input_ids=ids, attention_mask=am).logits.float().sum().backward()
    if orig:
        torch.testing.assert_close(inner.lm_head.weight.grad, plain.lm_head.weight.grad, rtol=1e-5, atol=1e-6)
    else:
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in wrapped.parameters())
print("ok")
'''


@pytest.mark.slow
def test_fsdp1_flat_parameters_have_the_models_coverage():
    """FSDP1 without use_orig_params flattens the parameters; coverage and sketches are still the model's own, and
    with either setting a training step runs after the sketch pass."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", _FSDP1_SCRIPT, port], cwd=root, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_lora_on_parameters_is_refused():
    """peft's LoRA on parameters (``target_parameters``, e.g. the 3-D experts) reads its adapters' weights without
    calling them, so no hook would see their gradients: refused, naming them."""
    from peft import LoraConfig, TaskType, get_peft_model

    model = get_peft_model(tiny_qwen3_moe(), LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"]))
    cov = sketch_coverage(model)
    assert cov.refused and all("mlp.experts" in n and (".lora_A." in n or ".lora_B." in n) for n in cov.refused)
    assert cov.sketched and all("q_proj" in n for n in cov.sketched)
    with pytest.raises(ValueError, match=r"mlp\.experts\.lora_A"):
        with GradientSketcher(model):
            pass


@pytest.mark.parametrize("tie", [False, True])
def test_an_embedding_whose_gradient_is_not_per_token_is_refused_naming_the_fix(tie):
    """``scale_grad_by_freq`` / ``max_norm`` make the embedding's gradient depend on the whole batch, so no per-token
    sketch is exact: refused with include_embeddings, and for a tied embedding also without it (the LM head's use)."""
    model = tiny_llama(tie=tie)
    model.get_input_embeddings().scale_grad_by_freq = True
    untie = " and untie it from the LM head (tie_word_embeddings=false)"
    with pytest.raises(ValueError, match="scale_grad_by_freq/max_norm") as info:
        sketch_coverage(model, SketchConfig(include_embeddings=True))
    assert str(info.value).endswith(untie) == tie
    if tie:
        with pytest.raises(ValueError, match="untie it from the LM head"):
            sketch_coverage(model, SketchConfig(include_embeddings=False))
    else:
        sketch_coverage(model, SketchConfig(include_embeddings=False))  # the embedding is not sketched: no refusal
