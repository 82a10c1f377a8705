"""verl platform ``cpu``: the device abstraction verl 0.9.1 asks for, answered for a machine without accelerators.

verl resolves its platform once per process (``verl.plugin.platform.get_platform``) from ``VERL_PLATFORM``;
:func:`setgrpo_verl.verl_cpu.activate` registers :class:`PlatformCPU` under that name before anything asks.
Collectives use gloo. Ray places verl's workers on a *logical* ``GPU`` resource: verl's resource pools count
accelerators only, so a CPU run starts Ray with ``ray_init.num_gpus`` equal to the number of actor ranks
(the launcher does this); no CUDA code runs.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Mapping, Optional

import psutil
import torch

from verl.plugin.platform import PlatformBase, PlatformRegistry

from . import CPU_PLATFORM


def rank_threads(num_cpus: int, ranks_per_node: int) -> int:
    """Torch intra-op threads of one verl worker rank: the node's CPU cores shared among its ranks.

    Args:
        num_cpus: CPU cores the node's processes may run on.
        ranks_per_node: verl's worker ranks on the node (``RAY_LOCAL_WORLD_SIZE``, ``trainer.n_gpus_per_node``).

    Returns:
        An int >= 1.
    """
    return max(1, int(num_cpus) // max(1, int(ranks_per_node)))


def set_rank_threads(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """Give a verl worker rank its share of the node's cores (:func:`rank_threads`); other processes are left alone.

    Ray starts every actor with ``OMP_NUM_THREADS=1``, so without this an actor rank computes its log-probs, its
    updates and the sketch pass on one core while the node's other cores idle. verl's worker groups mark their
    ranks with ``RAY_LOCAL_WORLD_SIZE``; the rollout server, which runs while the ranks wait, sets its own threads.

    Args:
        environ: the process environment.

    Returns:
        The threads set, or None in a process that is not a verl worker rank.

    Raises:
        ValueError: ``RAY_LOCAL_WORLD_SIZE`` is not a positive integer.
    """
    ranks = environ.get("RAY_LOCAL_WORLD_SIZE")
    if ranks is None:
        return None
    if not ranks.strip().isdigit() or int(ranks) < 1:
        raise ValueError(f"RAY_LOCAL_WORLD_SIZE={ranks!r}: verl sets it to the worker ranks on the node, a "
                         "positive integer; unset it or set it to that count")
    threads = rank_threads(len(os.sched_getaffinity(0)), int(ranks))
    torch.set_num_threads(threads)
    return threads


class CPUDeviceModule:
    """The ``torch.cuda``-like module verl calls through ``get_torch_device()``, for the CPU.

    Stream, event and synchronisation calls go to ``torch.cpu``; memory statistics report the process's resident
    set size (bytes) and the machine's memory (``mem_get_info``: ``(available, total)`` bytes); cache and
    memory-fraction calls do nothing because the CPU allocator has no cache to release. Any other attribute raises
    AttributeError naming it, so a verl call this module does not know fails loudly instead of returning a dummy.
    """

    is_available = staticmethod(torch.cpu.is_available)
    synchronize = staticmethod(torch.cpu.synchronize)
    current_stream = staticmethod(torch.cpu.current_stream)
    stream = staticmethod(torch.cpu.stream)
    Stream = torch.cpu.Stream
    Event = torch.cpu.Event

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> str:
        return CPU_PLATFORM

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "CPU"

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return int(psutil.Process().memory_info().rss)

    memory_reserved = memory_allocated
    max_memory_allocated = memory_allocated
    max_memory_reserved = memory_allocated

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"verl asked the CPU platform's device module for {name!r}, which setgrpo_verl.verl_cpu does not provide"
        )


@PlatformRegistry.register(platform=CPU_PLATFORM)
class PlatformCPU(PlatformBase):
    """verl platform for CPU-only machines (gloo collectives, logical ``GPU`` Ray resource)."""

    _device_module = CPUDeviceModule()

    @property
    def device_name(self) -> str:
        return CPU_PLATFORM

    @property
    def vendor_name(self) -> str:
        return CPU_PLATFORM

    @property
    def device_module(self) -> CPUDeviceModule:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:
        # verl moves tensors with ``tensor.to(get_device_id())``; an integer would mean ``cuda:N``.
        return CPU_PLATFORM

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None
