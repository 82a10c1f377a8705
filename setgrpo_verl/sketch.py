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
one [tokens, k r_in] float32 matrix is kept; model-dtype tensors are promoted to float32 in row chunks only
(docs/sketch.md#memory: checkpointing, FSDP1 resharding, measured peak).

Public API: :class:`SketchConfig`, :class:`GradientSketcher` (context manager over any module),
:func:`compute_sketches` (one call in verl's batch layout, padded or remove-padding/packed),
:class:`SketchOutput`, :func:`sketch_coverage` / :class:`SketchCoverage` (which trainable parameters are
sketched: the text model's trainable nn.Linear layers, docs/sketch.md#what-is-sketched).  No verl import: the
layouts follow verl 0.9.1 conventions (left-padded prompt + right-padded response,
``position_ids = clip(cumsum(attention_mask) - 1, 0)`` as in
``verl.utils.model.compute_position_id_with_mask``, packed tokens with ``attention_mask=None`` and
per-sequence restarting ``position_ids`` as in ``FSDPEngineWithLMHead.prepare_model_inputs``, plus ``cu_seqlens``
where the forward takes them).  The trainer's worker runs the engine's own input/output preparation
(``setgrpo_verl.integration.worker``); :func:`compute_sketches` is the same pass for a plain module.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import math
import re
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, _runtime_utils
from torch.utils.checkpoint import checkpoint

__all__ = [
    "SketchConfig",
    "SketchOutput",
    "SketchCoverage",
    "GradientSketcher",
    "compute_sketches",
    "sketch_coverage",
    "token_weights",
    "activation_checkpointing",
    "packed_needs_cu_seqlens",
    "fsdp1_reshard_in_backward",
    "LOSS_AGG_MODES",
]

#: verl 0.9.1 ``core_algos.agg_loss`` modes and whether each response's tokens are weighted
#: 1/|o_i| (True) or 1 (False); the global constant of each mode does not change the geometry.
LOSS_AGG_MODES = {
    "token-mean": False,
    "token-sum": False,
    "seq-mean-token-sum": False,
    "seq-mean-token-sum-norm": False,
    "seq-mean-token-mean": True,
}

# Wrapper prefixes that FSDP1 / activation checkpointing / torch.compile insert into module names;
# stripped so that projection seeds depend on the model's own module names only.
_WRAPPER_PREFIXES = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")

# Float32 working-set bound of one chunk when activations, gradients or logits of the model dtype are promoted
# to float32: no float32 copy of a whole [tokens, width] tensor (logits: [tokens, V]) is ever made.
_CHUNK_BYTES = 1 << 26


def _chunk_rows(width: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * max(1, width)))


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with autocast off, so the sketch's float32 arithmetic stays float32 inside the engine's bf16 autocast
    (the hooks run within the forward's and backward's autocast region)."""
    with torch.autocast(device_type=a.device.type, enabled=False):
        return a @ b


def _project_f32(x: torch.Tensor, weight_t: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``x[rows] @ weight_t`` ([n, width] x [width, r] -> [n, r]), promoting x chunk by chunk."""
    n = x.shape[0] if rows is None else rows.numel()
    if rows is None and x.dtype == torch.float32:
        return _matmul(x, weight_t)
    out = torch.empty(n, weight_t.shape[1], dtype=torch.float32, device=x.device)
    step = _chunk_rows(x.shape[1])
    for start in range(0, n, step):
        part = x[start : start + step] if rows is None else x[rows[start : start + step]]
        out[start : start + step] = _matmul(part.float(), weight_t)
    return out


def _nonzero_rows(x: torch.Tensor) -> torch.Tensor:
    """int64 indices of the rows of x [n, width] with a nonzero entry, without an [n, width] mask of x."""
    step = _chunk_rows(x.shape[1])
    parts = [x[s : s + step].ne(0).any(-1).nonzero().squeeze(1) + s for s in range(0, x.shape[0], step)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=x.device)


@dataclass(frozen=True)
class SketchConfig:
    """Settings of the per-response gradient sketch (docs/algorithm.md#5-sketches).

    Args:
        rank_out: r_out, rows of each copy's output projection P_out (int >= 1).
        rank_in: r_in, rows of each copy's input projection P_in (int >= 1).
        copies: k, independent Kronecker copies per block (int >= 1); a block contributes
            k * r_out * r_in floats and costs k * (r_out * out + r_in * in) flops per token.
        head_rank_out, head_rank_in, head_copies: the same three for the LM head
            (``model.get_output_embeddings()``), the block with the largest gradient share.
        seed: global seed; the projections of a block derive from (seed, block name) only, so they
            are identical on every rank and across runs and are never checkpointed.
        include_embeddings: also sketch the input-embedding weight's gradient (sum_t e_{id_t}
            g_t^T, rows of ``padding_idx`` excluded as torch does).  When the embedding is tied to
            the LM head (SmolLM2, Qwen-small, Llama-3.2-1B) both uses share one block and one pair of
            projections, so the sketch estimates the gradient of the tied parameter itself.
        include_norms: also sketch the 1-D parameters (weight, bias) of normalisation modules
            (class name containing "Norm": LayerNorm, RMSNorm variants), whose outputs must depend
            elementwise on them.  They use one dense N(0, 1/r) projection of
            r = rank_out * rank_in rows per module.
        identity: debug option: every projection is the identity, so a block's sketch IS the exact
            flattened per-response gradient (Linear: [out, in (+1 bias column)] row-major; norms:
            concatenated 1-D parameters).  Only for small models.

    Defaults: body blocks (r_out, r_in, k) = (1, 2, 64), LM head (1, 8, 256): 128 floats per body
    block and 2,048 for the head, i.e. 210 * 128 + 2,048 = 28,928 floats for SmolLM2-135M.  Measured max
    absolute cosine error on SmolLM2-135M-Instruct (32 sampled responses to 8 prompts, 10 seeds): 0.052
    (mean) / 0.061 (worst seed) within a prompt's 4 responses, 0.067 / 0.079 over all 32 x 32 pairs
    (table and reasons: docs/sketch.md#measured-accuracy; tests/sketch/test_smollm2.py checks <= 0.05 on
    4 fixed responses through the real hooks).  Cost: k * (r_out * out + r_in * in)
    multiply-adds per token and block, ~25-50% of a forward.
    ``include_embeddings = include_norms = False``: nn.Linear blocks (LM head included) hold the
    dense-gradient parameters of a decoder-only LM; embedding gradients are sparse in the rows and
    norm weights are < 0.1% of the parameters.  Turn them on to sketch the full parameter gradient.

    Raises:
        ValueError: a rank below 1 or a non-integer rank/seed.
    """

    rank_out: int = 1
    rank_in: int = 2
    seed: int = 0
    include_embeddings: bool = False
    include_norms: bool = False
    identity: bool = False
    copies: int = 64
    head_rank_out: int = 1
    head_rank_in: int = 8
    head_copies: int = 256

    def __post_init__(self):
        for field in ("rank_out", "rank_in", "seed", "copies", "head_rank_out", "head_rank_in", "head_copies"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"SketchConfig.{field} must be an int, got {value!r}")
        for field in ("rank_out", "rank_in", "copies", "head_rank_out", "head_rank_in", "head_copies"):
            if getattr(self, field) < 1:
                raise ValueError(f"SketchConfig ranks and copies must be >= 1, got {field}={getattr(self, field)}")

    def shape_for(self, is_head: bool) -> tuple[int, int, int]:
        """(r_out, r_in, k) of a block: the head triple for the LM head, the body triple otherwise."""
        if is_head:
            return self.head_rank_out, self.head_rank_in, self.head_copies
        return self.rank_out, self.rank_in, self.copies


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


@dataclass
class _Block:
    name: str
    kind: str  # "linear" | "embedding" | "norm"
    rows: int  # output rows of the parameter matrix (norm: 1)
    cols: int  # input columns (+1 for a trainable Linear bias; norm: total trainable 1-D parameter size)
    is_head: bool = False
    weight_cols: int = 0  # Linear: in_features when the weight is trainable, else 0
    bias: bool = False  # Linear: the bias is trainable (its column follows the weight's)
    offset: int = 0
    size: int = 0
    shape: tuple = (1, 1, 1)  # (r_out, r_in, k)
    p_out: torch.Tensor | None = None  # [k * r_out, rows] (linear/embedding) or [size, cols] (norm)
    p_in: torch.Tensor | None = None  # [k * r_in, cols]


def _normalise_name(name: str) -> str:
    return _WRAPPER_PREFIXES.sub("", name)


@functools.lru_cache(maxsize=4096)
def _projection(seed: int, key: str, rows: int, cols: int, variance: float) -> torch.Tensor:
    """i.i.d. N(0, variance) matrix [rows, cols] float32 from (seed, key); identical on every machine.

    Cached per process (read-only use), so repeated sketch passes do not regenerate them."""
    digest = hashlib.sha256(f"setgrpo-sketch/{seed}/{key}".encode()).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.randn(rows, cols, generator=gen, dtype=torch.float32) * math.sqrt(variance)


def _is_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        "Norm" in type(module).__name__
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and next(module.children(), None) is None
    )


#: A trainable parameter outside nn.Linear / embedding / norm modules is "per-channel" (left out like the norm
#: weights) when it is a 1-D vector (Gated DeltaNet's ``A_log``, ``dt_bias``) or a depthwise convolution kernel
#: [C, 1, k] with k <= this (its ``conv1d``).  Anything else (3-D MoE expert tensors, an MoE router's 2-D
#: ``nn.Parameter``) is refused.
PER_CHANNEL_MAX_KERNEL = 16

#: How many parameter names an error message lists.
_NAMES_SHOWN = 6


@dataclass(frozen=True)
class SketchCoverage:
    """Which trainable parameters of a model the sketch covers (docs/sketch.md#what-is-sketched).

    Every parameter with ``requires_grad`` falls in exactly one group (names as in ``named_parameters()``,
    wrapper prefixes of FSDP1 / activation checkpointing / torch.compile removed); frozen parameters (LoRA base
    weights, a frozen vision tower) are in none.

    Attributes:
        sketched: parameters whose per-response gradient the sketch estimates: trainable ``nn.Linear``
            weights and biases of the text model (LM head and LoRA adapters included), plus the input
            embedding and norm weights when ``include_embeddings`` / ``include_norms`` are on.
        left_out: trainable text-model parameters left out by design: the input embedding and norm weights when
            their option is off, and per-channel parameters (:data:`PER_CHANNEL_MAX_KERNEL`).
        outside_text: trainable parameters outside the text model (the vision tower of a vision-language model,
            whose gradient in a text-only update is zero: verl adds its dummy-image output with weight 0).
        refused: trainable text-model parameters the sketch cannot cover (e.g. 3-D MoE expert tensors).
        sketched_numel, left_out_numel: their element counts (``left_out_numel / (sketched_numel +
            left_out_numel)`` is the share of the trained parameters the Gram matrix does not see).
    """

    sketched: tuple[str, ...]
    left_out: tuple[str, ...]
    outside_text: tuple[str, ...]
    refused: tuple[str, ...]
    sketched_numel: int
    left_out_numel: int

    def check(self, what: str = "the model") -> None:
        """Refuse a model whose trained parameters the sketch cannot cover.

        Raises:
            ValueError: naming the refused parameters (first few and the count), or saying that nothing
                trainable is sketched.
        """
        if self.refused:
            shown = ", ".join(self.refused[:_NAMES_SHOWN])
            more = f" and {len(self.refused) - _NAMES_SHOWN} more" if len(self.refused) > _NAMES_SHOWN else ""
            raise ValueError(
                f"SetGRPO's gradient sketch cannot cover {len(self.refused)} trainable parameter(s) of {what}: "
                f"{shown}{more}. It sketches nn.Linear weights (and, by option, the input embedding and norm "
                "weights); parameters used outside nn.Linear (e.g. 3-D MoE expert tensors) would go unsketched, "
                "so the Gram matrix would not be the trained parameters'. Use a dense model, or train LoRA "
                "adapters on its nn.Linear layers only (actor_rollout_ref.model.lora_rank > 0 without "
                "target_parameters)"
            )
        if not self.sketched:
            raise ValueError(
                f"SetGRPO's gradient sketch found no trainable nn.Linear weight in the text model of {what}: "
                "nothing the update trains can be sketched (frozen model, or only parameters outside nn.Linear "
                "are trainable)"
            )


@dataclass
class _Selection:
    blocks: list  # distinct blocks in module order (a separate input-embedding block last)
    linears: list  # (module, block) in module order; tied weights share one block
    norms: list  # (module, block, trainable 1-D parameter names)
    embedding: nn.Module
    embedding_block: "_Block | None"
    coverage: SketchCoverage


def _text_modules(model: nn.Module, embedding: nn.Module, head: nn.Module | None) -> set[int] | None:
    """ids of the text model's modules: ``model.get_decoder()`` (HF: the language model of a vision-language
    model, the base model of a causal LM) plus the input and output embeddings; None (every module) for a
    model without ``get_decoder``."""
    getter = getattr(model, "get_decoder", None)
    if not callable(getter):
        return None
    decoder = getter()
    if not isinstance(decoder, nn.Module):
        raise ValueError(
            f"{type(model).__name__}.get_decoder() returned {type(decoder).__name__}, not a module: cannot tell "
            "its text model from other towers"
        )
    ids = {id(m) for m in decoder.modules()}
    for extra in (embedding, head):
        if extra is not None:
            ids.update(id(m) for m in extra.modules())
    return ids


def _is_per_channel(p: torch.Tensor) -> bool:
    return p.dim() <= 1 or (p.dim() == 3 and p.shape[1] == 1 and p.shape[2] <= PER_CHANNEL_MAX_KERNEL)


def _not_sketchable(model: nn.Module) -> tuple[set[int], set[int]]:
    """(ids of nn.Linear modules whose weight is used without calling them, ids of parameters that must be refused).

    peft's LoRA on parameters (``ParamWrapper``, ``target_parameters``, e.g. on 3-D MoE experts) holds its adapters
    as nn.Linear modules but only reads their weights; DoRA's magnitude modules also read lora_A / lora_B's weights
    outside their forward (the weight norm). Hooks would miss those gradients, so these are refused."""
    modules: set[int] = set()
    params: set[int] = set()
    for module in model.modules():
        kind = type(module).__name__
        if kind == "ParamWrapper":
            for part in (getattr(module, "lora_A", None), getattr(module, "lora_B", None)):
                if isinstance(part, nn.Module):
                    modules.update(id(m) for m in part.modules())
        elif kind.startswith("Dora") or kind.endswith("DoraLayer"):
            params.update(id(p) for p in module.parameters())
    return modules, params


def _select(model: nn.Module, cfg: SketchConfig, embedding: nn.Module) -> _Selection:
    """The blocks to hook and the coverage of every trainable parameter (docs/sketch.md#what-is-sketched)."""
    head_getter = getattr(model, "get_output_embeddings", None)
    head = head_getter() if callable(head_getter) else None
    text = _text_modules(model, embedding, head)
    unhookable, forced = _not_sketchable(model)
    by_param: dict[int, _Block] = {}
    blocks, linears, norms = [], [], []
    sketched: set[int] = set()
    optional: set[int] = set()  # trainable text parameters that an option would sketch
    for raw_name, module in model.named_modules():
        if text is not None and id(module) not in text:
            continue
        name = _normalise_name(raw_name) or "<root>"
        if isinstance(module, nn.Linear) and id(module) not in unhookable:
            weight, bias = module.weight, module.bias
            train_w = bool(weight.requires_grad)
            train_b = bias is not None and bool(bias.requires_grad)
            if not (train_w or train_b):
                continue
            block = by_param.get(id(weight))
            if block is None:
                cols = (module.in_features if train_w else 0) + (1 if train_b else 0)
                block = _Block(name, "linear", module.out_features, cols, is_head=module is head,
                               weight_cols=module.in_features if train_w else 0, bias=train_b)
                by_param[id(weight)] = block
                blocks.append(block)
            linears.append((module, block))
            sketched.update(id(p) for p in (weight, bias) if p is not None and p.requires_grad)
        elif module is embedding:
            if module.weight.requires_grad:
                (sketched if cfg.include_embeddings else optional).add(id(module.weight))
        elif _is_norm(module):
            params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() == 1 and p.requires_grad]
            if not params:
                continue
            if not cfg.include_norms:
                optional.update(id(p) for _, p in params)
                continue
            block = _Block(name, "norm", 1, sum(p.numel() for _, p in params))
            norms.append((module, block, [n for n, _ in params]))
            blocks.append(block)
            sketched.update(id(p) for _, p in params)
    emb_block = None
    if cfg.include_embeddings and embedding.weight.requires_grad:
        if embedding.scale_grad_by_freq or embedding.max_norm is not None:
            raise ValueError(
                f"include_embeddings: the input embedding uses scale_grad_by_freq/max_norm, whose gradient is not "
                "a sum of per-token terms; set include_embeddings=False"
            )
        emb_block = by_param.get(id(embedding.weight))  # tied to the LM head: one block, one parameter
        if emb_block is None:
            emb_block = _Block(_normalise_name(_module_name(model, embedding)), "embedding",
                               embedding.num_embeddings, embedding.embedding_dim)
            blocks.append(emb_block)
    groups: dict[str, list[str]] = {"sketched": [], "left_out": [], "outside_text": [], "refused": []}
    numel = {"sketched": 0, "left_out": 0}
    for raw_name, p, trainable, owner in _logical_parameters(model):
        if not trainable:
            continue
        if text is not None and id(owner) not in text:
            group = "outside_text"
        elif id(p) in forced:
            group = "refused"
        elif id(p) in sketched:
            group = "sketched"
        elif id(p) in optional or _is_per_channel(p):
            group = "left_out"
        else:
            group = "refused"
        groups[group].append(_normalise_name(raw_name))
        if group in numel:
            numel[group] += p.numel()
    coverage = SketchCoverage(
        **{k: tuple(v) for k, v in groups.items()}, sketched_numel=numel["sketched"], left_out_numel=numel["left_out"]
    )
    return _Selection(blocks, linears, norms, embedding, emb_block, coverage)


