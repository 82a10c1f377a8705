"""FSDP and activation-checkpointing handling of the sketch pass (docs/sketch.md#memory): the HF module under an
FSDP1 wrapper, checkpointing in the eval-mode sketch pass, and FSDP1 resharding in the activation-only backward."""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, _runtime_utils


def raise_on_every_rank(error: BaseException | None, group=None) -> None:
    """Agree on a rank-local error before raising, so that no rank is left waiting in a collective of the others
    (verl 0.9.1's ``seqlen_balancing`` agrees on its fatal conditions the same way).

    Every rank of ``group`` must call this at the same point.  The ranks exchange their error messages (one
    ``all_gather_object``); if any rank has one, a rank re-raises its own error, and a rank without one raises
    RuntimeError naming the failed ranks and their messages.  Outside a process group (or with one rank) ``error``
    is raised as it is.

    Args:
        error: this rank's error, or None.
        group: the process group (None: the default group).

    Raises:
        ``error`` itself, or RuntimeError for another rank's error.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    messages: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}", group=group)
    failed = {rank: m for rank, m in enumerate(messages) if m is not None}
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"the sketch pass failed on rank(s) {sorted(failed)} of the data-parallel group: "
            + "; ".join(f"rank {rank}: {m}" for rank, m in failed.items())
        )


def unwrapped(model: nn.Module) -> nn.Module:
    """The HF module inside FSDP1 wrappers (FSDP1 keeps it one attribute down); the model itself otherwise."""
    while hasattr(model, "_fsdp_wrapped_module"):
        model = model._fsdp_wrapped_module
    return model


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
