"""The GPU environment a verl 0.9.1 run needs, checked where the GPUs are (docs/verl_integration.md#gpu-requirements).

torch 2.11.0 from PyPI (verl 0.9.1's ``vllm`` extra) is a CUDA 13.0 build, and so are the cupy and flash-attn builds
of the GPU install: an NVIDIA driver older than R580 cannot run CUDA 13.0, and torch then sees no GPU. verl's
workers would fail minutes in, after Ray, vLLM and the models started. :func:`gpu_environment_error` names what is
wrong and the fix: CUDA not available to torch, the driver too old for torch's CUDA, or flash-attn (verl's default
attention) that does not import *and load* its CUDA extension.

:func:`gpu_check` runs on the driver before Ray when the machine has an NVIDIA driver (the Hydra
callback, :func:`setgrpo_verl.integration.config.check_run_config`) and on every actor worker when it starts, before
any model loads (:class:`setgrpo_verl.integration.worker.CheckedActorRolloutRefWorker`). The CPU backend
(``VERL_PLATFORM=cpu`` or ``trainer.device=cpu``) skips it.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from .dotted import config_value

__all__ = ["DRIVER_FOR_CUDA", "GpuEnvironment", "check_driver_gpus", "gpu_check", "flash_attn_load_error",
           "gpu_environment_error", "has_nvidia_driver", "needs_flash_attn", "nvidia_driver_version",
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


@dataclass(frozen=True)
class GpuEnvironment:
    """What this process sees of the GPUs.

    Attributes:
        torch_version: ``torch.__version__``.
        torch_cuda: the CUDA version torch was built for (``torch.version.cuda``, e.g. ``"13.0"``); None for a CPU
            build.
        cuda_available: ``torch.cuda.is_available()``.
        driver_version: the loaded NVIDIA kernel driver (e.g. ``"580.65.06"``); None when none is loaded.
        flash_attn_error: why flash-attn does not load (:func:`flash_attn_load_error`); None when it loads or was
            not asked for.
    """

    torch_version: str
    torch_cuda: Optional[str]
    cuda_available: bool
    driver_version: Optional[str]
    flash_attn_error: Optional[str] = None


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


def has_nvidia_driver() -> bool:
    """True when this machine has an NVIDIA driver loaded (its GPUs may still be invisible to torch)."""
    return nvidia_driver_version() is not None or os.path.exists("/dev/nvidiactl")


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
    """This process's :class:`GpuEnvironment`; flash-attn is tried only with ``flash_attn`` (and CUDA available)."""
    import torch

    available = bool(torch.cuda.is_available())
    error = flash_attn_load_error(run_kernel=run_kernel) if flash_attn and available else None
    return GpuEnvironment(torch_version=str(torch.__version__), torch_cuda=torch.version.cuda,
                          cuda_available=available, driver_version=nvidia_driver_version(), flash_attn_error=error)


def gpu_environment_error(env: GpuEnvironment, *, where: str) -> Optional[str]:
    """Why a verl GPU run cannot start in ``env``, naming the fix, or None (docs/verl_integration.md#gpu-requirements).

    Args:
        env: what the process sees.
        where: the process, for the message (``"the driver"``, ``"actor worker rank 3 on node x"``).

    Returns:
        One message, the first of: torch is a CPU build; the driver is older than the branch torch's CUDA needs;
        CUDA is not available to torch; flash-attn does not load. None when none applies.
    """
    if env.torch_cuda is None:
        return (f"{where}: torch {env.torch_version} is a CPU build, so verl's GPU workers cannot start; install "
                f"verl 0.9.1's torch==2.11.0 (a CUDA 13.0 build, docker/constraints-gpu.txt; {INSTALL_DOC})")
    major = int(env.torch_cuda.split(".")[0])
    need = DRIVER_FOR_CUDA.get(major)
    driver = env.driver_version
    if driver is not None and need is not None and int(driver.split(".")[0]) < need:
        return (f"{where}: the NVIDIA driver {driver} is older than R{need}, which CUDA {env.torch_cuda} (the build of "
                f"torch {env.torch_version}) needs, so torch sees no GPU; upgrade the driver to R{need} or newer "
                f"(verl 0.9.1's torch, vLLM, cupy and flash-attn are all CUDA {major} builds; {INSTALL_DOC})")
    if not env.cuda_available:
        seen = f"the NVIDIA driver {driver} is loaded" if driver else "no NVIDIA driver is loaded"
        return (f"{where}: CUDA is not available to torch {env.torch_version} (CUDA {env.torch_cuda}) and {seen}; "
                f"run on a machine with NVIDIA GPUs and driver R{need or '?'} or newer, with the GPUs visible to the "
                "process (CUDA_VISIBLE_DEVICES, `docker run --gpus all`), or run the CPU backend (VERL_PLATFORM=cpu)")
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
    run); elsewhere nothing (the actor workers check their own GPUs when they start).

    Args:
        config: the composed verl config (``actor_rollout_ref.model``, ``trainer.device``).

    Raises:
        ValueError: :func:`gpu_environment_error`'s message.
    """
    if not has_nvidia_driver():
        return
    error = gpu_check(config_value(config, "actor_rollout_ref.model"), where="the driver (where main_ppo starts)",
                      run_kernel=False, device=config_value(config, "trainer.device"))
    if error:
        raise ValueError(error)
