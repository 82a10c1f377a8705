"""Actor worker with the per-response gradient-sketch RPC (docs/algorithm.md#5-sketches).

:class:`SetGRPOActorRolloutRefWorker` is verl 0.9.1's ``engine_workers.ActorRolloutRefWorker`` plus one RPC,
``compute_sketches``, registered with the same dispatch as ``compute_log_prob``
(``make_nd_compute_dataproto_dispatch_fn(mesh_name="actor")``): the driver passes the batch (a TransferQueue
``KVBatchMeta`` in verl's v1 trainer, or a ``TensorDict``), every data-parallel rank sketches its shard with
the engine's own micro-batching (``verl.workers.engine.utils.prepare_micro_batches``, dynamic batch size
included) and remove-padding setting, and the driver receives float32 ``[B, m]`` sketches in batch order
under the key :data:`SKETCH_KEY`.

The sketch pass is one forward plus one activation-only backward per micro-batch (``setgrpo_verl.sketch``),
under the engine's eval mode and forward autocast. By default it runs after verl's own old-log-prob pass;
``compute_log_prob_and_sketches`` is the fused variant (``algorithm.setgrpo.sketch.fuse_old_log_prob=true``) that
also returns verl's ``old_log_probs`` from the same forward, so the only extra cost over plain GRPO is the
activation-only backward. Ulysses sequence parallelism is not supported (the sketch hook needs whole sequences
per rank).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Optional

import torch
from tensordict import TensorDict

from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.utils.seqlen_balancing import restore_dynamic_batch
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.engine_workers import ActorRolloutRefWorker

from setgrpo_verl.sketch import SketchConfig, compute_sketches

logger = logging.getLogger(__name__)

#: Output field of the sketch RPC (float32 [B, m]); also the TransferQueue field name in the v1 trainer.
SKETCH_KEY = "setgrpo_sketch"
#: Non-tensor input field carrying ``dataclasses.asdict(SketchConfig)`` from the driver.
SKETCH_CONFIG_KEY = "setgrpo_sketch_config"


def _padded_layout(mb: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl batch -> ``(input_ids [B, P+R] left-padded prompt + right-padded response, attention_mask, response_mask)``.

    Accepts verl v1's nested (jagged, no padding) ``prompts`` / ``responses`` / ``response_mask`` and the
    legacy padded layout (``input_ids``, ``attention_mask``, ``responses``, ``response_mask`` as dense tensors).
    """
    for key in ("responses", "response_mask"):
        if key not in mb.keys():
            raise ValueError(f"the sketch RPC needs the batch field {key!r} (verl rollout output); got {list(mb.keys())}")
    if not mb["responses"].is_nested:
        if "input_ids" not in mb.keys() or "attention_mask" not in mb.keys():
            raise ValueError("padded batches need 'input_ids' and 'attention_mask' for the sketch RPC")
        return mb["input_ids"], mb["attention_mask"], mb["response_mask"]
    if "prompts" not in mb.keys():
        raise ValueError("nested (remove-padding) batches need the 'prompts' field for the sketch RPC")
    prompts, responses, rmask = mb["prompts"].unbind(), mb["responses"].unbind(), mb["response_mask"].unbind()
    bsz = len(prompts)
    p_len = max(int(p.numel()) for p in prompts)
    r_len = max(int(r.numel()) for r in responses)
    ids = torch.zeros(bsz, p_len + r_len, dtype=torch.long)
    am = torch.zeros(bsz, p_len + r_len, dtype=torch.long)
    rm = torch.zeros(bsz, r_len, dtype=torch.long)
    for i, (p, r, m) in enumerate(zip(prompts, responses, rmask, strict=True)):
        ids[i, p_len - p.numel() : p_len] = p
        ids[i, p_len : p_len + r.numel()] = r
        am[i, p_len - p.numel() : p_len + r.numel()] = 1
        rm[i, : m.numel()] = m
    return ids, am, rm


