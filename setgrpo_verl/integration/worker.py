"""Actor worker with the per-response gradient-sketch RPC (docs/algorithm.md#5-sketches).

:class:`SetGRPOActorRolloutRefWorker` is verl 0.9.1's ``engine_workers.ActorRolloutRefWorker`` plus one RPC,
``compute_sketches``, registered with the same dispatch as ``compute_log_prob``
(``make_nd_compute_dataproto_dispatch_fn(mesh_name="actor")``): the driver passes the batch (a TransferQueue
``KVBatchMeta`` in verl's v1 trainer, or a ``TensorDict``), every data-parallel rank sketches its shard with
the engine's own micro-batching (``verl.workers.engine.utils.prepare_micro_batches``, dynamic batch size
included) and remove-padding setting, and the driver receives float32 ``[B, m]`` sketches in batch order
under the key :data:`SKETCH_KEY`.

The sketch pass is one forward plus one activation-only backward per micro-batch (``setgrpo_verl.sketch``),
under the engine's eval mode, through the engine's own ``prepare_model_inputs`` and forward autocast, so the model
sees exactly the inputs (``cu_seqlens`` included), and the log-probs are computed the way verl's ``compute_log_prob``
computes them, on the positions that score a response token only. By default it runs after verl's own old-log-prob pass;
``compute_log_prob_and_sketches`` is the fused variant (``algorithm.setgrpo.sketch.fuse_old_log_prob=true``) that
also returns verl's ``old_log_probs`` and ``entropy`` from the same forward, so the only extra cost over plain GRPO is the
activation-only backward. Ulysses sequence parallelism is not supported (the sketch hook needs whole sequences
per rank).
"""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any, Optional

import torch
from tensordict import TensorDict

from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.utils.seqlen_balancing import restore_dynamic_batch
from verl.utils.torch_functional import (entropy_from_logits, entropy_from_logits_with_chunking,
                                        logprobs_from_logits)
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.engine_workers import ActorRolloutRefWorker

from setgrpo_verl.sketch import (
    GradientSketcher,
    SketchConfig,
    activation_checkpointing,
    forward_takes,
    fsdp1_reshard_in_backward,
    packed_linear_attention_error,
    packed_needs_cu_seqlens,
    raise_on_every_rank,
    token_weights,
)

from .gpu_env import gpu_check

logger = logging.getLogger(__name__)

#: Output field of the sketch RPC (float32 [B, m]); also the TransferQueue field name in the v1 trainer.
SKETCH_KEY = "setgrpo_sketch"
#: Non-tensor input field carrying ``dataclasses.asdict(SketchConfig)`` from the driver.
SKETCH_CONFIG_KEY = "setgrpo_sketch_config"
#: Optional input field, bool [B]: True for the rows to sketch. The other rows (those of groups that cannot update,
#: docs/sketch.md#skipped-rows) get their log-probs from a forward only, no backward, and NaN sketch rows; without
#: the field every row is sketched.
SKETCH_ROWS_KEY = "setgrpo_sketch_rows"

def _nested_layout(data: TensorDict) -> TensorDict:
    """Check that the batch is in verl's no-padding layout (nested ``input_ids`` / ``position_ids`` /
    ``response_mask``, the v1 trainer's layout), which is what ``FSDPEngineWithLMHead.prepare_model_inputs`` reads."""
    for key in ("input_ids", "position_ids", "prompts", "responses", "response_mask"):
        if key not in data.keys():
            raise ValueError(
                f"the sketch RPC needs the batch field {key!r} (verl rollout output, as compute_log_prob reads it); "
                f"got {sorted(data.keys())}"
            )
        if not data[key].is_nested:
            raise ValueError(
                f"the sketch RPC needs verl's no-padding layout (nested tensors, as verl's v1 trainer sends), but "
                f"{key!r} is a dense tensor: convert the batch with verl.workers.utils.padding.left_right_2_no_padding"
            )
    if "temperature" not in data.keys():
        raise ValueError(
            "the sketch RPC needs the rollout temperature as the non-tensor field 'temperature' (verl's "
            "compute_log_prob reads the same field)"
        )
    tu.maybe_fix_3d_position_ids(data)
    return data


