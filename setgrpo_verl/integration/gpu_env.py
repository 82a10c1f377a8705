"""The GPU environment a verl 0.9.1 run needs, checked where the GPUs are (docs/verl_integration.md#gpu-requirements).

torch 2.11.0 from PyPI (verl 0.9.1's ``vllm`` extra) is a CUDA 13.0 build, and so are the cupy and flash-attn builds
of the GPU install. verl's workers would fail minutes in, after Ray, vLLM and the models started, when torch cannot
use a GPU or flash-attn (verl's default attention) does not load. :func:`gpu_environment_error` names what is wrong
and the fix. What decides is whether torch can use the GPU; the NVIDIA driver's version only explains why it cannot
(a driver older than R580 runs CUDA 13.0 only through NVIDIA's forward-compatibility libraries, which do work).

Every fact the check reads of the machine (torch's build, CUDA availability, the device count, the driver's version,
``CUDA_VISIBLE_DEVICES``) comes from :func:`gpu_facts`, the one seam a test fakes to play a cluster's conditions.

:func:`gpu_check` runs on the driver before Ray when the machine has an NVIDIA driver (the Hydra
callback, :func:`setgrpo_verl.integration.run_check.check_run_config`) and on every actor worker when it starts, before
any model loads (:class:`setgrpo_verl.integration.worker.CheckedActorRolloutRefWorker`). Nothing checks in verl's
TaskRunner, a Ray actor without GPUs (Ray 2.41-2.55 sets ``CUDA_VISIBLE_DEVICES=""`` there). The CPU backend
(``VERL_PLATFORM=cpu`` or ``trainer.device=cpu``) skips it.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional

from .dotted import config_value

__all__ = ["DRIVER_FOR_CUDA", "GpuEnvironment", "check_driver_gpus", "gpu_check", "gpu_facts", "flash_attn_load_error",
           "gpu_environment_error", "has_nvidia_driver", "in_ray_actor", "needs_flash_attn", "nvidia_driver_version",
           "read_gpu_environment", "skipped"]

#: Oldest NVIDIA driver branch that runs each CUDA major version (NVIDIA's CUDA toolkit release notes, minor-version
#: compatibility): CUDA 13.x needs R580, CUDA 12.x R525.
DRIVER_FOR_CUDA = {13: 580, 12: 525}
#: Where the install step of flash-attn and the driver requirement are documented.
INSTALL_DOC = "docs/verl_integration.md#installing-on-a-gpu-cluster"
ATTENTION_KEY = "actor_rollout_ref.model.override_config.attn_implementation"
#: verl 0.9.1's default attention of the actor and the reference (``HFModelConfig``).
DEFAULT_ATTENTION = "flash_attention_2"
_PROC_VERSION = "/proc/driver/nvidia/version"
_DEVICE_NODE = "/dev/nvidiactl"


@dataclass(frozen=True)
class GpuEnvironment:
    """What this process sees of the GPUs (:func:`gpu_facts`, plus flash-attn's load in :func:`read_gpu_environment`).

    Attributes:
        torch_version: ``torch.__version__``.
        torch_cuda: the CUDA version torch was built for (``torch.version.cuda``, e.g. ``"13.0"``); None for a CPU
            build.
        cuda_available: ``torch.cuda.is_available()``: the test that decides.
        driver_version: the loaded NVIDIA kernel driver (e.g. ``"580.65.06"``); None when none is loaded.
        flash_attn_error: why flash-attn does not load (:func:`flash_attn_load_error`); None when it loads or was
            not asked for.
        device_count: ``torch.cuda.device_count()`` (0 without CUDA).
        visible_devices: ``CUDA_VISIBLE_DEVICES`` of this process; None when unset (Ray 2.41-2.55 sets ``""`` in
            actors without GPUs).
        driver_device: whether the NVIDIA control device (``/dev/nvidiactl``) exists (a container may show it
            without ``/proc/driver/nvidia``).
    """

    torch_version: str
    torch_cuda: Optional[str]
    cuda_available: bool
    driver_version: Optional[str]
    flash_attn_error: Optional[str] = None
    device_count: int = 0
    visible_devices: Optional[str] = None
    driver_device: bool = False

    @property
    def has_driver(self) -> bool:
        """Whether an NVIDIA driver is loaded on this machine (its GPUs may still be invisible to torch)."""
        return self.driver_version is not None or self.driver_device


def nvidia_driver_version(proc_text: Optional[str] = None) -> Optional[str]:
    """The loaded NVIDIA kernel driver's version (``"580.65.06"``), from ``/proc/driver/nvidia/version`` (or the given
    text of that file); None when no NVIDIA driver is loaded."""
    if proc_text is None:
        try:
            with open(_PROC_VERSION, encoding="utf-8") as fh:
                proc_text = fh.read()
        except OSError:
            return None
    match = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", proc_text)
    return match.group(1) if match else None


def gpu_facts() -> GpuEnvironment:
    """What this process sees of the GPUs, read from torch, ``/proc/driver/nvidia/version``, ``/dev/nvidiactl`` and
    ``CUDA_VISIBLE_DEVICES``; ``flash_attn_error`` is None (not tried). The one place these facts are read: a test
    plays a machine (a GPU-less Ray actor, a forward-compatibility driver, no driver) by replacing this function."""
    import torch

    available = bool(torch.cuda.is_available())
    return GpuEnvironment(torch_version=str(torch.__version__), torch_cuda=torch.version.cuda,
                          cuda_available=available, driver_version=nvidia_driver_version(),
                          device_count=int(torch.cuda.device_count()) if available else 0,
                          visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                          driver_device=os.path.exists(_DEVICE_NODE))


def has_nvidia_driver() -> bool:
    """True when this machine has an NVIDIA driver loaded (its GPUs may still be invisible to torch;
    :func:`gpu_facts`)."""
    return gpu_facts().has_driver


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor (verl's TaskRunner, a worker), not the driver where ``main_ppo`` starts."""
    ray = sys.modules.get("ray")  # a process that never imported Ray is no Ray actor
    if ray is None or not ray.is_initialized():
        return False
    return ray.get_runtime_context().get_actor_id() is not None