def sketch_batch(
    module: torch.nn.Module,
    data: TensorDict,
    config: SketchConfig,
    *,
    loss_agg_mode: str,
    dp_group: Any = None,
) -> torch.Tensor:
    """Sketch every response of a worker's shard, in the shard's order (docs/algorithm.md#5-sketches).

    Uses verl's ``prepare_micro_batches`` (fixed ``micro_batch_size_per_gpu`` or token-budget dynamic
    micro-batches with ``max_token_len_per_gpu``, the same number of micro-batches on every DP rank) and
    ``restore_dynamic_batch`` to return rows in input order.

    Args:
        module: the (FSDP-wrapped or plain) HF causal LM.
        data: the shard as a TensorDict (nested or padded layout, see :func:`_padded_layout`) with verl's
            non-tensor keys ``use_dynamic_bsz``, ``max_token_len_per_gpu`` / ``micro_batch_size_per_gpu``,
            ``use_remove_padding`` and ``temperature``.
        config: the sketch settings (identical on every rank).
        loss_agg_mode: the actor's ``loss_agg_mode`` (token weights of the response-level gradient).
        dp_group: the engine's data-parallel process group (None outside torch.distributed).

    Returns:
        float32 [B, m] sketches (CPU).

    Raises:
        ValueError: missing fields, or errors of ``setgrpo_verl.sketch.compute_sketches``.
    """
    return sketch_and_log_probs(module, data, config, loss_agg_mode=loss_agg_mode, dp_group=dp_group)[0]


def sketch_and_log_probs(
    module: torch.nn.Module,
    data: TensorDict,
    config: SketchConfig,
    *,
    loss_agg_mode: str,
    dp_group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sketch_batch` plus the response log-probs of the same forward (the fused old-log-prob pass).

    Returns:
        ``(sketches float32 [B, m], log_probs)`` with ``log_probs`` a jagged nested float32 tensor [B, j]: row i
        holds log pi(o_it) (after temperature) of the response tokens of row i (verl's ``old_log_probs`` layout).

    Raises:
        ValueError: as :func:`sketch_batch`.
        FloatingPointError: non-finite log-probabilities (from ``compute_sketches``).
    """
    micro_batches, indices = prepare_micro_batches(data=data, dp_group=dp_group, same_micro_num_in_dp=True)
    use_remove_padding = bool(tu.get_non_tensor_data(data, "use_remove_padding", False))
    temperature = tu.get_non_tensor_data(data, "temperature", 1.0)
    device = next(module.parameters()).device
    parts, rows = [], []
    for mb in micro_batches:
        ids, am, rm = _padded_layout(mb)
        out = compute_sketches(
            module,
            ids.to(device),
            am.to(device),
            rm.to(device),
            config,
            loss_agg_mode=loss_agg_mode,
            temperature=float(temperature),
            use_remove_padding=use_remove_padding,
        )
        parts.append(out.sketches.float().cpu())
        resp_len = am[:, -rm.shape[1] :].sum(-1).tolist()
        rows.extend(out.log_probs[i, :n].float().cpu() for i, n in enumerate(resp_len))
    sketches = torch.cat(parts)
    log_probs = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    if indices is not None:
        sketches = restore_dynamic_batch(sketches, indices)
        log_probs = restore_dynamic_batch(log_probs, indices)
    return sketches, log_probs


def _engine_autocast(engine: Any, module: torch.nn.Module):
    """The engine's forward autocast (FSDP engines: ``_autocast_dtype``, bf16 by default; none for float32), so the
    sketch forward runs with the same numerics and activation memory as verl's log-prob forward."""
    dtype = getattr(engine, "_autocast_dtype", None)
    if dtype is None or dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=next(module.parameters()).device.type, dtype=dtype)


class SetGRPOActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's hybrid actor/rollout/ref worker plus the ``compute_sketches`` and ``compute_log_prob_and_sketches``
    RPCs (docs/algorithm.md#5-sketches)."""

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
        sketches, _ = self._sketch(data)
        if not self._sketch_engine().is_mp_src_rank_with_outputs():
            return None
        return TensorDict({SKETCH_KEY: sketches}, batch_size=[sketches.shape[0]])

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob_and_sketches(self, data: TensorDict) -> Optional[TensorDict]:
        """The fused pass: sketches and verl's ``old_log_probs`` from ONE forward (+ one activation-only backward).

        Replaces ``compute_log_prob`` + ``compute_sketches`` when ``algorithm.setgrpo.sketch.fuse_old_log_prob``
        is true (no entropy is computed on this path).

        Returns:
            TensorDict ``{setgrpo_sketch: float32 [B_shard, m], old_log_probs: nested float32 [B_shard, j]}`` on
            ranks that output data (None elsewhere).
        """
        sketches, log_probs = self._sketch(data)
        if not self._sketch_engine().is_mp_src_rank_with_outputs():
            return None
        return TensorDict({SKETCH_KEY: sketches, "old_log_probs": log_probs}, batch_size=[sketches.shape[0]])

    def _sketch(self, data: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
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
        with engine.eval_mode(), _engine_autocast(engine, engine.module):
            return sketch_and_log_probs(
                engine.module,
                data,
                config,
                loss_agg_mode=self.config.actor.loss_agg_mode,
                dp_group=engine.get_data_parallel_group(),
            )