def _host_layout(mb: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """From the host micro-batch (before it moves to the device): int64 [b] sequence lengths and the int64 indices
    of the response log-probs in the packed per-token log-probs (position t scores token t + 1, so response token j
    of row i sits at ``offset_{i+1} - len_resp_i - 1 + j``, verl's ``response_from_nested``).  Host arithmetic: no
    device sync."""
    offsets = mb["input_ids"].offsets()
    resp = mb["response_mask"].offsets().diff()
    ends = offsets[1:]
    starts = ends - resp - 1
    index = torch.cat([torch.arange(int(a), int(e) - 1) for a, e in zip(starts.tolist(), ends.tolist())])
    return offsets.diff(), index


def _response_lengths(mb: TensorDict) -> list[int]:
    """Response lengths of the host micro-batch's rows (host offsets, no device sync)."""
    return mb["response_mask"].offsets().diff().tolist()


def _token_segments(lengths: torch.Tensor, model_inputs: dict) -> torch.Tensor:
    """Host int64 tensor with the token shape of ``model_inputs['input_ids']``: the row of the micro-batch each
    position belongs to, -1 for padding (packed: [1, nnz + pad] with the bucket/SP pad at the tail; padded: [B, T]
    right-padded as ``prepare_model_inputs`` builds it)."""
    shape = model_inputs["input_ids"].shape
    rows = torch.arange(lengths.numel())
    if model_inputs.get("attention_mask") is None:  # packed
        seg = torch.repeat_interleave(rows, lengths)
        return torch.cat([seg, seg.new_full((shape[-1] - seg.numel(),), -1)])[None]
    valid = torch.arange(shape[-1])[None, :] < lengths[:, None]
    return torch.where(valid, rows[:, None], torch.full(valid.shape, -1, dtype=torch.long))


def _head_rows(lengths: torch.Tensor, response_index: torch.Tensor, response_lengths: list[int],
               model_inputs: dict) -> torch.Tensor:
    """Host int64 indices of the flattened token rows of ``model_inputs['input_ids']`` that score a response token
    (the only rows whose LM-head output gradient can be non-zero): packed, the response log-probs' own indices;
    padded [B, T], row i's positions ``len_i - resp_i - 1 .. len_i - 2`` at ``i * T``."""
    if model_inputs.get("attention_mask") is None:  # packed: token rows are the packed positions
        return response_index
    width = model_inputs["input_ids"].shape[-1]
    return torch.cat([torch.arange(i * width + int(n) - r - 1, i * width + int(n) - 1)
                      for i, (n, r) in enumerate(zip(lengths.tolist(), response_lengths))])


def _forward_autocast(engine: Any):
    """verl 0.9.1 ``FSDPEngineWithLMHead.forward_step``'s autocast around the model forward and
    ``prepare_model_outputs``: ``engine._autocast_dtype`` (mixed_precision.param_dtype, bf16 by default), none for
    float32.  Copied (5 lines) because forward_step also runs the loss and detaches the outputs;
    tests/integration/test_worker_unit.py fingerprints the original."""
    autocast_dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
    if autocast_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=get_device_name(), dtype=autocast_dtype)


def _check_engine(engine: Any, mb: TensorDict) -> None:
    if tu.get_non_tensor_data(mb, "use_fused_kernels", False):
        raise NotImplementedError(
            "SetGRPO sketches need the LM head's logits, which fused kernels do not build: set "
            "actor_rollout_ref.model.use_fused_kernels=False"
        )
    packed = tu.get_non_tensor_data(mb, "use_remove_padding", True)
    if packed and not getattr(engine, "pass_packed_cu_seqlens", False) and packed_needs_cu_seqlens(engine.module):
        raise NotImplementedError(
            f"use_remove_padding=True on {type(engine.module).__name__}, a model with linear-attention layers whose "
            "forward takes no cu_seqlens: verl would run the packed responses as one sequence through those layers. "
            "Set actor_rollout_ref.model.use_remove_padding=False (or load the model as "
            "Qwen3_5ForConditionalGeneration, whose verl forward takes cu_seqlens)"
        )
    reason = packed_linear_attention_error(engine.module) if packed else None
    if reason is not None:
        raise NotImplementedError(reason)


