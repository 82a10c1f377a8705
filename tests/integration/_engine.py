"""verl's own ``FSDPEngineWithLMHead`` without its FSDP/optimizer setup, for the worker's sketch path on CPU.

verl registers its FSDP engines for cuda/npu only and builds the model, FSDP wrapping and optimizer in
``initialize``; the sketch RPC needs only the engine's model inputs/outputs (``prepare_model_inputs`` /
``prepare_model_outputs``, verl's code, untouched here), its autocast dtype and its data-parallel group.
"""

from __future__ import annotations

import contextlib
from inspect import signature

import torch
from tensordict import TensorDict

from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead


def use_cpu_platform():
    """Make verl's platform singleton the CPU backend's (what ``VERL_PLATFORM=cpu`` selects in a real CPU run), so
    ``verl.utils.device.get_device_id()`` answers ``"cpu"`` in this process; returns the previous platform."""
    from verl.plugin.platform import platform_manager

    from setgrpo_verl.verl_cpu.platform import PlatformCPU

    previous = platform_manager._current_platform
    platform_manager._current_platform = PlatformCPU()
    return previous


@contextlib.contextmanager
def cpu_platform():
    """:func:`use_cpu_platform` for the duration of the block."""
    from verl.plugin.platform import platform_manager

    previous = use_cpu_platform()
    try:
        yield
    finally:
        platform_manager._current_platform = previous


class BareEngine(FSDPEngineWithLMHead):
    """An ``FSDPEngineWithLMHead`` around a plain module; ``pass_packed_cu_seqlens`` follows verl's rule
    (``"cu_seqlens" in signature(module.forward).parameters``, from ``_build_model_optimizer``)."""

    def __init__(self, module: torch.nn.Module, *, autocast_dtype: torch.dtype = torch.float32,
                 pass_packed_cu_seqlens: bool | None = None, pad_to_length_bucket: int = 0):
        self.module = module
        self.pad_to_length = pad_to_length_bucket > 0
        self.pad_to_length_bucket = pad_to_length_bucket
        self.ulysses_sequence_parallel_size = 1
        self.use_ulysses_sp = False
        self._autocast_dtype = autocast_dtype
        if pass_packed_cu_seqlens is None:
            pass_packed_cu_seqlens = "cu_seqlens" in signature(module.forward).parameters
        self.pass_packed_cu_seqlens = pass_packed_cu_seqlens

    def eval_mode(self, **kwargs):
        self.module.eval()
        return contextlib.nullcontext()

    def get_data_parallel_group(self):
        return None

    def is_mp_src_rank_with_outputs(self):
        return True


def verl_log_probs(engine: BareEngine, data: TensorDict) -> torch.Tensor:
    """verl's own ``compute_log_prob`` values: ``forward_step`` without a loss under no_grad, per sequence (one
    micro-batch of all rows), sliced to the responses as the v1 trainer does (nested [B, j])."""
    from verl.workers.utils.padding import response_from_nested

    with torch.no_grad():
        _, out = engine.forward_step(data, loss_function=None, forward_only=True)
    return response_from_nested(out["model_output"]["log_probs"], data["response_mask"])


def padded_layout(td: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Nested prompts/responses/response_mask -> (input_ids [B, P+R] left-padded prompt + right-padded response,
    attention_mask, response_mask), the layout of :func:`setgrpo_verl.sketch.compute_sketches`."""
    prompts, responses, rmask = td["prompts"].unbind(), td["responses"].unbind(), td["response_mask"].unbind()
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


def nested_batch(prompts: list[torch.Tensor], responses: list[torch.Tensor], masks: list[torch.Tensor]) -> TensorDict:
    """verl v1's no-padding layout (as the agent loop writes it to TransferQueue): nested prompts, responses,
    response_mask, input_ids, position_ids (0..len-1 per sequence), attention_mask."""
    nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    return TensorDict({"prompts": nested(prompts), "responses": nested(responses), "response_mask": nested(masks),
                       "input_ids": nested(ids), "position_ids": nested([torch.arange(i.numel()) for i in ids]),
                       "attention_mask": nested([torch.ones_like(i) for i in ids])},
                      batch_size=[len(ids)])
