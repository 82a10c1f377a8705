"""verl's FSDP language-model engine for the CPU backend: verl 0.9.1's ``FSDPEngineWithLMHead`` whose padded
log-prob and entropy step runs in row chunks (docs/verl_integration.md#cpu-backend).

A CPU run keeps its sequences padded (``use_remove_padding=false``: no varlen attention kernel on the CPU). There,
verl's ``prepare_model_outputs`` takes the entropy of the whole padded logits tensor ``[b, S, V]`` at once, copies
the valid positions into one packed tensor and takes the log-softmax of it one position at a time; on a 49,152-token
vocabulary each of those whole-tensor passes writes hundreds of megabytes, and the copies and per-position loops
come back in the backward. :class:`CPUEngineWithLMHead` computes the same numbers with the same operations, chunk by
chunk of the valid positions (:func:`padded_log_probs`): verl's CPU log-softmax arithmetic on a chunk at once and
``entropy_from_logits`` on each chunk of the (temperature-scaled) logits, and in the backward the gradient of each
chunk recomputed and written into the logits' gradient, zero at the padding as verl's copies leave it. Every other
case (packed sequences, fused kernels, entropy with a gradient, distillation, sum of squared probabilities) is
verl's own code.

Copied from verl 0.9.1: the padded branch's arithmetic of ``prepare_model_outputs``, ``_scale_logits_by_temperature``
and ``logprobs_from_logits_v2``. tests/integration/test_cpu_engine.py fingerprints the originals and checks the
values and gradients against them.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.torch_functional import entropy_from_logits, entropy_from_logits_with_chunking
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

__all__ = ["CHUNK_ROWS", "CPUEngineWithLMHead", "padded_log_probs", "takes_chunked_outputs"]

#: Positions per chunk of the log-softmax: a bf16 chunk of a 49,152-token vocabulary is 6 MiB.
CHUNK_ROWS = 64


def _chunks(lengths: list[int], rows: int) -> list[tuple[int, int, int]]:
    """``(sequence, start, end)`` slices of every sequence's first ``lengths[i]`` positions, at most ``rows`` each."""
    return [(i, start, min(start + rows, n)) for i, n in enumerate(lengths) for start in range(0, n, rows)]


def _scaled(logits: torch.Tensor, temperature: Optional[torch.Tensor]) -> torch.Tensor:
    """verl's ``_scale_logits_by_temperature`` on one sequence's chunk: ``temperature`` a one-element tensor, or None
    for temperature 1 (no scaling)."""
    if temperature is None:
        return logits
    return logits / temperature.clamp(min=1e-8).to(logits.dtype)


def _chunk_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """verl's ``logprobs_from_logits_v2`` (the CPU's ``logprobs_from_logits``) on ``[n, V]`` logits at once instead of
    one row at a time: float32/float64 ``logits[label] - logsumexp``, other dtypes the label's entry of the
    log-softmax in that dtype. Row by row the same kernels: bit-equal in bf16, within float rounding in float32 (a
    multi-threaded reduction over one row adds in another order)."""
    if logits.dtype in (torch.float32, torch.float64):
        return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


class _PaddedLogProbs(torch.autograd.Function):
    """Log-probs (with their gradient) and, without a gradient, entropies of the valid positions of padded logits."""

    @staticmethod
    def forward(ctx, logits, labels, lengths, temperature, entropy_fn, rows):
        chunks = _chunks(lengths, rows)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        log_probs, entropies = [], []
        for i, a, b in chunks:
            t = None if temperature is None else temperature[i: i + 1].unsqueeze(-1)
            x = _scaled(logits[i, a:b], t)
            log_probs.append(_chunk_log_probs(x, labels[starts[i] + a: starts[i] + b]))
            if entropy_fn is not None:
                entropies.append(entropy_fn(x))
        ctx.save_for_backward(logits, labels, temperature)
        ctx.chunks, ctx.starts, ctx.lengths = chunks, starts, lengths
        ctx.has_temperature = temperature is not None
        out = torch.cat(log_probs) if log_probs else logits.new_zeros(0)
        entropy = torch.cat(entropies) if entropies else None
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad, _grad_entropy):
        logits, labels, temperature = ctx.saved_tensors
        starts = ctx.starts
        grad_logits = torch.empty_like(logits)
        for i, n in enumerate(ctx.lengths):
            grad_logits[i, n:] = 0  # the padding, as verl's copy of the valid positions leaves it
        for i, a, b in ctx.chunks:
            t = temperature[i: i + 1].unsqueeze(-1) if ctx.has_temperature else None
            with torch.enable_grad():
                x = logits[i, a:b].detach().requires_grad_(True)
                values = _chunk_log_probs(_scaled(x, t), labels[starts[i] + a: starts[i] + b])
                (chunk_grad,) = torch.autograd.grad(values, x, grad[starts[i] + a: starts[i] + b])
            grad_logits[i, a:b] = chunk_grad
        return grad_logits, None, None, None, None, None