def _response_log_probs(logits: torch.Tensor, output_args: dict, rows: torch.Tensor, response_index: torch.Tensor,
                        row_of_token: torch.Tensor) -> torch.Tensor:
    """verl 0.9.1 ``FSDPEngineWithLMHead.prepare_model_outputs``'s log-probs (no fused kernels, no entropy), on the
    rows that score a response token only: the logits divided by the row's temperature in the logits' dtype (none
    when ``temperature_is_one``), then verl's ``logprobs_from_logits`` of the next tokens. Row by row this is the
    arithmetic verl runs on every position, so the values equal verl's own; the prompt positions' log-softmax, and
    in the padded layout the copy of the valid logits into one packed tensor, are left out with their backward.
    Copied (the scaling rule and the label and temperature fields); tests/integration/test_worker_unit.py
    fingerprints the original.

    Args:
        logits: the model's logits, padded [b, T, V] or packed [1, nnz + pad, V] (model dtype), or those of the rows
            that score the response tokens only, [1, n, V] (the forward was given ``logits_to_keep``).
        output_args: ``prepare_model_inputs``' second output (``input_ids_rmpad_rolled`` in packed order,
            ``temperature`` [b] padded or ``temperature_rmpad`` [nnz + pad] packed, ``temperature_is_one``).
        rows: int64 [n] flattened token rows of ``logits`` that score the response tokens (:func:`_head_rows`), or
            None when ``logits`` holds those rows only, in order.
        response_index: int64 [n] the same tokens' packed positions (:func:`_host_layout`).
        row_of_token: int64 [n] the micro-batch row of each token.

    Returns:
        ``(log_probs, scores)``: [n] response log-probs in the dtype verl's ``logprobs_from_logits`` returns for
        these logits, rows concatenated in order (with grad when enabled), and the [n, V] temperature-scaled logits
        they come from (for :func:`_response_entropy`).
    """
    scores = logits.reshape(-1, logits.shape[-1])
    if rows is not None:
        scores = scores[rows]
    elif scores.shape[0] != response_index.numel():
        raise ValueError(f"the forward took logits_to_keep but returned {scores.shape[0]} logit rows for "
                         f"{response_index.numel()} response tokens")
    if not output_args.get("temperature_is_one", False):
        if "temperature_rmpad" in output_args:
            temperature = output_args["temperature_rmpad"][response_index]
        else:
            temperature = output_args["temperature"][row_of_token]
        scores = scores / temperature.unsqueeze(-1).clamp(min=1e-8).to(scores.dtype)
    return logprobs_from_logits(logits=scores, labels=output_args["input_ids_rmpad_rolled"][response_index]), scores


def _response_entropy(engine: Any, scores: torch.Tensor) -> torch.Tensor:
    """verl 0.9.1 ``FSDPEngineWithLMHead.prepare_model_outputs``' entropy of the temperature-scaled logits, on the
    response rows only, without grad: ``entropy_from_logits`` (in the logits' dtype), or its chunked float32 variant
    when the engine's ``entropy_from_logits_with_chunking`` is set, as verl's own old-log-prob pass reports it.

    Args:
        engine: the actor's engine (``engine_config`` read for the chunking settings; absent: no chunking).
        scores: [n, V] temperature-scaled logits of the response rows (:func:`_response_log_probs`).

    Returns:
        [n] entropies (nats), detached.
    """
    config = getattr(engine, "engine_config", None)
    with torch.no_grad():
        if config is not None and getattr(config, "entropy_from_logits_with_chunking", False):
            return entropy_from_logits_with_chunking(scores.detach(), chunk_size=config.entropy_from_logits_chunk_size)
        return entropy_from_logits(scores.detach())


def _keeps_logits(engine: Any, model_inputs: dict) -> bool:
    """Whether the forward is given ``logits_to_keep`` (the positions that score a response token, so the LM head never
    builds the prompt positions' logits, docs/sketch.md#mechanics): the packed layout, whose kept positions are one
    index along the packed tokens, on a model whose forward names the argument (Hugging Face causal LMs; not
    verl's replaced vision-language forwards)."""
    if model_inputs.get("attention_mask") is not None:  # padded [b, T]: the rows score their responses in other columns
        return False
    return forward_takes(engine.module, "logits_to_keep")


