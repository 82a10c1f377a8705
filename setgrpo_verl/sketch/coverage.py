"""Parameter selection and coverage of the sketch: which trainable parameters it sketches, which it leaves out by
design and which it must refuse (docs/sketch.md#what-is-sketched).  Works on a model built on the meta device."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from setgrpo_verl.sketch.config import SketchConfig
from setgrpo_verl.sketch.projections import Block

#: Wrapper prefixes that FSDP1 / activation checkpointing / torch.compile insert into module names; stripped so that
#: projection seeds depend on the model's own module names only.
_WRAPPER_PREFIXES = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")


def normalise_name(name: str) -> str:
    """A module or parameter name without the FSDP1 / checkpoint / torch.compile wrapper prefixes."""
    return _WRAPPER_PREFIXES.sub("", name)


def is_norm(module: nn.Module) -> bool:
    """A leaf normalisation module (class name containing "Norm") with a 1-D ``weight``."""
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
class Selection:
    """What :class:`~setgrpo_verl.sketch.GradientSketcher` hooks, and the coverage of every trainable parameter."""

    blocks: list  # distinct blocks in module order (a separate input-embedding block last)
    linears: list  # (module, block) in module order; tied weights share one block
    norms: list  # (module, block, trainable 1-D parameter names)
    embedding: nn.Module
    embedding_block: "Block | None"
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


def select(model: nn.Module, cfg: SketchConfig, embedding: nn.Module) -> Selection:
    """The blocks to hook and the coverage of every trainable parameter (docs/sketch.md#what-is-sketched)."""
    head_getter = getattr(model, "get_output_embeddings", None)
    head = head_getter() if callable(head_getter) else None
    text = _text_modules(model, embedding, head)
    unhookable, forced = _not_sketchable(model)
    by_param, blocks, linears, norms, sketched, optional = _module_blocks(model, cfg, embedding, head, text,
                                                                          unhookable)
    emb_block = _embedding_block(model, cfg, embedding, by_param, blocks)
    coverage = _coverage(model, text, forced, sketched, optional)
    return Selection(blocks, linears, norms, embedding, emb_block, coverage)


def _module_blocks(model: nn.Module, cfg: SketchConfig, embedding: nn.Module, head: nn.Module | None,
                   text: set[int] | None, unhookable: set[int]) -> tuple[dict, list, list, list, set[int], set[int]]:
    """One walk over the text model's modules: the blocks of its trainable nn.Linear modules (one per weight, so tied
    weights share one) and, with ``include_norms``, of its norms. Returns the linear block of each weight id, the
    blocks, the (module, block) linears, the (module, block, names) norms, the sketched parameter ids and the ids an
    option would sketch (the embedding's, the norms')."""
    by_param: dict[int, Block] = {}
    blocks, linears, norms = [], [], []
    sketched: set[int] = set()
    optional: set[int] = set()  # trainable text parameters that an option would sketch
    for raw_name, module in model.named_modules():
        if text is not None and id(module) not in text:
            continue
        name = normalise_name(raw_name) or "<root>"
        if isinstance(module, nn.Linear) and id(module) not in unhookable:
            weight, bias = module.weight, module.bias
            train_w = bool(weight.requires_grad)
            train_b = bias is not None and bool(bias.requires_grad)
            if not (train_w or train_b):
                continue
            block = by_param.get(id(weight))
            if block is None:
                cols = (module.in_features if train_w else 0) + (1 if train_b else 0)
                block = Block(name, "linear", module.out_features, cols, is_head=module is head,
                               weight_cols=module.in_features if train_w else 0, bias=train_b)
                by_param[id(weight)] = block
                blocks.append(block)
            linears.append((module, block))
            sketched.update(id(p) for p in (weight, bias) if p is not None and p.requires_grad)
        elif module is embedding:
            if module.weight.requires_grad:
                (sketched if cfg.include_embeddings else optional).add(id(module.weight))
        elif is_norm(module):
            params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() == 1 and p.requires_grad]
            if not params:
                continue
            if not cfg.include_norms:
                optional.update(id(p) for _, p in params)
                continue
            block = Block(name, "norm", 1, sum(p.numel() for _, p in params))
            norms.append((module, block, [n for n, _ in params]))
            blocks.append(block)
            sketched.update(id(p) for _, p in params)
    return by_param, blocks, linears, norms, sketched, optional


def _embedding_block(model: nn.Module, cfg: SketchConfig, embedding: nn.Module, by_param: dict[int, Block],
                     blocks: list) -> Block | None:
    """The input embedding's block: the LM head's when they are tied, else a new one appended to ``blocks`` when
    ``include_embeddings`` sketches it; None when it is not sketched. Refuses an embedding whose gradient is no sum
    of per-token terms."""
    # tied to the LM head: one parameter, one block, so both of its uses are sketched whatever include_embeddings says
    # (the head's block alone would be only part of the tied parameter's gradient)
    tied = by_param.get(id(embedding.weight)) if embedding.weight.requires_grad else None
    if not ((cfg.include_embeddings and embedding.weight.requires_grad) or tied is not None):
        return None
    if embedding.scale_grad_by_freq or embedding.max_norm is not None:
        raise ValueError(
            "the input embedding uses scale_grad_by_freq/max_norm, whose gradient is not a sum of per-token "
            "terms; set include_embeddings=False"
            + (" and untie it from the LM head (tie_word_embeddings=false)" if tied is not None else "")
        )
    if tied is not None:
        return tied
    emb_block = Block(normalise_name(_module_name(model, embedding)), "embedding", embedding.num_embeddings,
                      embedding.embedding_dim)
    blocks.append(emb_block)
    return emb_block


def _coverage(model: nn.Module, text: set[int] | None, forced: set[int], sketched: set[int],
              optional: set[int]) -> SketchCoverage:
    """Each trainable parameter in one group: outside the text model, refused (``forced`` or unsupported),
    sketched, or left out (an option's or per-channel)."""
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
        groups[group].append(normalise_name(raw_name))
        if group in numel:
            numel[group] += p.numel()
    return SketchCoverage(
        **{k: tuple(v) for k, v in groups.items()}, sketched_numel=numel["sketched"], left_out_numel=numel["left_out"]
    )


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


def input_embedding(model: nn.Module) -> nn.Module:
    """``model.get_input_embeddings()``, else the model's only ``nn.Embedding``.

    Raises:
        ValueError: no ``get_input_embeddings`` and not exactly one ``nn.Embedding``.
    """
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
    return select(model, cfg, input_embedding(model)).coverage

