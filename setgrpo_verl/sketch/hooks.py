"""The sketch's hooks: forward hooks that keep P_in x per hooked call and tensor hooks that receive the output
gradient delta in the single activation-only backward and accumulate each response's sketch
(docs/algorithm.md#5-sketches, mechanics: docs/sketch.md#mechanics)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

try:  # public from torch 2.6 / 2.5; the private modules before (verl's fsdp_utils does the same)
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch < 2.6
    from torch.distributed._composable.fsdp import FSDPModule
try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch < 2.5
    from torch.distributed._tensor import DTensor

from setgrpo_verl.sketch.chunks import chunk_rows, compute_dtype, matmul_f32, project
from setgrpo_verl.sketch.config import SketchConfig
from setgrpo_verl.sketch.coverage import input_embedding, select
from setgrpo_verl.sketch.projections import Block, layout_blocks, on_device


class _LossRowsLinear(torch.autograd.Function):
    """The output of a plain ``nn.Linear`` (the values of its own forward, unchanged) whose backward multiplies the
    given rows of the output gradient only: every other row is zero (the LM head's rows that score no response token),
    so the [tokens, out] x [out, in] product of the input gradient shrinks to those rows. Input gradient only: the
    weight enters detached (the sketch backward computes no parameter gradient).

    Inputs: ``x`` [..., in] the head's input (any float dtype, with grad), ``weight`` [out, in] detached, ``value``
    [..., out] the head's own output, ``rows`` int64 [n] flattened rows of ``x`` on its device. Returns a view of
    ``value``; the backward gives ``x`` the gradient [..., in] in x's dtype, zero off ``rows``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, value: torch.Tensor, rows: torch.Tensor):
        ctx.save_for_backward(weight, rows)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight, rows = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])[rows]
        gx = g.new_zeros(grad.numel() // grad.shape[-1], ctx.x_shape[-1], dtype=ctx.x_dtype)
        with torch.autocast(device_type=g.device.type, enabled=False):  # the dtype autocast gave the forward
            gx[rows] = (g @ weight.to(g.dtype)).to(ctx.x_dtype)
        return gx.reshape(ctx.x_shape), None, None, None


class _Slot:
    """The input projection P_in [x, 1] of one hooked call, filled in the forward (at once, or when the group of calls
    that share its input is complete) and read by the call's tensor hook in the backward."""

    __slots__ = ("value",)

    def __init__(self):
        self.value: torch.Tensor | None = None


def _plain_linear(module: nn.Module) -> bool:
    """``module`` computes x W^T + b with ``nn.Linear``'s own forward on a local weight (not a LoRA or other wrapper,
    not an FSDP2-sharded module whose weight is a DTensor outside its forward, not a module whose forward is replaced
    on the instance, as accelerate's device-map hooks do)."""
    return (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
            and "forward" not in vars(module)
            and not isinstance(module, FSDPModule) and not isinstance(module.weight, DTensor))


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

    Layers called in a row on the same input tensor (q/k/v, gate/up in a Hugging Face decoder layer) share one product
    with their stacked input projections; their sketches are those of separate products to float tolerance.

    Args:
        model: an ``nn.Module`` with ``get_input_embeddings()`` (HF convention) or exactly one
            ``nn.Embedding``.
        config: :class:`SketchConfig` (default settings if None).
        projection_dtype: None (what the trainer runs): on CUDA each layer's projections run in the precision of
            the layer's own product, bfloat16 / float16 with float32 accumulation, else (and off CUDA) float32
            (docs/sketch.md#precision); a dtype: every ``nn.Linear`` and embedding projection in that dtype
            (reference arithmetic for measuring the precision, as ``benchmarks/bench_sketch_accuracy.py`` and
            ``benchmarks/gpu_check.sh`` do).

    Raises (on enter):
        ValueError: a trainable text-model parameter the sketch cannot cover (e.g. 3-D MoE experts;
            :meth:`SketchCoverage.check`, naming them); no trainable ``nn.Linear`` layer; no unique input
            embedding; ``include_embeddings`` with an embedding that uses ``scale_grad_by_freq``/``max_norm``.
    """

    def __init__(self, model: nn.Module, config: SketchConfig | None = None, *,
                 projection_dtype: torch.dtype | None = None):
        if projection_dtype is not None and not (isinstance(projection_dtype, torch.dtype)
                                                 and projection_dtype.is_floating_point):
            raise ValueError(f"projection_dtype must be None or a floating torch.dtype, got {projection_dtype!r}")
        self.model = model
        self.config = config if config is not None else SketchConfig()
        self._projection_dtype = projection_dtype
        self.blocks: list[Block] = []
        self._handles: list = []
        self._phase = "idle"
        self._segments: torch.Tensor | None = None
        self._num_segments = 0
        self._onehot: torch.Tensor | None = None
        self._head_rows: torch.Tensor | None = None
        self._head_rows_only = False
        self._head_onehot: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._group: list = []  # (block, slot) of the calls on self._group_x whose projection is deferred
        self._group_x: torch.Tensor | None = None
        self._group_key: tuple = ()
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
            sel = select(self.model, self.config, input_embedding(self.model))
            sel.coverage.check(type(self.model).__name__)
            self._emb_module = sel.embedding
            self._emb_block = sel.embedding_block
            self.blocks.extend(sel.blocks)
            layout_blocks(self.blocks, self.config)
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
        self._segments = self._onehot = self._out = self._head_rows = self._head_onehot = None
        self._emb_calls = []
        self._pending = {}
        self._group, self._group_x, self._group_key = [], None, ()
        self._head_rows_only = False

    # ------------------------------------------------------------------ per micro-batch
    def begin(self, segment_ids: torch.Tensor, num_segments: int | None = None,
              device: torch.device | str | None = None, head_rows: torch.Tensor | None = None,
              head_rows_only: bool = False) -> None:
        """Start a micro-batch: call before the model forward.

        Args:
            segment_ids: int64 tensor with the model input's token shape ([B, T] or [1, nnz]);
                entry = index (0..num_segments-1) of the response the position belongs to, -1 for
                padding.
            num_segments: number of responses (default: max(segment_ids) + 1).
            device: the device of the model's activations (default: that of ``segment_ids``).  Pass host
                ``segment_ids`` with the device: they are checked on the host, so the check costs no device sync.
            head_rows: optional host int64 [n_loss] indices of the flattened token rows whose LM-head output can
                carry a loss term (the positions that score a response token).  The head's output gradient is zero
                at every other row, so the head block is projected and accumulated on these rows only (the same
                sketch, without the projection of the zero rows of the ``[tokens, V]`` logits gradient).  On a plain
                ``nn.Linear`` head the model's backward through the head runs on these rows only too (the input
                gradient of the other rows is zero, not computed): the objective must use the head's output at these
                rows only, its dependence on any other row is not seen by the backward.
            head_rows_only: the head's input holds exactly the rows ``head_rows``, in that order (the model was called
                with ``logits_to_keep=head_rows``, so the head never computes the other rows' logits); the head block
                is projected on all rows of its input, whose segments are those of ``head_rows``.

        Raises:
            RuntimeError: called outside the ``with`` block.
            ValueError: non-integer ids, ids below -1 or >= num_segments; head rows outside the token rows or
                repeated; ``head_rows_only`` without ``head_rows``.
        """
        if not self._handles:
            raise RuntimeError("GradientSketcher.begin() must be called inside `with GradientSketcher(...)`")
        if segment_ids.dtype.is_floating_point or segment_ids.dtype == torch.bool:
            raise ValueError(f"segment_ids must be an integer tensor, got dtype {segment_ids.dtype}")
        seg = segment_ids.reshape(-1).long()
        n = int(seg.max().item()) + 1 if num_segments is None else int(num_segments)
        if seg.numel() and bool(((seg < -1) | (seg >= n)).any()):
            raise ValueError(f"segment_ids must lie in [-1, {n - 1}] (num_segments={n})")
        if head_rows_only and head_rows is None:
            raise ValueError("head_rows_only=True needs head_rows: the token row of each row of the head's input")
        if head_rows is not None:
            head_rows = head_rows.reshape(-1).long()
            if head_rows.numel() and bool(((head_rows < 0) | (head_rows >= seg.numel())).any()):
                raise ValueError(f"head_rows must index the {seg.numel()} token rows of segment_ids")
            if head_rows.unique().numel() != head_rows.numel():
                raise ValueError("head_rows must not repeat a row (each row's loss terms are summed by the objective)")
        device = device if device is not None else seg.device
        seg = seg.to(device, non_blocking=True)
        self._reset()
        self._head_rows = None if head_rows is None else head_rows.to(device, non_blocking=True)
        self._head_rows_only = bool(head_rows_only)
        self._segments = seg
        self._num_segments = n
        valid = (seg >= 0).float()
        onehot = torch.zeros(seg.numel(), n, dtype=torch.float32, device=seg.device)
        onehot.scatter_(1, seg.clamp(min=0)[:, None], valid[:, None])  # row t: e_{seg_t}, 0 for padding
        self._onehot = onehot
        self._head_onehot = onehot if self._head_rows is None else onehot[self._head_rows]
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
        self._flush()
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
    def _rows(self, t: torch.Tensor, name: str, expected: int | None = None) -> torch.Tensor:
        """``t`` as [rows, width], checked to have ``expected`` rows (default: the token rows of segment_ids)."""
        flat = t.reshape(-1, t.shape[-1])
        expected = self._segments.numel() if expected is None else expected
        if flat.shape[0] != expected:
            what = ("head_rows has" if self._head_rows_only and expected == self._head_rows.numel()
                    else "segment_ids has")
            raise ValueError(
                f"layer {name!r} sees {flat.shape[0]} token rows but {what} {expected} entries: segment_ids must have "
                "the model input's token shape ([B, T] or [1, nnz]), and with head_rows_only the head's input must "
                "hold exactly the head_rows (logits_to_keep=head_rows)"
            )
        return flat

    def _accumulate(self, block: Block, a: torch.Tensor, b: torch.Tensor, onehot: torch.Tensor | None = None) -> None:
        """out[s, block] += sum_{t in s} a_t (x) b_t in float32, per copy: a [n, k*r_out], b [n, k*r_in] of any float
        dtype (one row per token of ``onehot``, default all token rows), in row chunks of :data:`chunks.CHUNK_BYTES`."""
        n = a.shape[0]
        k = 1 if block.p_in is None else block.shape[2]
        onehot = self._onehot if onehot is None else onehot
        out = self._out[:, block.offset : block.offset + block.size]
        step = chunk_rows(block.size)
        for start in range(0, n, step):
            sl = slice(start, start + step)
            m = a[sl].shape[0]
            outer = (a[sl].float().reshape(m, k, -1, 1) * b[sl].float().reshape(m, k, 1, -1)).reshape(m, -1)
            out += matmul_f32(onehot[sl].T, outer)

    def _head_only(self, block: Block) -> bool:
        return block.is_head and self._head_rows is not None

    def _project_in(self, blocks: tuple[Block, ...], x: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        """P_in [x, 1] of each block's trainable input columns (x for a trainable weight, 1 for a trainable bias) for
        blocks with the same columns whose layers share the input ``x`` [n, in]: one product with their stacked
        projections, in ``dtype`` (identity blocks: float32, one block)."""
        first = blocks[0]
        w = first.weight_cols
        if first.p_in is None:  # identity
            x = x.float()
            parts = ([x] if w else []) + ([x.new_ones(x.shape[0], 1)] if first.bias else [])
            return [parts[0] if len(parts) == 1 else torch.cat(parts, 1)]
        p_in = on_device(tuple(b.p_in for b in blocks), x.device, dtype)  # [sum of k r_in, cols]
        y = project(x, p_in[:, :w].T) if w else p_in.new_zeros(x.shape[0], p_in.shape[0])
        if first.bias:
            y = y + p_in[:, w]
        return list(y.split([b.p_in.shape[0] for b in blocks], 1))

    def _flush(self) -> None:
        """Project the input shared by the deferred calls (:meth:`_linear_forward`) with one product."""
        if not self._group:
            return
        blocks = tuple(b for b, _ in self._group)
        x = self._rows(self._group_x.detach(), blocks[0].name)
        for (_, slot), y in zip(self._group, self._project_in(blocks, x, self._group_key[0])):
            slot.value = y
        self._group, self._group_x, self._group_key = [], None, ()

    def _linear_forward(self, block: Block, module: nn.Linear, args, output):
        if self._phase != "forward" or self._in_jvp:
            return None  # idle, or activation-checkpoint recomputation during backward
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            raise RuntimeError(
                f"layer {block.name!r}: output does not require grad during the sketch forward (forward under "
                "torch.no_grad(), or reentrant activation checkpointing: use use_reentrant=False as verl does)"
            )
        dtype = compute_dtype(output.dtype, output.device.type, override=self._projection_dtype)
        slot, replaced = _Slot(), None
        if self._head_only(block):
            if self._head_rows_only:  # the head's input holds the loss rows only (logits_to_keep)
                x = self._rows(args[0].detach(), block.name, self._head_rows.numel())
            else:
                x = self._rows(args[0].detach(), block.name)[self._head_rows]
                if _plain_linear(module) and args[0].device == output.device:  # backward over the loss rows only
                    replaced = output = _LossRowsLinear.apply(args[0], module.weight.detach(), output.detach(),
                                                              self._head_rows)
            slot.value = self._project_in((block,), x, dtype)[0]
        elif block.p_in is None or not block.weight_cols:
            slot.value = self._project_in((block,), self._rows(args[0].detach(), block.name), dtype)[0]
        else:
            # calls in a row on the same input tensor (q/k/v, gate/up) are projected together when the run ends
            key = (dtype, block.cols, block.bias)
            if self._group and (args[0] is not self._group_x or key != self._group_key):
                self._flush()
            self._group_x, self._group_key = args[0], key
            self._group.append((block, slot))
        self._pending[id(slot)] = block.name
        output.register_hook(partial(self._linear_backward, block, slot))
        return replaced

    def _linear_backward(self, block: Block, slot: _Slot, grad: torch.Tensor):
        if self._phase != "backward" or id(slot) not in self._pending:
            return None
        del self._pending[id(slot)]
        # the LM head: only the rows with a loss term when the caller named them (the others have delta = 0)
        head = self._head_only(block)
        if head and self._head_rows_only:
            d, rows = self._rows(grad.detach(), block.name, self._head_rows.numel()), None
        else:
            d, rows = self._rows(grad.detach(), block.name), self._head_rows if head else None
        if block.p_out is None:
            a = (d if rows is None else d[rows]).float()
        else:
            dtype = compute_dtype(d.dtype, d.device.type, override=self._projection_dtype)
            a = project(d, on_device(block.p_out, d.device, dtype).T, rows)
        self._accumulate(block, a, slot.value, self._head_onehot if head else None)
        return None

    def _embedding_forward(self, module, args, output):
        if self._phase != "forward" or self._in_jvp:
            return None
        if not output.requires_grad:
            output.requires_grad_(True)  # frozen embedding: make its output the backward's input
        self._emb_calls.append((args[0].detach(), output))
        return None

    def _embedding_accumulate(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """The embedding's use of its block, projected in the precision of the embedding's output gradient (the same
        rounded projections as the tied LM head's use, where the two share one block and one dtype)."""
        block = self._emb_block
        ids = ids.reshape(-1)
        g = self._rows(grad.detach(), "input embedding")
        if self._emb_module.padding_idx is not None:
            g = g * (ids != self._emb_module.padding_idx).unsqueeze(1).to(g.dtype)
        if block.p_out is None:
            g = g.float()
            a = torch.nn.functional.one_hot(ids, block.rows).float()
            b = torch.cat([g, g.new_zeros(g.shape[0], block.cols - g.shape[1])], 1)
        else:
            dtype = compute_dtype(g.dtype, g.device.type, override=self._projection_dtype)
            a = on_device(block.p_out, g.device, dtype)[:, ids].T
            b = project(g, on_device(block.p_in, g.device, dtype)[:, : g.shape[1]].T)
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

    def _norm_forward(self, block: Block, pnames: list, module: nn.Module, args, kwargs, output):
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

    def _norm_backward(self, block: Block, parts: list, key: int, grad: torch.Tensor):
        if self._phase != "backward" or key not in self._pending:
            return None
        del self._pending[key]
        d = self._token_groups(grad.detach(), block.name).float()
        per_token = torch.cat([(d * h).sum(1) for h in parts], 1)  # [N, cols]: per-token parameter gradient
        if block.p_out is not None:
            per_token = matmul_f32(per_token, on_device(block.p_out, d.device).T)
        ones = per_token.new_ones(per_token.shape[0], 1)
        self._accumulate(block, per_token, ones)
        return None