def _sketch_micro_batch(
    engine: Any, sk: Optional[GradientSketcher], mb: TensorDict, loss_agg_mode: str
) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """One micro-batch through the engine's own forward path: ``prepare_model_inputs`` (packed inputs with
    ``cu_seqlens`` where the model takes them, or padded), the module forward under the engine's autocast, verl's
    log-probs of the response tokens (:func:`_response_log_probs`), then the activation-only sketch backward of
    sum_i sum_t w_it log pi(o_it); with ``sk=None`` the forward alone, under ``torch.no_grad()`` (rows that are not
    sketched).

    Returns ``(float32 [b, m] sketches or None without ``sk``, the response log-probs of all rows concatenated
    [sum_i j_i] in verl's dtype, bool [b]: rows with a non-finite response log-prob, the response entropies
    [sum_i j_i] when the micro-batch asks for them with verl's ``calculate_entropy`` else None)``, all on the device and
    detached.  Nothing here waits for the device: the non-finite rows are reported by the caller once per call (a
    row's non-finite log-prob makes only its own sketch non-finite)."""
    lengths, response_index = _host_layout(mb)
    response_lengths = _response_lengths(mb)
    row_of_token = torch.repeat_interleave(torch.arange(len(response_lengths)), torch.tensor(response_lengths))
    mb = mb.to(get_device_id())  # the engine's device (parameters may be offloaded to the host)
    model_inputs, output_args = engine.prepare_model_inputs(micro_batch=mb)
    device = model_inputs["input_ids"].device
    head_rows = _head_rows(lengths, response_index, response_lengths, model_inputs)
    head_rows_device = head_rows.to(device, non_blocking=True)
    keep = _keeps_logits(engine, model_inputs)
    if keep:
        model_inputs = {**model_inputs, "logits_to_keep": head_rows_device}
    if sk is not None:
        sk.begin(_token_segments(lengths, model_inputs), len(mb), device=device, head_rows=head_rows,
                 head_rows_only=keep)
    grad = torch.enable_grad() if sk is not None else torch.no_grad()
    sketches = entropy = None
    calculate_entropy = bool(tu.get_non_tensor_data(data=mb, key="calculate_entropy", default=False))
    with grad, _forward_autocast(engine):
        raw_output = engine.module(**model_inputs, use_cache=False)
        values, scores = _response_log_probs(raw_output.logits, output_args, None if keep else head_rows_device,
                                     response_index.to(device, non_blocking=True),
                                     row_of_token.to(device, non_blocking=True))
        rmask = mb["response_mask"].to_padded_tensor(0).bool()  # [b, R]
        ends = torch.tensor(response_lengths, device=device)[:, None]
        valid = torch.arange(rmask.shape[1], device=device)[None, :] < ends
        log_probs = values.new_zeros(rmask.shape).masked_scatter(valid, values)  # [b, R] response log-probs
        nonfinite = (~torch.isfinite(log_probs) & rmask).any(-1)
        if calculate_entropy:
            entropy = _response_entropy(engine, scores)
        del scores
        if sk is not None:
            objective = (log_probs.float() * token_weights(rmask, loss_agg_mode)).sum()
            sketches = sk.backward(objective).float()
    return sketches, values.detach(), nonfinite, entropy


def _rows_to_sketch(mb: TensorDict) -> Optional[torch.Tensor]:
    """Host bool [b] of :data:`SKETCH_ROWS_KEY`, or None when the batch does not carry the field (sketch every row)."""
    if SKETCH_ROWS_KEY not in mb.keys():
        return None
    rows = mb[SKETCH_ROWS_KEY]
    rows = torch.stack(rows.unbind()) if rows.is_nested else rows
    if rows.dtype != torch.bool or rows.shape != (len(mb),):
        raise ValueError(f"{SKETCH_ROWS_KEY!r} must be bool [B={len(mb)}], got {rows.dtype} {tuple(rows.shape)}")
    return rows.cpu()


def _agreed_plan(micro_batches: list, group) -> list[tuple[bool, bool]]:
    """Per micro-batch, whether some data-parallel rank sketches rows of it and whether some rank runs a forward-only
    pass on it: every rank then runs the same passes (FSDP gathers the parameters in each forward, so the ranks must
    run the same forwards and backwards).  One collective per call, none on a single rank."""
    local = []
    for mb in micro_batches:
        rows = _rows_to_sketch(mb)
        local.append((True, False) if rows is None else (bool(rows.any()), bool((~rows).any())))
    if group is None or not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return local
    flags = torch.tensor(local, dtype=torch.int64).reshape(-1, 2).to(get_device_id())
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
    return [(bool(a), bool(b)) for a, b in flags.cpu().tolist()]