def _logical_parameters(model: nn.Module):
    """(name, tensor, trainable, owning module) of every parameter as the model defines it, each once.

    FSDP1 without ``use_orig_params`` replaces a wrapped module's parameters by one flat parameter and sets the
    original names as plain tensor views; those are listed through the flat parameter's ``_param_infos``
    (torch 2.x FSDP1 ``FlatParameter``), so names and coverage are the model's own under FSDP1 too."""
    seen: set[int] = set()
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            infos = getattr(p, "_param_infos", None)
            if infos is None:
                yield (f"{mname}.{pname}" if mname else pname), p, bool(p.requires_grad), module
                continue
            for info in infos:  # tied copies sit in _shared_param_infos and are the same parameter
                view = getattr(info.module, info.param_name)
                name = ".".join(x for x in (mname, info.module_name, info.param_name) if x)
                yield name.replace("_flat_param.", ""), view, bool(p.requires_grad), info.module


def _module_name(model: nn.Module, target: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    return "embedding"


def _input_embedding(model: nn.Module) -> nn.Module:
    getter = getattr(model, "get_input_embeddings", None)
    emb = getter() if callable(getter) else None
    if emb is None:
        embs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        if len(embs) != 1:
            raise ValueError(
                f"GradientSketcher needs the model's input embedding: the model has no "
                f"get_input_embeddings() and {len(embs)} nn.Embedding modules (need exactly 1)"
            )
        emb = embs[0]
    return emb


def sketch_coverage(model: nn.Module, config: SketchConfig | None = None) -> SketchCoverage:
    """Which trainable parameters of ``model`` the sketch covers, without hooking or running it
    (docs/sketch.md#what-is-sketched).  Works on a model built on the meta device (no weights needed).

    The text model is ``model.get_decoder()`` plus the input and output embeddings (the whole model when it has no
    ``get_decoder``); only its trainable parameters are sketched.  Call ``.check()`` on the result to refuse a model
    with parameters the sketch cannot cover.

    Args:
        model: an ``nn.Module`` (HF model, PEFT model, or FSDP-wrapped) with ``get_input_embeddings()`` or exactly
            one ``nn.Embedding``.
        config: :class:`SketchConfig` (defaults if None): ``include_embeddings`` / ``include_norms`` move those
            parameters from ``left_out`` to ``sketched``.

    Returns:
        :class:`SketchCoverage`.

    Raises:
        ValueError: no unique input embedding; ``get_decoder()`` not returning a module; ``include_embeddings``
            with an embedding that uses ``scale_grad_by_freq`` / ``max_norm``.
    """
    cfg = config if config is not None else SketchConfig()
    return _select(model, cfg, _input_embedding(model)).coverage


class GradientSketcher:
    """Context manager that sketches per-response gradients of ``model`` (docs/algorithm.md#5-sketches).

    Usage (one micro-batch; any Hugging Face causal LM, plain, FSDP or FSDP2)::

        with GradientSketcher(model, SketchConfig()) as sk:
            sk.begin(segment_ids)                 # [*token_shape] int64, response index or -1
            logits = model(input_ids=..., ...).logits
            objective = (weights * token_log_probs).sum()   # sum_i sum_t w_it log pi(o_it)
            sketches = sk.backward(objective)     # float32 [num_segments, m]

    ``segment_ids`` has the token shape of the model input ([B, T] padded or [1, nnz] packed) and
    gives, for every position, the response it belongs to (prompt positions too) or -1 for padding.
    Every hooked module's input must flatten to that many token rows (true for HF decoder LMs;
    not under sequence parallelism, where each rank would sketch its slice and the partial sketches
    of a response must be summed over the SP group by the caller).

    On enter, forward hooks are registered on the text model's ``nn.Linear`` layers whose weight or bias
    is trainable (plus the input embedding / norms by config; :func:`sketch_coverage` says which
    parameters: never a vision tower or a frozen weight, with LoRA the adapters) and on
    ``model.get_input_embeddings()``; on exit they are removed, also when an exception is raised.  Projections are built once per enter from (config.seed, module name) on CPU and moved
    to the activations' device; none is larger than r x max(out, in).

    Args:
        model: an ``nn.Module`` with ``get_input_embeddings()`` (HF convention) or exactly one
            ``nn.Embedding``.
        config: :class:`SketchConfig` (default settings if None).

    Raises (on enter):
        ValueError: a trainable text-model parameter the sketch cannot cover (e.g. 3-D MoE experts;
            :meth:`SketchCoverage.check`, naming them); no trainable ``nn.Linear`` layer; no unique input
            embedding; ``include_embeddings`` with an embedding that uses ``scale_grad_by_freq``/``max_norm``.
    """

    def __init__(self, model: nn.Module, config: SketchConfig | None = None):
        self.model = model
        self.config = config if config is not None else SketchConfig()
        self.blocks: list[_Block] = []
        self._handles: list = []
        self._phase = "idle"
        self._segments: torch.Tensor | None = None
        self._num_segments = 0
        self._onehot: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._emb_calls: list = []
        self._pending: dict[int, str] = {}
        self._in_jvp = False

    # ------------------------------------------------------------------ setup
    @property
    def dim(self) -> int:
        """m, the number of float32 entries of one response's sketch."""
        return sum(b.size for b in self.blocks)

    def __enter__(self) -> "GradientSketcher":
        try:
            sel = _select(self.model, self.config, _input_embedding(self.model))
            sel.coverage.check(type(self.model).__name__)
            self._emb_module = sel.embedding
            self._emb_block = sel.embedding_block
            self.blocks.extend(sel.blocks)
            self._layout_blocks()
            for module, block in sel.linears:
                self._handles.append(module.register_forward_hook(partial(self._linear_forward, block)))
            for module, block, pnames in sel.norms:
                self._handles.append(
                    module.register_forward_hook(partial(self._norm_forward, block, pnames), with_kwargs=True)
                )
            self._handles.append(self._emb_module.register_forward_hook(self._embedding_forward))
        except BaseException:
            self._remove_hooks()
            self.blocks.clear()
            raise
        return self

    def _layout_blocks(self):
        cfg = self.config
        offset = 0
        for b in self.blocks:
            if cfg.identity:
                b.size = b.rows * b.cols
            elif b.kind == "norm":
                r_out, r_in, k = cfg.shape_for(False)
                b.size = r_out * r_in * k
                b.p_out = _projection(cfg.seed, b.name + ":norm", b.size, b.cols, 1.0 / b.size)
            else:
                r_out, r_in, k = b.shape = cfg.shape_for(b.is_head)
                b.size = r_out * r_in * k
                b.p_out = _projection(cfg.seed, b.name + ":out", k * r_out, b.rows, 1.0 / (k * r_out))
                b.p_in = _projection(cfg.seed, b.name + ":in", k * r_in, b.cols, 1.0 / r_in)
            b.offset = offset
            offset += b.size

    def _remove_hooks(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __exit__(self, exc_type, exc, tb):
        self._remove_hooks()
        self._reset()
        for b in self.blocks:
            b.p_out = b.p_in = None
        self.blocks.clear()
        return False

    def _reset(self):
        self._phase = "idle"
        self._segments = self._onehot = self._out = None
        self._emb_calls = []
        self._pending = {}

    # ------------------------------------------------------------------ per micro-batch
    def begin(self, segment_ids: torch.Tensor, num_segments: int | None = None) -> None:
        """Start a micro-batch: call before the model forward.

        Args:
            segment_ids: int64 tensor with the model input's token shape ([B, T] or [1, nnz]);
                entry = index (0..num_segments-1) of the response the position belongs to, -1 for
                padding.
            num_segments: number of responses (default: max(segment_ids) + 1).

        Raises:
            RuntimeError: called outside the ``with`` block.
            ValueError: non-integer ids, ids below -1 or >= num_segments.
        """
        if not self._handles:
            raise RuntimeError("GradientSketcher.begin() must be called inside `with GradientSketcher(...)`")
        if segment_ids.dtype.is_floating_point or segment_ids.dtype == torch.bool:
            raise ValueError(f"segment_ids must be an integer tensor, got dtype {segment_ids.dtype}")
        seg = segment_ids.reshape(-1).long()
        n = int(seg.max().item()) + 1 if num_segments is None else int(num_segments)
        if seg.numel() and (int(seg.min().item()) < -1 or int(seg.max().item()) >= n):
            raise ValueError(f"segment_ids must lie in [-1, {n - 1}] (num_segments={n})")
        self._reset()
        self._segments = seg
        self._num_segments = n
        valid = seg >= 0
        onehot = torch.zeros(seg.numel(), n, dtype=torch.float32, device=seg.device)
        onehot[valid.nonzero().squeeze(1), seg[valid]] = 1.0
        self._onehot = onehot
        self._out = torch.zeros(n, self.dim, dtype=torch.float32, device=seg.device)
        self._phase = "forward"

    def backward(self, objective: torch.Tensor) -> torch.Tensor:
        """Run the single activation-only backward and return the micro-batch's sketches.

        Args:
            objective: scalar tensor sum_i sum_t w_it log pi(o_it) built from this micro-batch's
                forward (docs/algorithm.md#0-notation; response i's terms only from segment i's positions).

        Returns:
            float32 [num_segments, m] sketches, on the device of ``segment_ids``.

        Raises:
            RuntimeError: no forward since ``begin()``; the objective does not depend on the input
                embeddings; a hooked layer ran forward but got no output gradient (its output does
                not reach the objective through the embeddings).
            ValueError: objective is not a scalar.
        """
        if self._phase != "forward":
            raise RuntimeError("GradientSketcher.backward() needs begin() and one model forward first")
        if objective.dim() != 0:
            raise ValueError(f"objective must be a scalar, got shape {tuple(objective.shape)}")
        if not self._emb_calls:
            raise RuntimeError(
                "the input embedding did not run in the forward since begin(); pass input_ids, not inputs_embeds"
            )
        if not objective.requires_grad:
            raise RuntimeError("objective does not require grad: run the forward under torch.enable_grad()")
        self._phase = "backward"
        try:
            outputs = [out for _, out in self._emb_calls]
            grads = torch.autograd.grad(objective, outputs, allow_unused=True)
            if all(g is None for g in grads):
                raise RuntimeError("the objective does not depend on the input-embedding output")
            if self._pending:
                names = sorted(set(self._pending.values()))
                raise RuntimeError(
                    f"{len(names)} hooked layer(s) ran forward but received no output gradient, e.g. "
                    f"{names[:3]}: their outputs do not reach the objective through the input embeddings"
                )
            if self._emb_block is not None:
                for (ids, _), g in zip(self._emb_calls, grads):
                    if g is not None:
                        self._embedding_accumulate(ids, g)
            return self._out
        finally:
            out = self._out
            self._reset()
            self._out = out

    # ------------------------------------------------------------------ hooks
    def _rows(self, t: torch.Tensor, name: str) -> torch.Tensor:
        flat = t.reshape(-1, t.shape[-1])
        if flat.shape[0] != self._segments.numel():
            raise ValueError(
                f"layer {name!r} sees {flat.shape[0]} token rows but segment_ids has {self._segments.numel()} "
                "entries: segment_ids must have the model input's token shape ([B, T] or [1, nnz])"
            )
        return flat

    def _accumulate(self, block: _Block, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """out[s, block] += sum_{t in s} a_t (x) b_t, per copy: a [n, k*r_out], b [n, k*r_in] (token subset rows)."""
        n = a.shape[0]
        k = 1 if block.p_in is None else block.shape[2]
        outer = (a.reshape(n, k, -1, 1) * b.reshape(n, k, 1, -1)).reshape(n, -1)  # [n, size]
        onehot = self._onehot if rows is None else self._onehot[rows]
        self._out[:, block.offset : block.offset + block.size] += _matmul(onehot.T, outer)

    def _project_in(self, block: _Block, x: torch.Tensor) -> torch.Tensor:
        """P_in [x, 1] of the block's trainable input columns (x for a trainable weight, 1 for a trainable bias)."""
        w = block.weight_cols
        if block.p_in is None:  # identity
            x = x.float()
            parts = ([x] if w else []) + ([x.new_ones(x.shape[0], 1)] if block.bias else [])
            return parts[0] if len(parts) == 1 else torch.cat(parts, 1)
        p_in = block.p_in = block.p_in.to(x.device)
        y = _project_f32(x, p_in[:, :w].T) if w else p_in.new_zeros(x.shape[0], p_in.shape[0])
        if block.bias:
            y = y + p_in[:, w]
        return y

    def _linear_forward(self, block: _Block, module: nn.Linear, args, output):
        if self._phase != "forward" or self._in_jvp:
            return None  # idle, or activation-checkpoint recomputation during backward
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            raise RuntimeError(
                f"layer {block.name!r}: output does not require grad during the sketch forward (forward under "
                "torch.no_grad(), or reentrant activation checkpointing: use use_reentrant=False as verl does)"
            )
        x = self._rows(args[0].detach(), block.name)
        b = self._project_in(block, x)
        key = id(b)
        self._pending[key] = block.name
        output.register_hook(partial(self._linear_backward, block, b, key))
        return None

    def _linear_backward(self, block: _Block, b: torch.Tensor, key: int, grad: torch.Tensor):
        if self._phase != "backward" or key not in self._pending:
            return None
        del self._pending[key]
        d = self._rows(grad.detach(), block.name)  # model dtype; promoted to float32 chunk by chunk
        rows = None
        if block.p_out is None:  # identity
            a = d.float()
        else:
            if block.is_head:
                # logits get a gradient only at loss positions: project those rows only (the costliest projection)
                rows = _nonzero_rows(d)
                b = b[rows]
            p_out = block.p_out = block.p_out.to(d.device)
            a = _project_f32(d, p_out.T, rows)
        self._accumulate(block, a, b, rows)
        return None

    def _embedding_forward(self, module, args, output):
        if self._phase != "forward" or self._in_jvp:
            return None
        if not output.requires_grad:
            output.requires_grad_(True)  # frozen embedding: make its output the backward's input
        self._emb_calls.append((args[0].detach(), output))
        return None

    def _embedding_accumulate(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        block = self._emb_block
        ids = ids.reshape(-1)
        g = self._rows(grad.detach(), "input embedding").float()
        if self._emb_module.padding_idx is not None:
            g = g * (ids != self._emb_module.padding_idx).unsqueeze(1).to(g.dtype)
        if block.p_out is None:
            a = torch.nn.functional.one_hot(ids, block.rows).float()
            b = torch.cat([g, g.new_zeros(g.shape[0], block.cols - g.shape[1])], 1)
        else:
            a = block.p_out.to(g.device)[:, ids].T
            b = _matmul(g, block.p_in.to(g.device)[:, : g.shape[1]].T)
        self._accumulate(block, a, b)

    def _token_groups(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """[N, m, width] view of a norm's input/output whose rows are m per token (m = 1, or the heads of a
        per-head norm such as Gated DeltaNet's, which sees [tokens * heads, head_dim])."""
        flat = t.reshape(-1, t.shape[-1])
        n = self._segments.numel()
        if flat.shape[0] % n:
            raise ValueError(
                f"norm {name!r} sees {flat.shape[0]} rows, not a multiple of the {n} token rows of segment_ids"
            )
        return flat.reshape(n, -1, t.shape[-1])

    def _norm_forward(self, block: _Block, pnames: list, module: nn.Module, args, kwargs, output):
        if self._phase != "forward" or self._in_jvp:
            return None
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            raise RuntimeError(f"norm {block.name!r}: output does not require grad during the sketch forward")
        frozen = {k: v.detach() for k, v in module.named_parameters(recurse=False)}
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        parts = []
        self._in_jvp = True
        try:
            with torch.no_grad():
                for pname in pnames:

                    def f(v, pname=pname):
                        return torch.func.functional_call(module, {**frozen, pname: v}, args, kwargs)

                    _, h = torch.func.jvp(f, (frozen[pname],), (torch.ones_like(frozen[pname]),))
                    if h.shape[-1] != frozen[pname].numel():
                        raise ValueError(
                            f"include_norms: {block.name!r} output width {h.shape[-1]} != parameter {pname!r} "
                            f"size {frozen[pname].numel()}; only elementwise-affine norms are supported"
                        )
                    parts.append(self._token_groups(h, block.name).float())
        finally:
            self._in_jvp = False
        key = id(parts[0])
        self._pending[key] = block.name
        output.register_hook(partial(self._norm_backward, block, parts, key))
        return None

    def _norm_backward(self, block: _Block, parts: list, key: int, grad: torch.Tensor):
        if self._phase != "backward" or key not in self._pending:
            return None
        del self._pending[key]
        d = self._token_groups(grad.detach(), block.name).float()
        per_token = torch.cat([(d * h).sum(1) for h in parts], 1)  # [N, cols]: per-token parameter gradient
        if block.p_out is not None:
            per_token = _matmul(per_token, block.p_out.to(d.device).T)
        ones = per_token.new_ones(per_token.shape[0], 1)
        self._accumulate(block, per_token, ones)
        return None


# ---------------------------------------------------------------------- one-call API
def token_weights(response_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Token weights w of the response-level objective sum_t w_it log pi(o_it) (docs/algorithm.md#0-notation).

    Args:
        response_mask: 0/1 [B, T_resp] (any dtype), 1 = token in the loss.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.

    Returns:
        float32 [B, T_resp]: the mask, divided per row by its token count for ``seq-mean-token-mean``.

    Raises:
        ValueError: unknown ``loss_agg_mode``.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; verl 0.9.1 modes: {sorted(LOSS_AGG_MODES)}")
    w = response_mask.float()
    if LOSS_AGG_MODES[loss_agg_mode]:
        w = w / w.sum(-1, keepdim=True).clamp(min=1.0)
    return w


def _unwrapped(model: nn.Module) -> nn.Module:
    while hasattr(model, "_fsdp_wrapped_module"):  # FSDP1 keeps the HF module one attribute down
        model = model._fsdp_wrapped_module
    return model


def _forward_takes(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(_unwrapped(model).forward).parameters
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
    config = getattr(_unwrapped(model), "config", None)
    if config is None:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or ()
    return any("linear" in str(t) for t in layer_types)


@contextlib.contextmanager
def activation_checkpointing(model: nn.Module):
    """Let the model's activation checkpointing act in the sketch pass, which runs in eval mode
    (docs/sketch.md#memory).

    transformers checkpoints a decoder layer only when the layer's own ``training`` flag is set
    (``GradientCheckpointingLayer``), and verl's sketch and log-prob passes run in eval mode.  Inside this
    context the ``training`` flag is set on exactly the layers with ``gradient_checkpointing`` enabled, not on
    their submodules, so dropout and every other eval-mode behaviour stay as they are while the layers'
    activations are recomputed in the backward (non-reentrant checkpointing, as verl enables it).  A no-op for a
    model without checkpointing.  The flags are restored on exit, also on an exception.

    Args:
        model: an HF model (plain, FSDP1 or FSDP2 wrapped).
    """
    switched = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True and not m.training]
    for m in switched:
        m.training = True
    try:
        yield
    finally:
        for m in switched:
            m.training = False


@contextlib.contextmanager
def fsdp1_reshard_in_backward(model: nn.Module):
    """Reshard every FSDP1 unit as soon as the activation-only sketch backward has passed it (docs/sketch.md#memory).

    FSDP1 (``FullyShardedDataParallel``) reshards a unit's parameters in a hook on their ``AccumulateGrad`` nodes,
    which the sketch backward (``torch.autograd.grad`` to the input-embedding output) never runs: every unit would
    stay unsharded from its pre-backward unshard until the end of the backward, i.e. the whole model unsharded at
    once.  Inside this context each FSDP1 unit whose forward inputs require grad gets, per forward, a multi-grad hook
    on those inputs that runs FSDP1's own reshard-only post-backward hook (the one FSDP1 uses for frozen parameters;
    ``torch.distributed.fsdp._runtime_utils._post_backward_reshard_only_hook``, torch 2.13, fingerprinted by
    tests/sketch/test_sketch.py).  FSDP2 needs nothing: it reshards from the gradient of the units' inputs.  A no-op
    for a model without FSDP1 units.

    Under ``NO_SHARD`` (FSDP1's strategy on one rank) with ``use_orig_params=True`` no reshard happens at all, so the
    original parameters would stay the plain-tensor views of the backward, and the next training forward fails an
    FSDP assertion on tied (shared) parameters.  On exit the context therefore puts those units' parameters back as
    ``nn.Parameter`` views (``FlatParamHandle._use_sharded_views``, what FSDP1's reshard does for ``NO_SHARD``).

    Args:
        model: the (possibly FSDP1-wrapped) model of the sketch pass.
    """
    def pre_forward(unit, args, kwargs):
        if not torch.is_grad_enabled() or unit._handle is None:
            return None
        inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
        if inputs:
            hook = partial(_runtime_utils._post_backward_reshard_only_hook, unit, unit._handle)
            torch.autograd.graph.register_multi_grad_hook(inputs, hook)
        return None

    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    handles = [u.register_forward_pre_hook(pre_forward, with_kwargs=True) for u in units]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for unit in units:
            handle = unit._handle
            if handle is not None and handle._use_orig_params and not handle.uses_sharded_strategy:
                handle._use_sharded_views()


def _scaled_by_temperature(logits: torch.Tensor, temperature) -> torch.Tensor:
    """logits / temperature in the logits' dtype (verl 0.9.1 ``_scale_logits_by_temperature``); temperature is a
    float or a float tensor broadcastable to logits."""
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
    step = _chunk_rows(logits.shape[-1])
    if logits.shape[0] <= step or not logits.requires_grad:
        return _chunk_log_probs(logits, targets)
    parts = [
        checkpoint(_chunk_log_probs, logits[s : s + step], targets[s : s + step], use_reentrant=False)
        for s in range(0, logits.shape[0], step)
    ]
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
        # logits row predicting response token (b, t): the packed row of (b, t - 1)
        k = inverse[(rows[:, None] * seqlen + resp_cols[None, :]).reshape(-1)].reshape(bsz, t_resp)
        logit_rows = (k - 1).clamp(min=0)
        targets = model_ids[0][k.clamp(min=0)]
        model_kwargs = dict(input_ids=model_ids, position_ids=model_pos, attention_mask=None)
        if _forward_takes(model, "cu_seqlens"):  # verl 0.9.1's rule (FSDPEngine.pass_packed_cu_seqlens)
            cu_seqlens = torch.nn.functional.pad(am.sum(-1).cumsum(0), (1, 0))
            model_kwargs.update(cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens.cpu())
        elif packed_needs_cu_seqlens(model):
            raise ValueError(
                f"use_remove_padding=True on {type(_unwrapped(model)).__name__}, a model with linear-attention layers "
                "whose forward takes no cu_seqlens: the packed sequences would run as one sequence through those "
                "layers. Use the padded layout (use_remove_padding=False) or a forward that takes cu_seqlens "
                "(verl's monkey patch of Qwen3_5ForConditionalGeneration)"
            )
    else:
        segments = torch.where(am.bool(), rows[:, None], torch.full_like(ids, -1))
        logit_rows = rows[:, None] * seqlen + resp_cols[None, :] - 1
        targets = ids[:, -t_resp:]
        model_kwargs = dict(input_ids=ids, position_ids=pos, attention_mask=am)
    sk.begin(segments, bsz)
    with torch.enable_grad():
        logits = model(**model_kwargs, use_cache=False).logits
        logits = logits.reshape(-1, logits.shape[-1])[logit_rows.reshape(-1)]  # [B * T_resp, V], model dtype
        temp = temperature if not isinstance(temperature, torch.Tensor) else temperature.reshape(-1, 1, 1)
        logits = _scaled_by_temperature(logits.reshape(bsz, t_resp, -1), temp).reshape(bsz * t_resp, -1)
        log_probs = _token_log_probs(logits, targets.reshape(-1)).reshape(bsz, t_resp)
        log_probs = torch.where(valid_resp, log_probs, torch.zeros_like(log_probs))
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
) -> SketchOutput:
    """Per-response gradient sketches and response log-probs in verl's batch layout (docs/algorithm.md#5-sketches).

    The objective of response i is sum_t w_it log pi(o_it) with w from ``loss_agg_mode``
    (docs/algorithm.md#0-notation: w = response_mask for token-mean / token-sum / seq-mean-token-sum /
    seq-mean-token-sum-norm, response_mask / |o_i| for seq-mean-token-mean); its gradient includes
    the prompt positions.  One forward and one activation-only backward per micro-batch; no
    parameter ``.grad`` is created.  The model's train/eval mode is left as it is.

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
    with GradientSketcher(model, config) as sk, fsdp1_reshard_in_backward(model):
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
