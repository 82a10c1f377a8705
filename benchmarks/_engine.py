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

import setgrpo_verl.verl_cpu.platform  # noqa: E402,F401  (registers verl's "cpu" platform)
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402


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