def _split_micro_batch(
    engine: Any, sk: GradientSketcher, mb: TensorDict, loss_agg_mode: str, plan: tuple[bool, bool]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """:func:`_sketch_micro_batch` of the micro-batch's sketched rows, and its forward alone on the other rows.

    Returns the micro-batch's ``(float32 [b, m] sketches with NaN rows for the rows not sketched, response log-probs
    concatenated in row order, bool [b] non-finite rows, response entropies in row order or None)``.  When another
    rank needs a pass this rank has no rows for (``plan``), it sketches its first row (a sketch it then has, marked
    or not) or repeats the forward on it."""
    need_sketch, need_forward = plan
    rows = _rows_to_sketch(mb)
    if rows is None or (rows.all() and not need_forward):
        return _sketch_micro_batch(engine, sk, mb, loss_agg_mode)
    rows = rows.clone()
    if need_sketch and not rows.any():
        rows[0] = True
    sketched, skipped = rows.nonzero().squeeze(1), (~rows).nonzero().squeeze(1)
    lengths = _response_lengths(mb)
    pieces: list = [None] * len(mb)
    entropies: list = [None] * len(mb)
    nonfinite = torch.zeros(len(mb), dtype=torch.bool)
    out = None

    def place(chosen: torch.Tensor, values: torch.Tensor, entropy: Optional[torch.Tensor]) -> None:
        split = [lengths[i] for i in chosen.tolist()]
        for i, v in zip(chosen.tolist(), values.split(split)):
            pieces[i] = v
        if entropy is not None:
            for i, e in zip(chosen.tolist(), entropy.split(split)):
                entropies[i] = e

    if sketched.numel():
        sketches, values, bad, entropy = _sketch_micro_batch(engine, sk, tu.index_select_tensor_dict(mb, sketched),
                                                             loss_agg_mode)
        out = sketches.new_full((len(mb), sketches.shape[1]), float("nan"))
        out[sketched.to(out.device)] = sketches
        place(sketched, values, entropy)
        nonfinite = nonfinite.to(bad.device).index_put((sketched.to(bad.device),), bad)
    if skipped.numel() or need_forward:
        forward_rows = skipped if skipped.numel() else sketched[:1]
        _, values, bad, entropy = _sketch_micro_batch(engine, None, tu.index_select_tensor_dict(mb, forward_rows),
                                                      loss_agg_mode)
        if skipped.numel():
            place(skipped, values, entropy)
            nonfinite = nonfinite.to(bad.device).index_put((skipped.to(bad.device),), bad)
    if out is None:
        out = torch.full((len(mb), sk.dim), float("nan"), dtype=torch.float32, device=pieces[0].device)
    entropy = None if entropies[0] is None else torch.cat(entropies)
    return out, torch.cat(pieces), nonfinite, entropy


def sketch_batch(engine: Any, data: TensorDict, config: SketchConfig, *, loss_agg_mode: str) -> torch.Tensor:
    """Sketch every response of a worker's shard, in the shard's order (docs/algorithm.md#5-sketches).

    Uses verl's ``prepare_micro_batches`` (fixed ``micro_batch_size_per_gpu`` or token-budget dynamic
    micro-batches with ``max_token_len_per_gpu``, the same number of micro-batches on every DP rank),
    ``restore_dynamic_batch`` to return rows in input order, and the engine's own model inputs and outputs
    (:func:`_sketch_micro_batch`).  One :class:`~setgrpo_verl.sketch.GradientSketcher` serves all micro-batches, so
    the projections go to the device once per call; activation checkpointing acts when the actor enables it
    (:func:`~setgrpo_verl.sketch.activation_checkpointing`), and FSDP1 units reshard during the sketch backward
    (:func:`~setgrpo_verl.sketch.fsdp1_reshard_in_backward`).

    Args:
        engine: verl's ``FSDPEngineWithLMHead`` of the actor (``engine.module`` plain, FSDP1 or FSDP2 wrapped).
        data: the shard as a TensorDict in verl's no-padding layout (nested ``input_ids``, ``position_ids``,
            ``prompts``, ``responses``, ``response_mask``) with verl's
            non-tensor keys ``use_dynamic_bsz``, ``max_token_len_per_gpu`` / ``micro_batch_size_per_gpu``,
            ``use_remove_padding`` and ``temperature``.
        config: the sketch settings (identical on every rank).
        loss_agg_mode: the actor's ``loss_agg_mode`` (token weights of the response-level gradient).

    Returns:
        float32 [B, m] sketches (CPU).

    Raises:
        ValueError: missing fields, or errors of :class:`~setgrpo_verl.sketch.GradientSketcher`.
        NotImplementedError: fused kernels, or packed inputs on linear attention without ``cu_seqlens``.
        FloatingPointError: non-finite log-probabilities.
    """
    return sketch_and_log_probs(engine, data, config, loss_agg_mode=loss_agg_mode)[0]


def sketch_and_log_probs(
    engine: Any, data: TensorDict, config: SketchConfig, *, loss_agg_mode: str
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """:func:`sketch_batch` plus the response log-probs of the same forward (the fused old-log-prob pass), and
    their entropies when ``data`` carries verl's ``calculate_entropy`` (as verl's own old-log-prob pass reports them).

    Returns:
        ``(sketches float32 [B, m], log_probs, entropy)`` with ``log_probs`` a jagged nested tensor [B, j] in the
        dtype verl's ``compute_log_prob`` returns (the logits' dtype): row i holds log pi(o_it) (after temperature)
        of the response tokens of row i, the values verl's own pass computes (verl's ``old_log_probs`` layout);
        ``entropy`` the same layout with the entropy (nats) of each of those token distributions
        (:func:`_response_entropy`), or None without ``calculate_entropy``.

    Raises:
        As :func:`sketch_batch`.
    """
    data = _nested_layout(data)
    group = engine.get_data_parallel_group()
    micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
    module = engine.module
    setup_error = None
    with contextlib.ExitStack() as stack:
        try:  # refusals of the model or settings: agreed across the ranks before any collective of the pass
            _check_engine(engine, micro_batches[0] if micro_batches else data)
            sk = stack.enter_context(GradientSketcher(module, config))
        except (ValueError, NotImplementedError, RuntimeError) as exc:
            setup_error = exc
        raise_on_every_rank(setup_error, group)
        stack.enter_context(activation_checkpointing(module))
        stack.enter_context(fsdp1_reshard_in_backward(module))
        parts, values, nonfinite, lengths, entropies = [], [], [], [], []
        for mb, plan in zip(micro_batches, _agreed_plan(micro_batches, group)):
            lengths.extend(_response_lengths(mb))
            sketches, log_probs, bad, entropy = _split_micro_batch(engine, sk, mb, loss_agg_mode, plan)
            parts.append(sketches)
            values.append(log_probs)
            nonfinite.append(bad)
            entropies.append(entropy)
    bad_rows = torch.cat(nonfinite).nonzero().squeeze(1).tolist() if nonfinite else []  # the pass's one device sync
    raise_on_every_rank(
        FloatingPointError(
            f"non-finite log-probabilities for rows {bad_rows} of this rank's shard, in micro-batch order (check the "
            "weights, dtype and temperature)"
        ) if bad_rows else None,
        group,
    )
    sketches = torch.cat(parts).cpu()
    log_probs = torch.nested.as_nested_tensor(list(torch.cat(values).cpu().split(lengths)), layout=torch.jagged)
    entropy = None
    if entropies and entropies[0] is not None:
        entropy = torch.nested.as_nested_tensor(list(torch.cat(entropies).cpu().split(lengths)), layout=torch.jagged)
    if indices is not None:
        sketches = restore_dynamic_batch(sketches, indices)
        log_probs = restore_dynamic_batch(log_probs, indices)
        entropy = None if entropy is None else restore_dynamic_batch(entropy, indices)
    return sketches, log_probs, entropy


class CheckedActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's hybrid actor/rollout/ref worker that checks its GPU environment when it starts, before any model loads
    (:func:`setgrpo_verl.integration.gpu_env.gpu_check`: CUDA available, the driver new enough for torch's CUDA,
    flash-attn importing and running one kernel when the policy loads with it; docs/verl_integration.md#gpu-requirements).
    The CPU backend skips the check. The actor worker of both trainer modes of this package.

    Raises (at construction):
        RuntimeError: the first thing wrong, naming the node, the rank and the fix.
    """

    def __init__(self, config, role: str, *args: Any, **kwargs: Any):
        super().__init__(config, role, *args, **kwargs)  # verl's Worker setup picks this rank's GPU; loads nothing
        error = gpu_check(config.get("model", None), run_kernel=True,
                          where=f"actor worker ({role}) rank {self.rank} on {socket.gethostname()}")
        if error:
            raise RuntimeError(error)


class SetGRPOActorRolloutRefWorker(CheckedActorRolloutRefWorker):
    """verl's hybrid actor/rollout/ref worker plus the ``compute_sketches``, ``compute_log_prob_and_sketches`` and
    ``step_lr_scheduler`` RPCs (docs/algorithm.md#5-sketches)."""

    def _sketch_engine(self):
        if self.actor is None:
            raise RuntimeError("compute_sketches needs the actor role (role must contain 'actor')")
        return self.actor.engine

    def _sketch_defaults(self) -> dict[str, Any]:
        """verl's ``TrainingWorker.infer_batch`` micro-batching defaults, so sketches use the same micro-batches."""
        return dict(
            use_remove_padding=self.actor.model_config.get("use_remove_padding", False),
            use_dynamic_bsz=self.actor.engine_config.use_dynamic_bsz,
            max_token_len_per_gpu=self.actor.engine_config.infer_max_token_len_per_gpu,
            micro_batch_size_per_gpu=self.actor.engine_config.infer_micro_batch_size_per_gpu,
            use_fused_kernels=self.actor.engine_config.use_fused_kernels,
        )

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_sketches(self, data: TensorDict) -> Optional[TensorDict]:
        """Per-response gradient sketches of this rank's shard.

        Args:
            data: TensorDict shard (verl layout) with non-tensor ``setgrpo_sketch_config`` (dict of
                :class:`setgrpo_verl.sketch.SketchConfig` fields) and optionally ``temperature``.

        Returns:
            TensorDict ``{setgrpo_sketch: float32 [B_shard, m]}`` on ranks that output data (None elsewhere).

        Raises:
            NotImplementedError: Ulysses sequence parallelism > 1.
            ValueError: see :func:`sketch_batch`.
        """
        sketches, _, _ = self._sketch(data)
        if not self._sketch_engine().is_mp_src_rank_with_outputs():
            return None
        return TensorDict({SKETCH_KEY: sketches}, batch_size=[sketches.shape[0]])

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob_and_sketches(self, data: TensorDict) -> Optional[TensorDict]:
        """The fused pass: sketches and verl's ``old_log_probs`` from ONE forward (+ one activation-only backward).

        Replaces ``compute_log_prob`` + ``compute_sketches`` when ``algorithm.setgrpo.sketch.fuse_old_log_prob``
        is true; with verl's ``calculate_entropy`` in the batch also the entropy verl's own pass reports.

        Returns:
            TensorDict ``{setgrpo_sketch: float32 [B_shard, m], old_log_probs: nested [B_shard, j]}`` plus
            ``entropy`` (nested [B_shard, j]) when asked for, on ranks that output data (None elsewhere).
        """
        sketches, log_probs, entropy = self._sketch(data)
        if not self._sketch_engine().is_mp_src_rank_with_outputs():
            return None
        fields = {SKETCH_KEY: sketches, "old_log_probs": log_probs}
        if entropy is not None:
            fields["entropy"] = entropy
        return TensorDict(fields, batch_size=[sketches.shape[0]])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def step_lr_scheduler(self) -> float:
        """Advance the actor's learning-rate scheduler by one step without an optimizer step: what verl's
        ``update_actor`` does after its last mini-batch, for a training step that updates nothing (every group
        rejected), so that warmup and decay stay on the step count (docs/verl_integration.md#trainer-mode).

        Returns:
            The learning rate of the first parameter group after the step (what verl logs as ``actor/lr``).
        """
        if self.actor is None:
            raise RuntimeError("step_lr_scheduler needs the actor role (role must contain 'actor')")
        return float(self.actor.engine.lr_scheduler_step())

    def _sketch(self, data: TensorDict) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        engine = self._sketch_engine()
        if getattr(engine, "ulysses_sequence_parallel_size", 1) > 1:
            raise NotImplementedError(
                "SetGRPO sketches need whole sequences on each rank: set "
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1"
            )
        for key, value in self._sketch_defaults().items():
            if key not in data.keys():
                tu.assign_non_tensor(data, **{key: value})
        config = SketchConfig(**dict(tu.get_non_tensor_data(data, SKETCH_CONFIG_KEY, {})))
        with engine.eval_mode():
            return sketch_and_log_probs(engine, data, config, loss_agg_mode=self.config.actor.loss_agg_mode)
