"""The sketch pass in verl's batch layouts, padded and packed (docs/algorithm.md#5-sketches, docs/sketch.md#mechanics).

No verl import: the layouts follow verl 0.9.1's conventions, left-padded prompt + right-padded response with
``position_ids = clip(cumsum(attention_mask) - 1, 0)`` (``verl.utils.model.compute_position_id_with_mask``), and
the remove-padding (packed) layout of ``FSDPEngineWithLMHead.prepare_model_inputs``: the valid tokens of all rows
in [1, nnz], ``attention_mask=None``, per-sequence restarting ``position_ids``, plus ``cu_seqlens`` where the
forward takes them.  The trainer's worker runs the engine's own input/output preparation
(``setgrpo_verl.integration.worker``); :func:`compute_sketches` is the same pass for a plain module.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from setgrpo_verl.sketch.chunks import chunk_rows
from setgrpo_verl.sketch.config import SketchConfig, token_weights
from setgrpo_verl.sketch.fsdp import fsdp1_reshard_in_backward, unwrapped
from setgrpo_verl.sketch.hooks import GradientSketcher


@dataclass
class SketchOutput:
    """Result of :func:`compute_sketches`.

    Attributes:
        sketches: float32 [B, m], row i is the sketch S_i of response i (same order as the input
            batch); the driver forms each group's Gram matrix M_g = S_g S_g^T in float64.
        log_probs: float32 [B, T_resp], log pi(o_it) of the response tokens from the same forward
            (after temperature scaling), 0 where the response position is padding
            (``attention_mask`` 0); usable as verl's ``old_log_probs``.
        block_names: names of the sketched blocks, in the order their slices appear in a row.
    """

    sketches: torch.Tensor
    log_probs: torch.Tensor
    block_names: list[str]



def forward_takes(model: nn.Module, name: str) -> bool:
    """Whether the forward of ``model`` (unwrapped from FSDP1, checkpoint and compile wrappers) names the argument
    ``name`` (``**kwargs`` does not count)."""
    try:
        return name in inspect.signature(unwrapped(model).forward).parameters
    except (TypeError, ValueError):
        return False


def packed_needs_cu_seqlens(model: nn.Module) -> bool:
    """True when the packed layout ([1, nnz], ``attention_mask=None``) is only correct with sequence boundaries
    passed as ``cu_seqlens`` (docs/sketch.md#mechanics).

    Attention layers find the boundaries from the restarting ``position_ids``; linear-attention (recurrent)
    layers, e.g. Qwen3.5's Gated DeltaNet (config ``layer_types`` entry ``"linear_attention"``), do not and carry
    their state from one packed sequence into the next unless the forward receives ``cu_seqlens`` (verl's monkey
    patch of ``Qwen3_5ForConditionalGeneration`` adds that argument).

    Args:
        model: the HF model (plain, FSDP1 or FSDP2 wrapped).

    Returns:
        bool: the model has linear-attention layers (so ``cu_seqlens`` is required for packed inputs).
    """
    config = getattr(unwrapped(model), "config", None)
    if config is None:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or ()
    return any("linear" in str(t) for t in layer_types)



def packed_linear_attention_error(model: nn.Module) -> str | None:
    """Why the packed layout would be inexact on the model's linear-attention layers under verl 0.9.1's patch, or None
    (docs/sketch.md#supported-settings).

    verl's patched Gated DeltaNet forward hands ``cu_seqlens`` to the layer's ``chunk_gated_delta_rule`` whenever the
    rule's signature accepts that keyword, ``**kwargs`` included, and splits the packed batch into its sequences
    only otherwise (``verl.models.transformers.qwen3_5._packed_chunk_gated_delta_rule``).  flash-linear-attention's
    kernel names ``cu_seqlens`` and honours it; transformers' torch fallback ``torch_chunk_gated_delta_rule`` (used
    when flash-linear-attention is not installed) takes ``**kwargs`` and ignores it, so the recurrent state runs on
    from one packed sequence into the next.  The causal-convolution fallback is split per sequence and exact.

    Args:
        model: the HF model (plain, FSDP1 or FSDP2 wrapped; meta device is enough).

    Returns:
        None when every layer's delta rule names ``cu_seqlens`` or takes no ``**kwargs``; else the reason, naming the
        module, the rule and the settings that fix it.
    """
    for name, module in unwrapped(model).named_modules():
        rule = getattr(module, "chunk_gated_delta_rule", None)
        if not callable(rule):
            continue
        try:
            params = inspect.signature(rule).parameters
        except (TypeError, ValueError):
            continue
        swallows = any(p.kind == p.VAR_KEYWORD for p in params.values())
        if swallows and "cu_seqlens" not in params:
            return (
                f"packed sequences (use_remove_padding=True) on {type(unwrapped(model)).__name__}: its linear-attention "
                f"layer {name!r} runs the delta rule {getattr(rule, '__name__', rule)!r}, which takes cu_seqlens "
                "through **kwargs and ignores it (transformers' torch fallback, used when flash-linear-attention is "
                "not installed), so verl 0.9.1 passes it the packed batch whole and each response's recurrent state "
                "starts from the previous one's (sketches and log-probs off by about 1%). Install "
                "flash-linear-attention (verl's fsdp extra), or set actor_rollout_ref.model.use_remove_padding=false"
            )
    return None


def _scaled_by_temperature(logits: torch.Tensor, temperature) -> torch.Tensor:
    """logits / temperature in the logits' dtype (verl 0.9.1 ``_scale_logits_by_temperature``); temperature is a
    float or a float tensor broadcastable to logits ([n, 1] for [n, V] logits)."""
    if not isinstance(temperature, torch.Tensor) and float(temperature) == 1.0:
        return logits
    t = temperature if isinstance(temperature, torch.Tensor) else torch.tensor(float(temperature))
    return logits / t.to(torch.float32).clamp(min=1e-8).to(device=logits.device, dtype=logits.dtype)


def _chunk_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32, fp64 kept
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[targets] per row ([n, V], [n] -> float [n]) in row chunks; each chunk is recomputed in
    the backward (non-reentrant checkpoint), so no [n, V] float32 tensor is kept for the backward."""
    step = chunk_rows(logits.shape[-1])
    if logits.shape[0] <= step or not logits.requires_grad:
        return _chunk_log_probs(logits, targets)
    # split, not slicing: each slice's backward would write a zero-padded [n, V] gradient (quadratic in n), split's
    # backward concatenates the chunks' gradients once
    parts = [checkpoint(_chunk_log_probs, chunk, tgt, use_reentrant=False)
             for chunk, tgt in zip(logits.split(step), targets.split(step))]
    return torch.cat(parts)



def _validate(input_ids, attention_mask, response_mask, position_ids, temperature):
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T_prompt + T_resp], got shape {tuple(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    bsz, seqlen = input_ids.shape
    if response_mask.dim() != 2 or response_mask.shape[0] != bsz or not 1 <= response_mask.shape[1] < seqlen:
        raise ValueError(
            f"response_mask must be [B={bsz}, T_resp] with 1 <= T_resp < T={seqlen} (it covers the LAST T_resp "
            f"positions of input_ids), got shape {tuple(response_mask.shape)}"
        )
    if not ((response_mask == 0) | (response_mask == 1)).all():
        raise ValueError("response_mask must contain only 0/1 values")
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must contain only 0/1 values")
    t_resp = response_mask.shape[1]
    if (response_mask.bool() & ~attention_mask[:, -t_resp:].bool()).any():
        raise ValueError(
            "response_mask marks positions whose attention_mask is 0: the response mask does not match the inputs "
            "(response_mask must cover the last T_resp positions of input_ids, right-padded)"
        )
    if (attention_mask[:, : seqlen - t_resp].sum(-1) == 0).any():
        raise ValueError("every sequence needs at least one prompt token (attention_mask over the prompt part)")
    if position_ids is not None and position_ids.shape != input_ids.shape:
        raise ValueError(
            f"position_ids shape {tuple(position_ids.shape)} != input_ids shape {tuple(input_ids.shape)} "
            "(mrope 3-D position ids are not supported)"
        )
    if isinstance(temperature, torch.Tensor):
        if temperature.shape not in ((), (bsz,)):
            raise ValueError(f"temperature must be a float or a [B={bsz}] tensor, got shape {tuple(temperature.shape)}")
        if not (temperature > 0).all():
            raise ValueError("temperature must be > 0")
    elif not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _micro_batch(sk, model, ids, am, pos, weights, temperature, t_resp, use_remove_padding):
    bsz, seqlen = ids.shape
    rows = torch.arange(bsz, device=ids.device)
    resp_cols = torch.arange(seqlen - t_resp, seqlen, device=ids.device)
    valid_resp = am[:, -t_resp:].bool()
    if use_remove_padding:
        flat_valid = am.reshape(-1).bool()
        index = flat_valid.nonzero().squeeze(1)  # == verl unpad_input indices
        nnz = index.numel()
        inverse = torch.full((bsz * seqlen,), -1, dtype=torch.long, device=ids.device)
        inverse[index] = torch.arange(nnz, device=ids.device)
        model_ids, model_pos = ids.reshape(-1)[index][None], pos.reshape(-1)[index][None]
        segments = (rows[:, None].expand(bsz, seqlen)).reshape(-1)[index][None]
        # logits row predicting response token (b, t): the packed row of (b, t - 1); the valid tokens only
        k = inverse[(rows[:, None] * seqlen + resp_cols[None, :]).reshape(-1)].reshape(bsz, t_resp)[valid_resp]
        head_rows, keep = k - 1, k - 1
        targets = model_ids[0][k]
        model_kwargs = dict(input_ids=model_ids, position_ids=model_pos, attention_mask=None)
        if forward_takes(model, "cu_seqlens"):  # verl 0.9.1's rule (FSDPEngine.pass_packed_cu_seqlens)
            cu_seqlens = torch.nn.functional.pad(am.sum(-1).cumsum(0), (1, 0))
            model_kwargs.update(cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens.cpu())
        elif packed_needs_cu_seqlens(model):
            raise ValueError(
                f"use_remove_padding=True on {type(unwrapped(model)).__name__}, a model with linear-attention layers "
                "whose forward takes no cu_seqlens: the packed sequences would run as one sequence through those "
                "layers. Use the padded layout (use_remove_padding=False) or a forward that takes cu_seqlens "
                "(verl's monkey patch of Qwen3_5ForConditionalGeneration)"
            )
        reason = packed_linear_attention_error(model)
        if reason is not None:
            raise ValueError(reason)
        row_of = rows[:, None].expand(bsz, t_resp)[valid_resp]
    else:
        segments = torch.where(am.bool(), rows[:, None], torch.full_like(ids, -1))
        # every row's response is scored by the same columns: the head keeps those, padded response tokens included
        keep = resp_cols - 1
        head_rows = (rows[:, None] * seqlen + keep[None, :]).reshape(-1)
        targets = ids[:, -t_resp:].reshape(-1)
        model_kwargs = dict(input_ids=ids, position_ids=pos, attention_mask=am)
        row_of = rows.repeat_interleave(t_resp)
    kept = forward_takes(model, "logits_to_keep")
    if kept:  # the head computes the scoring rows only
        model_kwargs["logits_to_keep"] = keep
        sk.begin(segments, bsz, head_rows=head_rows, head_rows_only=True)
    else:
        sk.begin(segments, bsz, head_rows=head_rows[valid_resp.reshape(-1)] if not use_remove_padding else head_rows)
    with torch.enable_grad():
        logits = model(**model_kwargs, use_cache=False).logits
        logits = logits.reshape(-1, logits.shape[-1])
        if not kept:
            logits = logits[head_rows]  # [n, V], model dtype
        elif logits.shape[0] != head_rows.numel():
            raise ValueError(
                f"{type(unwrapped(model)).__name__}'s forward takes logits_to_keep but returned {logits.shape[0]} "
                f"logit rows for {head_rows.numel()} kept positions"
            )
        temp = temperature if not isinstance(temperature, torch.Tensor) or not temperature.dim() else \
            temperature.to(logits.device)[row_of][:, None]
        log_probs = _token_log_probs(_scaled_by_temperature(logits, temp), targets)
        if use_remove_padding:
            log_probs = log_probs.new_zeros(bsz, t_resp).masked_scatter(valid_resp, log_probs)
        else:
            log_probs = torch.where(valid_resp, log_probs.reshape(bsz, t_resp), 0.0)
        if not torch.isfinite(log_probs).all():
            bad = (~torch.isfinite(log_probs)).any(-1).nonzero().squeeze(1).tolist()
            raise FloatingPointError(
                f"non-finite log-probabilities for responses {bad} of the micro-batch (check the model weights, "
                "dtype and temperature)"
            )
        objective = (log_probs * weights).sum()
        sketches = sk.backward(objective)
    return sketches, log_probs.detach().float()


def compute_sketches(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    config: SketchConfig | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    temperature: float | torch.Tensor = 1.0,
    micro_batch_size: int | None = None,
    use_remove_padding: bool = False,
    projection_dtype: torch.dtype | None = None,
) -> SketchOutput:
    """Per-response gradient sketches and response log-probs in verl's batch layout (docs/algorithm.md#5-sketches).

    The objective of response i is sum_t w_it log pi(o_it) with w from ``loss_agg_mode``
    (docs/algorithm.md#0-notation: w = response_mask for token-mean / token-sum / seq-mean-token-sum /
    seq-mean-token-sum-norm, response_mask / |o_i| for seq-mean-token-mean); its gradient includes
    the prompt positions.  One forward and one activation-only backward per micro-batch; no
    parameter ``.grad`` is created.  The model's train/eval mode is left as it is.  A forward that takes
    ``logits_to_keep`` (Hugging Face causal LMs) is called with the positions that score a response token, so the LM
    head never builds the prompt positions' logits; the log-probs and sketches are those of the full logits to float
    tolerance.

    Args:
        model: HF causal LM (``model(input_ids=, attention_mask=, position_ids=, use_cache=False).logits``),
            plain or wrapped by FSDP/FSDP2.
        input_ids: int64 [B, T_prompt + T_resp], prompt left-padded, response right-padded.
        attention_mask: 0/1 [B, T] (any int/bool dtype), contiguous ones per row.
        response_mask: 0/1 [B, T_resp] over the LAST T_resp positions; 1 = token in the loss.
        config: :class:`SketchConfig` (defaults if None).
        position_ids: int64 [B, T]; default ``clip(cumsum(attention_mask) - 1, 0)`` (verl).
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        temperature: float > 0 or float [B]; logits are divided by it before log_softmax (verl).
        micro_batch_size: responses per forward/backward (default: all B at once); sketches do not
            depend on it; peak memory does.
        use_remove_padding: run the forward on the packed layout (valid tokens of all rows
            concatenated into [1, nnz], ``attention_mask=None``, per-sequence position ids: verl's
            remove-padding path).  Same sketches as the padded layout to float tolerance.
        projection_dtype: None: on CUDA each layer's projections in the precision of its own product, off CUDA
            float32 (docs/sketch.md#precision); a dtype: every ``nn.Linear`` and embedding projection in it (reference
            arithmetic, :class:`GradientSketcher`).

    Returns:
        :class:`SketchOutput` with ``sketches`` float32 [B, m] and ``log_probs`` float32 [B, T_resp].

    Raises:
        ValueError: shapes/values of the masks do not match the inputs (response mask marking padded
            positions, wrong T_resp, non 0/1), unknown ``loss_agg_mode``, bad temperature or
            micro_batch_size, or a model without nn.Linear layers (from :class:`GradientSketcher`).
        FloatingPointError: non-finite log-probabilities of valid response tokens.
    """
    _validate(input_ids, attention_mask, response_mask, position_ids, temperature)
    if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise ValueError(f"micro_batch_size must be a positive int or None, got {micro_batch_size!r}")
    weights = token_weights(response_mask, loss_agg_mode)
    attention_mask = attention_mask.long()
    if position_ids is None:
        position_ids = torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
    bsz, t_resp = response_mask.shape
    step = micro_batch_size or bsz
    sketches, log_probs = [], []
    with GradientSketcher(model, config, projection_dtype=projection_dtype) as sk, fsdp1_reshard_in_backward(model):
        for start in range(0, bsz, step):
            sl = slice(start, start + step)
            temp = temperature[sl] if isinstance(temperature, torch.Tensor) and temperature.dim() else temperature
            s, lp = _micro_batch(
                sk, model, input_ids[sl], attention_mask[sl], position_ids[sl], weights[sl], temp, t_resp,
                use_remove_padding,
            )
            sketches.append(s)
            log_probs.append(lp)
        names = [b.name for b in sk.blocks]
    return SketchOutput(sketches=torch.cat(sketches), log_probs=torch.cat(log_probs).float(), block_names=names)