def flash_attn_load_error(*, run_kernel: bool) -> Optional[str]:
    """Why flash-attn cannot serve verl's ``flash_attention_2`` here, or None.

    Imports ``flash_attn`` and its compiled extension ``flash_attn_2_cuda`` (an ABI mismatch with torch shows as an
    undefined symbol here, not at ``find_spec``); with ``run_kernel``, also runs one tiny bf16 attention on the current
    CUDA device (a build without kernels for this GPU fails here). ``run_kernel`` creates a CUDA context, so the
    driver process, which holds it for the whole run, imports only.
    """
    try:
        flash_attn = importlib.import_module("flash_attn")
        importlib.import_module("flash_attn_2_cuda")
    except Exception as exc:  # ImportError, OSError (undefined symbol, missing libcudart), RuntimeError
        return f"flash-attn does not import ({type(exc).__name__}: {exc})"
    if not run_kernel:
        return None
    try:
        import torch

        q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
        flash_attn.flash_attn_func(q, q, q, causal=True)
        torch.cuda.synchronize()
    except Exception as exc:  # RuntimeError: no kernel image for this GPU, CUDA errors
        return f"flash-attn imports but its kernel does not run on this GPU ({type(exc).__name__}: {exc})"
    return None


def read_gpu_environment(*, flash_attn: bool, run_kernel: bool) -> GpuEnvironment:
    """This process's :class:`GpuEnvironment` (:func:`gpu_facts`); flash-attn is tried only with ``flash_attn`` (and
    CUDA available)."""
    facts = gpu_facts()
    if not (flash_attn and facts.cuda_available):
        return facts
    return dataclasses.replace(facts, flash_attn_error=flash_attn_load_error(run_kernel=run_kernel))


