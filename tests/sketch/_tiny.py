"""Shared helpers of the sketch tests: a tiny random Llama, a verl-layout batch, exact per-response gradients."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(*, seed=0, tie=False, bias=False, hidden=32, layers=2, vocab=96, dtype=torch.float64):
    """Randomly initialised LlamaForCausalLM small enough for exact per-response autograd references."""
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        attention_bias=bias,
        mlp_bias=bias,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # non-trivial norm weights so norm gradients are not a rescaled copy of each other
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def verl_batch(*, seed=1, bsz=4, t_prompt=6, t_resp=5, vocab=96):
    """A verl-layout batch: prompt left-padded, response right-padded, ragged lengths, a masked response token."""
    g = torch.Generator().manual_seed(seed)
    seqlen = t_prompt + t_resp
    input_ids = torch.randint(1, vocab, (bsz, seqlen), generator=g)
    attention_mask = torch.ones(bsz, seqlen, dtype=torch.long)
    for b in range(bsz):
        left = b % 3  # prompt left padding
        right = (b * 2) % t_resp if b else 0  # response right padding
        attention_mask[b, :left] = 0
        if right:
            attention_mask[b, seqlen - right :] = 0
    input_ids = input_ids * attention_mask  # pad id 0
    response_mask = attention_mask[:, -t_resp:].clone()
    if bsz > 1:
        response_mask[1, 0] = 0  # a response token excluded from the loss (still attended to)
    return input_ids, attention_mask, response_mask


def block_gradient(model, name):
    """Flattened gradient of one sketch block, in the layout of SketchConfig(identity=True)."""
    module = model.get_submodule(name)
    if isinstance(module, torch.nn.Linear):  # the trainable weight's columns, then the trainable bias's column
        cols = [module.weight.grad] if module.weight.requires_grad else []
        if module.bias is not None and module.bias.requires_grad:
            cols.append(module.bias.grad[:, None])
        return torch.cat(cols, 1).flatten()
    if isinstance(module, torch.nn.Embedding):
        return module.weight.grad.flatten()
    return torch.cat([p.grad.flatten() for p in module.parameters(recurse=False) if p.dim() == 1])


def exact_gradients(model, input_ids, attention_mask, response_mask, block_names, *, seq_mean_token_mean=False):
    """Exact per-response gradients [B, d] (float64) of sum_t w_t log pi(o_t), one response at a time with autograd."""
    t_resp = response_mask.shape[1]
    position_ids = torch.clip(attention_mask.cumsum(-1) - 1, min=0)
    rows = []
    for b in range(input_ids.shape[0]):
        model.zero_grad(set_to_none=True)
        sl = slice(b, b + 1)
        logits = model(
            input_ids=input_ids[sl], attention_mask=attention_mask[sl], position_ids=position_ids[sl], use_cache=False
        ).logits[0, -t_resp - 1 : -1]
        lp = torch.log_softmax(logits.double(), -1).gather(-1, input_ids[b, -t_resp:, None]).squeeze(-1)
        w = response_mask[b].double()
        if seq_mean_token_mean:
            w = w / w.sum().clamp(min=1)
        (lp * w).sum().backward()
        rows.append(torch.cat([block_gradient(model, n).double() for n in block_names]))
    model.zero_grad(set_to_none=True)
    return torch.stack(rows)


def cosine(gram):
    d = gram.diagonal().sqrt()
    return gram / d[:, None] / d[None, :]


# ---------------------------------------------------------------------- the recipes' model families
def _perturb_vectors(model, seed):
    """Non-trivial 1-D parameters (norm weights, Gated DeltaNet's A_log / dt_bias) so their gradients differ."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def tiny_qwen3(*, seed=0, tie=False, hidden=32, layers=2, vocab=96, dtype=torch.float64):
    """Randomly initialised Qwen3ForCausalLM (dense, q/k norms): the Qwen3 recipes' family."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=tie, pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return _perturb_vectors(Qwen3ForCausalLM(cfg).to(dtype), seed).eval()


def qwen35_vl_config(*, vocab=96):
    """A tiny Qwen3_5Config: 3 Gated DeltaNet layers + 1 full-attention layer, and a 2-block vision tower."""
    from transformers import Qwen3_5Config

    text = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=128, pad_token_id=0,
    )
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2)
    return Qwen3_5Config(text_config=text, vision_config=vision)


def tiny_qwen35_vl(*, seed=0, vocab=96, dtype=torch.float64):
    """Randomly initialised Qwen3_5ForConditionalGeneration, the class verl 0.9.1 loads Qwen3.5-4B/9B as."""
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(qwen35_vl_config(vocab=vocab)).to(dtype)
    return _perturb_vectors(model, seed).eval()


def qwen3_moe_config(*, vocab=96):
    """A tiny Qwen3MoeConfig: experts stored as 3-D parameters (transformers 5), which are not nn.Linear."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, pad_token_id=0,
    )


def tiny_qwen3_moe(*, seed=0, vocab=96, dtype=torch.float32):
    """Randomly initialised Qwen3MoeForCausalLM (float32: the experts' grouped matmul has no float64 kernel)."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(qwen3_moe_config(vocab=vocab)).to(dtype).eval()


def with_lora(model, *, rank=4, target_modules="all-linear", seed=0):
    """``model`` wrapped as verl 0.9.1's ``FSDPEngine._build_lora_module`` does (peft, task CAUSAL_LM, no bias),
    with random adapter weights (peft's default zero lora_B would make lora_A's gradient zero)."""
    from peft import LoraConfig, TaskType, get_peft_model

    model.enable_input_require_grads()
    torch.manual_seed(seed)
    cfg = LoraConfig(task_type=TaskType.CAUSAL_LM, r=rank, lora_alpha=2 * rank, target_modules=target_modules,
                     bias="none", init_lora_weights=False)
    return get_peft_model(model, cfg)


def qwen3_config(*, vocab=96, tie=False):
    """The configuration of :func:`tiny_qwen3`."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=tie, pad_token_id=0,
    )


def save_config_dir(config, architecture: str, out):
    """A model directory holding only ``config.json`` (what a meta-device build reads), ``architectures`` set as
    ``save_pretrained`` sets it (verl's ``get_hf_auto_model_class`` reads it)."""
    config.architectures = [architecture]
    config.save_pretrained(out)
    return out


def tiny_qwen35_text(*, seed=0, hidden=32, vocab=96, dtype=torch.float32):
    """Randomly initialised Qwen3_5ForCausalLM with the hybrid layout: Gated DeltaNet (linear attention) layers and
    one full-attention layer."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                            layer_types=["linear_attention", "linear_attention", "full_attention"],
                            max_position_embeddings=128, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(cfg).to(dtype).eval()


def with_per_sequence_delta_rule(model):
    """``model`` with each Gated DeltaNet layer's delta rule replaced by transformers' torch fallback behind a
    signature without ``**kwargs``, so that verl 0.9.1's patched layer runs it on each packed sequence alone (what
    flash-linear-attention's kernel does with ``cu_seqlens``)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    def per_sequence(query, key, value, g, beta, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False):
        return torch_chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                            output_final_state=output_final_state,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    for module in model.modules():
        if hasattr(module, "chunk_gated_delta_rule"):
            module.chunk_gated_delta_rule = per_sequence
    return model
