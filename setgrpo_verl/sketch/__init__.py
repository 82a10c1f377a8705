"""Per-response gradient sketches: the worker-side geometry of SetGRPO (docs/algorithm.md#5-sketches,
design and measurements: docs/sketch.md).

For every response i of a micro-batch we estimate its response-level gradient

    g_i = d/dtheta  sum_t w_it log pi(o_it | x_i, o_i,<t)

(docs/algorithm.md#0-notation; w follows verl's ``loss_agg_mode``) through a Kronecker-projected sketch.
For an ``nn.Linear`` block W (out x in) the per-response gradient is sum_t delta_t x_t^T over all
positions t of the response's sequence (prompt positions included), with delta_t the gradient of
the objective w.r.t. the layer output and x_t its input.  The sketch of that block is

    S_i[block, c] = sum_t (P_out^c delta_t)(P_in^c x_t)^T / sqrt(k)   (r_out x r_in),  c = 1..k

with P_out^c (r_out x out), P_in^c (r_in x in) of i.i.d. N(0, 1/r) entries, so that
E<S_i, S_j> = <g_i, g_j> exactly (unbiased Gram matrix, docs/algorithm.md#5-sketches).  k = 1 is the single
Kronecker projection of docs/algorithm.md#5-sketches; k > 1 concatenates k independent Kronecker sketches of
the block (``SketchConfig.copies``), which lowers the variance as 1/k.  This matters in practice:
transformer activations are strongly anisotropic, so the error of one Kronecker sketch falls only
like 1/sqrt(r) in its size r_out * r_in, whereas k independent copies average it out (measured on
SmolLM2-135M: docs/sketch.md#measured-accuracy).  A bias is handled as an extra input column equal to 1
(P_in then has in + 1 columns).

Mechanics: ONE forward of the whole micro-batch with forward hooks that store P_in x per Linear
call and register a tensor hook on the call's output, then ONE ``torch.autograd.grad`` of the
objective w.r.t. the input-embedding output.  Autograd only runs the nodes on the path to that
tensor, so no parameter gradient is computed (``.grad`` stays None, FSDP/FSDP2 gradient state is
not touched); the tensor hooks receive delta and accumulate the sketch per response.  Per hooked call
one [tokens, k r_in] matrix is kept, in the projection's dtype: on CUDA the layer's own bfloat16 / float16 (products
with float32 accumulation), else float32 (docs/sketch.md#precision); layers called in a row on one input (q/k/v,
gate/up) share one product; the LM head builds only the rows that score a response token where the forward takes
``logits_to_keep`` (docs/sketch.md#mechanics; memory: docs/sketch.md#memory).

Public API: :class:`SketchConfig`, :class:`GradientSketcher` (context manager over any module),
:func:`compute_sketches` (one call in verl's batch layout, padded or remove-padding/packed),
:class:`SketchOutput`, :func:`sketch_coverage` / :class:`SketchCoverage` (which trainable parameters are
sketched: the text model's trainable nn.Linear layers, docs/sketch.md#what-is-sketched).

Modules, one job each: ``config`` (settings, token weights), ``coverage`` (parameter selection and coverage),
``projections`` (blocks and their random projections), ``chunks`` (the projections' precision, row chunks), ``hooks``
(:class:`GradientSketcher`), ``layouts`` (the padded and packed passes, :func:`compute_sketches`), ``fsdp`` (FSDP1
resharding and activation checkpointing in the sketch pass).
"""

from setgrpo_verl.sketch.config import LOSS_AGG_MODES, SketchConfig, token_weights
from setgrpo_verl.sketch.coverage import PER_CHANNEL_MAX_KERNEL, SketchCoverage, sketch_coverage
from setgrpo_verl.sketch.fsdp import activation_checkpointing, fsdp1_reshard_in_backward, raise_on_every_rank
from setgrpo_verl.sketch.hooks import GradientSketcher
from setgrpo_verl.sketch.layouts import (
    SketchOutput,
    compute_sketches,
    forward_takes,
    packed_linear_attention_error,
    packed_needs_cu_seqlens,
)

__all__ = [
    "SketchConfig",
    "SketchOutput",
    "SketchCoverage",
    "GradientSketcher",
    "compute_sketches",
    "forward_takes",
    "sketch_coverage",
    "token_weights",
    "activation_checkpointing",
    "packed_needs_cu_seqlens",
    "packed_linear_attention_error",
    "fsdp1_reshard_in_backward",
    "raise_on_every_rank",
    "LOSS_AGG_MODES",
    "PER_CHANNEL_MAX_KERNEL",
]