def padded_log_probs(logits: torch.Tensor, labels: torch.Tensor, lengths: list[int],
                     temperature: Optional[torch.Tensor] = None, *,
                     entropy: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                     rows: int = CHUNK_ROWS) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of the next tokens at every valid position of right-padded logits, and their entropies, as verl
    0.9.1's padded ``prepare_model_outputs`` computes them, in chunks of ``rows`` positions.

    Args:
        logits: ``[b, S, V]`` right-padded logits (any float dtype; the values keep it, as verl's do).
        labels: int64 ``[sum(lengths)]`` next token of every valid position, sequences concatenated (verl's
            ``input_ids_rmpad_rolled``).
        lengths: the ``b`` sequences' valid positions, each in ``[0, S]``.
        temperature: float ``[b]`` per-sequence temperature, or None for temperature 1 (verl's
            ``temperature_is_one``: no scaling).
        entropy: None, or the entropy (nats) of ``[n, V]`` logits per row (verl's ``entropy_from_logits`` or
            ``entropy_from_logits_with_chunking``), taken of every chunk and returned without a gradient.
        rows: positions per chunk, >= 1.

    Returns:
        ``(log_probs, entropy)``: ``[sum(lengths)]`` in ``logits``' dtype (differentiable in ``logits``; the padding's
        gradient is zero) and ``[sum(lengths)]`` in ``entropy``'s dtype, or None.

    Raises:
        ValueError: shapes that do not match, a length outside ``[0, S]`` or ``rows < 1``.
    """
    if logits.dim() != 3 or len(lengths) != logits.shape[0]:
        raise ValueError(f"logits must be [b, S, V] with one length per row; got {tuple(logits.shape)} and "
                         f"{len(lengths)} lengths")
    if any(n < 0 or n > logits.shape[1] for n in lengths) or rows < 1:
        raise ValueError(f"lengths must lie in [0, {logits.shape[1]}] and rows >= 1; got {lengths}, rows={rows}")
    if labels.shape != (sum(lengths),):
        raise ValueError(f"labels must be [{sum(lengths)}] (one per valid position); got {tuple(labels.shape)}")
    if temperature is not None and temperature.shape != (logits.shape[0],):
        raise ValueError(f"temperature must be [{logits.shape[0]}]; got {tuple(temperature.shape)}")
    return _PaddedLogProbs.apply(logits, labels, [int(n) for n in lengths], temperature, entropy, rows)


def takes_chunked_outputs(micro_batch: TensorDict, *, entropy_checkpointing: bool = False) -> bool:
    """Whether :class:`CPUEngineWithLMHead` computes this micro-batch's outputs in chunks: padded sequences without
    fused kernels, distillation or the sum of squared probabilities, and no entropy that needs a gradient (verl's own
    code does those)."""
    get = lambda key, default: tu.get_non_tensor_data(data=micro_batch, key=key, default=default)  # noqa: E731
    entropy = get("calculate_entropy", False)
    return (not get("use_remove_padding", True) and not get("use_fused_kernels", False)
            and get("pad_mode", DatasetPadMode.NO_PADDING) == DatasetPadMode.NO_PADDING
            and not get("distillation_use_topk", False) and not get("distillation_only", False)
            and not get("calculate_sum_pi_squared", False)
            and not (entropy and (torch.is_grad_enabled() or entropy_checkpointing)))


class CPUEngineWithLMHead(FSDPEngineWithLMHead):
    """verl's ``FSDPEngineWithLMHead`` with the padded log-probs and entropies of :func:`padded_log_probs` (the same
    values; docs/verl_integration.md#cpu-backend). Registered for the device ``cpu`` by
    :func:`setgrpo_verl.verl_cpu.activate`."""

    def _entropy_function(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """verl's entropy of the engine's settings: ``entropy_from_logits`` (in the logits' dtype, what verl's padded
        branch always takes), or with ``entropy_from_logits_with_chunking`` its float32 variant, which verl honours in
        the packed layout only."""
        config = getattr(self, "engine_config", None)
        if getattr(config, "entropy_from_logits_with_chunking", False):
            return partial(entropy_from_logits_with_chunking, chunk_size=config.entropy_from_logits_chunk_size)
        return entropy_from_logits

    def prepare_model_outputs(self, output, output_args, micro_batch: TensorDict, logits_processor_func):
        checkpointing = bool(getattr(getattr(self, "engine_config", None), "entropy_checkpointing", False))
        if not takes_chunked_outputs(micro_batch, entropy_checkpointing=checkpointing):
            return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        cu_seqlens = micro_batch["input_ids"].offsets()
        temperature = None if output_args.get("temperature_is_one", False) else output_args["temperature"]
        calculate_entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
        log_probs, entropy = padded_log_probs(output.logits, output_args["input_ids_rmpad_rolled"],
                                              cu_seqlens.diff().tolist(), temperature,
                                              entropy=self._entropy_function() if calculate_entropy else None)
        model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, cu_seqlens)}
        if calculate_entropy:
            model_output["entropy"] = torch.nested.nested_tensor_from_jagged(entropy, cu_seqlens)
        return model_output