def gpu_environment_error(env: GpuEnvironment, *, where: str) -> Optional[str]:
    """Why a verl GPU run cannot start in ``env``, naming the fix, or None (docs/verl_integration.md#gpu-requirements).

    Args:
        env: what the process sees.
        where: the process, for the message (``"the driver"``, ``"actor worker rank 3 on node x"``).

    Returns:
        One message, the first of: torch is a CPU build; CUDA is not available to torch (explained by a driver older
        than the branch torch's CUDA needs, by ``CUDA_VISIBLE_DEVICES=""`` or by no driver); flash-attn does not
        load. None when none applies: torch can use the GPU whatever the driver's version (NVIDIA's
        forward-compatibility libraries run CUDA 13 on older drivers).
    """
    if env.torch_cuda is None:
        return (f"{where}: torch {env.torch_version} is a CPU build, so verl's GPU workers cannot start; install "
                f"verl 0.9.1's torch==2.11.0 (a CUDA 13.0 build, docker/constraints-gpu.txt; {INSTALL_DOC})")
    major = int(env.torch_cuda.split(".")[0])
    need = DRIVER_FOR_CUDA.get(major)
    driver = env.driver_version
    if not env.cuda_available:
        head = f"{where}: CUDA is not available to torch {env.torch_version} (CUDA {env.torch_cuda})"
        if driver is not None and need is not None and int(driver.split(".")[0]) < need:
            return (f"{head}: the NVIDIA driver {driver} is older than R{need}, which CUDA {env.torch_cuda} needs; "
                    f"upgrade the driver to R{need} or newer, or install NVIDIA's forward-compatibility package "
                    f"(cuda-compat-{major}-0) where the driver's GPU supports it (verl 0.9.1's torch, vLLM, cupy and "
                    f"flash-attn are all CUDA {major} builds; {INSTALL_DOC})")
        if env.visible_devices is not None and not env.visible_devices.strip():
            return (f"{head}: CUDA_VISIBLE_DEVICES is empty in this process (Ray sets it so in a process it gave no "
                    "GPU); run it with GPUs (`ray start --num-gpus`, the job's resources) or unset the variable")
        seen = (f"the NVIDIA driver {driver} is loaded" if driver else
                "an NVIDIA driver is loaded (/dev/nvidiactl)" if env.has_driver else "no NVIDIA driver is loaded")
        return (f"{head} and {seen}; run on a machine with NVIDIA GPUs and driver R{need or '?'} or newer, with the "
                "GPUs visible to the process (CUDA_VISIBLE_DEVICES, `docker run --gpus all`), or run the CPU backend "
                "(VERL_PLATFORM=cpu)")
    if env.flash_attn_error is not None:
        return (f"{where}: {env.flash_attn_error}; verl's default attention {DEFAULT_ATTENTION} needs flash-attn "
                f"2.8.3 built for torch {env.torch_version} and CUDA {env.torch_cuda}: install it as {INSTALL_DOC} "
                f"says (verl's prebuilt wheel, or `pip install --no-build-isolation flash-attn==2.8.3`), or set "
                f"+{ATTENTION_KEY}=sdpa (torch's attention, no extra package)")
    return None


def needs_flash_attn(model_config: Any) -> bool:
    """Whether verl loads the policy with flash-attn: ``override_config.attn_implementation`` of
    ``actor_rollout_ref.model`` (``model_config``) unset or ``flash_attention_2``."""
    value = config_value(model_config, "override_config.attn_implementation")
    return str(value or DEFAULT_ATTENTION) == DEFAULT_ATTENTION


def skipped(device: Optional[str] = None) -> bool:
    """True for the CPU backend (``VERL_PLATFORM=cpu`` in the environment or ``trainer.device=cpu``), which runs
    without CUDA and flash-attn."""
    from setgrpo_verl import verl_cpu

    return verl_cpu.requested() or str(device or "").strip().lower() == verl_cpu.CPU_PLATFORM


def gpu_check(model_config: Any, *, where: str, run_kernel: bool, device: Optional[str] = None) -> Optional[str]:
    """Why this process cannot run verl's GPU path (:func:`gpu_environment_error`), or None; always None on the CPU
    backend, which does not run the check.

    Args:
        model_config: ``actor_rollout_ref.model`` (decides whether flash-attn is needed).
        where: the process, named in the message.
        run_kernel: also run one flash-attn kernel (the workers; the driver only imports it).
        device: ``trainer.device`` where known.
    """
    if skipped(device):
        return None
    env = read_gpu_environment(flash_attn=needs_flash_attn(model_config), run_kernel=run_kernel)
    return gpu_environment_error(env, where=where)


def check_driver_gpus(config: Any) -> None:
    """The check before Ray of the process where ``main_ppo`` starts: on a machine with an NVIDIA driver loaded,
    :func:`gpu_check` with flash-attn imported but no kernel run (the driver would hold a CUDA context for the whole
    run); elsewhere nothing (the actor workers check their own GPUs when they start). In a Ray actor (verl's
    TaskRunner, which has no GPUs) nothing either: this check is the driver's.

    Args:
        config: the composed verl config (``actor_rollout_ref.model``, ``trainer.device``).

    Raises:
        ValueError: :func:`gpu_environment_error`'s message.
    """
    if in_ray_actor() or not has_nvidia_driver():
        return
    error = gpu_check(config_value(config, "actor_rollout_ref.model"), where="the driver (where main_ppo starts)",
                      run_kernel=False, device=config_value(config, "trainer.device"))
    if error:
        raise ValueError(error)
