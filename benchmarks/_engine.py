"""verl's ``FSDPEngineWithLMHead`` around a plain module for the benchmarks (the worker's sketch pass runs the
engine's own ``prepare_model_inputs`` / ``prepare_model_outputs``), on verl's CPU platform.

Import this module before verl: it selects the CPU platform (``VERL_PLATFORM=cpu``, what the launcher sets for a
CPU run), so verl's ``get_device_id()`` answers ``"cpu"``.
"""

from __future__ import annotations

import os
from inspect import signature

os.environ.setdefault("VERL_PLATFORM", "cpu")

import torch  # noqa: E402

import verl  # noqa: E402,F401  (first: its plugin loading activates the CPU backend, as in a verl process)
import setgrpo_verl.verl_cpu.platform  # noqa: E402,F401  (registers verl's "cpu" platform)
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402

from setgrpo_verl.verl_cpu.engine import CPUEngineWithLMHead  # noqa: E402


class PlainEngine(FSDPEngineWithLMHead):
    """verl's engine code paths on a plain module: no FSDP wrapping, no optimizer; ``pass_packed_cu_seqlens`` by
    verl's rule (``"cu_seqlens" in signature(module.forward).parameters``)."""

    def __init__(self, module: torch.nn.Module, autocast_dtype: torch.dtype = torch.bfloat16):
        self.module = module
        self.pad_to_length, self.pad_to_length_bucket = False, 0
        self.ulysses_sequence_parallel_size, self.use_ulysses_sp = 1, False
        self._autocast_dtype = autocast_dtype
        self.pass_packed_cu_seqlens = "cu_seqlens" in signature(module.forward).parameters

    def get_data_parallel_group(self):
        return None


class ActorEngine(PlainEngine):
    """:class:`PlainEngine` with verl's training path: ``train_batch`` (zero-grad, ``forward_backward_batch``,
    ``optimizer_step`` with gradient clipping) on ``module`` with ``optimizer``; one data-parallel rank."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, clip_grad: float,
                 autocast_dtype: torch.dtype = torch.bfloat16):
        from types import SimpleNamespace

        super().__init__(module, autocast_dtype)
        self.optimizer = optimizer
        self.optimizer_config = SimpleNamespace(clip_grad=clip_grad)
        self.engine_config = SimpleNamespace(use_no_sync_for_gradient_accumulation=True)
        self.scaler = None
        self._qat_enabled = False
        self.ulysses_device_mesh = None

    def get_data_parallel_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0


class CPUActorEngine(CPUEngineWithLMHead, ActorEngine):
    """:class:`ActorEngine` with the CPU backend's padded log-probs and entropies (the engine a CPU run builds)."""


def single_rank_fsdp2(model: torch.nn.Module, param_dtype: torch.dtype) -> torch.nn.Module:
    """``model`` wrapped as verl 0.9.1's FSDP2 engine wraps the actor (``verl.utils.fsdp_utils.apply_fsdp2``, mixed
    precision: ``param_dtype`` compute, float32 reductions), on a one-rank gloo process group started here if none
    is."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from verl.utils.fsdp_utils import apply_fsdp2

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)
    apply_fsdp2(model, {"mesh": mesh, "mp_policy": mp, "offload_policy": None, "reshard_after_forward": True}, {})
    return model
