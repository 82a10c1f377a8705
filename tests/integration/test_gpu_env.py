"""The GPU environment of a verl 0.9.1 run (CUDA 13 torch, driver >= R580, flash-attn that loads) is checked on the
driver before Ray and on every actor worker before any model loads, naming the fix; the CPU backend skips it."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
from omegaconf import OmegaConf

from setgrpo_verl.integration import gpu_env
from setgrpo_verl.integration.gpu_env import GpuEnvironment, gpu_check, gpu_environment_error, nvidia_driver_version

GOOD = GpuEnvironment(torch_version="2.11.0+cu130", torch_cuda="13.0", cuda_available=True,
                      driver_version="580.65.06")
FLASH = OmegaConf.create({"override_config": {}})  # verl's default attention: flash_attention_2
SDPA = OmegaConf.create({"override_config": {"attn_implementation": "sdpa"}})


def test_driver_version_from_the_kernel_module():
    proprietary = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 07:09:50 UTC 2025\nGCC ..."
    open_module = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  575.57.08  Release Build  (dvs-builder)"
    assert nvidia_driver_version(proprietary) == "580.65.06"
    assert nvidia_driver_version(open_module) == "575.57.08"
    assert nvidia_driver_version("no driver here") is None


def test_a_ready_machine_passes():
    assert gpu_environment_error(GOOD, where="the driver") is None


@pytest.mark.parametrize(("env", "needles"), [
    (GpuEnvironment("2.11.0+cpu", None, False, None), ["a CPU build", "torch==2.11.0 (a CUDA 13.0 build"]),
    # torch 2.11.0 from PyPI is a CUDA 13.0 build: a driver of the R570 branch cannot run it
    (GpuEnvironment("2.11.0+cu130", "13.0", False, "570.133.20"),
     ["the NVIDIA driver 570.133.20 is older than R580, which CUDA 13.0", "upgrade the driver to R580 or newer"]),
    (GpuEnvironment("2.11.0+cu130", "13.0", False, "580.65.06"),
     ["CUDA is not available to torch 2.11.0+cu130", "the NVIDIA driver 580.65.06 is loaded", "--gpus all"]),
    (GpuEnvironment("2.11.0+cu130", "13.0", False, None), ["no NVIDIA driver is loaded", "VERL_PLATFORM=cpu"]),
    (GpuEnvironment("2.11.0+cu130", "13.0", True, "580.65.06",
                    flash_attn_error="flash-attn does not import (ImportError: undefined symbol: _ZN3c10)"),
     ["undefined symbol", "pip install --no-build-isolation flash-attn==2.8.3",
      "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"]),
])
def test_each_fault_is_named_with_its_fix(env, needles):
    text = gpu_environment_error(env, where="actor worker (actor_rollout) rank 3 on node-7")
    assert text.startswith("actor worker (actor_rollout) rank 3 on node-7: "), text
    for needle in needles:
        assert needle in text, (needle, text)


def test_a_cuda_12_build_needs_only_r525():
    env = GpuEnvironment("2.9.1+cu128", "12.8", True, "550.54.15")
    assert gpu_environment_error(env, where="x") is None


def _flash_attn(monkeypatch, *, extension: bool, kernel_error: Exception | None = None):
    """A flash_attn package whose compiled extension loads (or not) and whose kernel runs (or raises)."""
    module = types.ModuleType("flash_attn")

    def flash_attn_func(q, k, v, causal=False):
        if kernel_error is not None:
            raise kernel_error
        return q

    module.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setitem(sys.modules, "flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda") if extension else None)


def test_flash_attn_must_load_its_extension_not_only_be_found(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert "flash-attn does not import (ModuleNotFoundError" in gpu_env.flash_attn_load_error(run_kernel=False)
    _flash_attn(monkeypatch, extension=False)  # the package is there, its CUDA extension does not load
    assert "flash-attn does not import" in gpu_env.flash_attn_load_error(run_kernel=False)
    _flash_attn(monkeypatch, extension=True)
    assert gpu_env.flash_attn_load_error(run_kernel=False) is None


def test_the_workers_run_one_kernel(monkeypatch):
    _flash_attn(monkeypatch, extension=True, kernel_error=RuntimeError("no kernel image is available"))
    assert gpu_env.flash_attn_load_error(run_kernel=False) is None  # the driver imports only
    monkeypatch.setattr("torch.zeros", lambda *a, **k: None)  # no CUDA device on this machine
    monkeypatch.setattr("torch.cuda.synchronize", lambda: None)
    text = gpu_env.flash_attn_load_error(run_kernel=True)
    assert "imports but its kernel does not run on this GPU" in text and "no kernel image" in text


def test_flash_attn_is_checked_only_for_verl_default_attention(monkeypatch):
    asked = []

    def read(*, flash_attn, run_kernel):
        asked.append(flash_attn)
        return GOOD

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.setattr(gpu_env, "read_gpu_environment", read)
    assert gpu_check(FLASH, where="w", run_kernel=True) is None and gpu_check(SDPA, where="w", run_kernel=True) is None
    assert asked == [True, False]


def test_the_cpu_backend_skips_the_check(monkeypatch):
    def read(**kwargs):
        raise AssertionError("the CPU backend read the GPU environment")

    monkeypatch.setattr(gpu_env, "read_gpu_environment", read)
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert gpu_check(FLASH, where="w", run_kernel=True) is None
    monkeypatch.delenv("VERL_PLATFORM")
    assert gpu_check(FLASH, where="w", run_kernel=True, device="cpu") is None
    # this machine's torch is a CPU build: a GPU run here is refused
    monkeypatch.setattr(gpu_env, "read_gpu_environment", lambda **kw: GpuEnvironment("2.13.0+cpu", None, False, None))
    assert "a CPU build" in gpu_check(FLASH, where="w", run_kernel=True)


def test_the_driver_checks_before_ray_when_it_has_an_nvidia_driver(monkeypatch):
    old = GpuEnvironment("2.11.0+cu130", "13.0", False, "550.54.15")
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.setattr(gpu_env, "read_gpu_environment", lambda **kw: old)
    cfg = OmegaConf.create({"actor_rollout_ref": {"model": {"override_config": {}}}, "trainer": {"device": "cuda"}})
    monkeypatch.setattr(gpu_env, "has_nvidia_driver", lambda: False)
    gpu_env.check_driver_gpus(cfg)  # no NVIDIA driver on the driver's machine: its workers check
    monkeypatch.setattr(gpu_env, "has_nvidia_driver", lambda: True)
    with pytest.raises(ValueError, match="the driver \\(where main_ppo starts\\): CUDA is not available .*: the "
                                         "NVIDIA driver 550.54.15 is older than R580"):
        gpu_env.check_driver_gpus(cfg)
    cfg.trainer.device = "cpu"
    gpu_env.check_driver_gpus(cfg)


def test_the_actor_worker_checks_before_any_model_loads(monkeypatch):
    """The check runs in the worker's __init__, after verl's Worker setup chose the rank's GPU; init_model (the model
    load) never runs on a refused worker."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from setgrpo_verl.integration import worker as worker_module
    from setgrpo_verl.integration.sync_mode import GradedSyncTrainer
    from setgrpo_verl.integration.trainer import SetGRPOTrainer

    calls = []

    def verl_init(self, config, role, *args, **kwargs):
        calls.append("verl __init__")
        self._rank = 2

    monkeypatch.setattr(ActorRolloutRefWorker, "__init__", verl_init)
    monkeypatch.setattr(ActorRolloutRefWorker, "init_model", lambda self: calls.append("init_model"))
    monkeypatch.setattr(worker_module, "gpu_check", lambda model, **kw: calls.append(kw["where"]) or "driver too old")
    config = OmegaConf.create({"model": {"override_config": {}}})
    for cls in (worker_module.CheckedActorRolloutRefWorker, worker_module.SetGRPOActorRolloutRefWorker):
        calls.clear()
        with pytest.raises(RuntimeError, match="driver too old"):
            cls(config, "actor_rollout")
        assert calls[0] == "verl __init__" and calls[1].startswith("actor worker (actor_rollout) rank 2 on ")
        assert "init_model" not in calls
    # both trainer modes run these workers
    assert SetGRPOTrainer.actor_worker is worker_module.SetGRPOActorRolloutRefWorker
    assert GradedSyncTrainer.actor_worker is worker_module.CheckedActorRolloutRefWorker


# ---- the conditions a cluster creates, played through the one seam gpu_env.gpu_facts ----------------------------

#: verl's TaskRunner under Ray 2.41-2.55: a Ray actor without GPUs, on a GPU node, with CUDA_VISIBLE_DEVICES="".
GPU_LESS_ACTOR_RAY_255 = GpuEnvironment("2.11.0+cu130", "13.0", False, "580.65.06", device_count=0,
                                        visible_devices="", driver_device=True)
#: the same actor under Ray >= 2.56, which leaves CUDA_VISIBLE_DEVICES alone: torch sees every GPU of the node.
GPU_LESS_ACTOR_RAY_256 = GpuEnvironment("2.11.0+cu130", "13.0", True, "580.65.06", device_count=8,
                                        visible_devices=None, driver_device=True)
#: a node on the R570 branch running CUDA 13 through NVIDIA's forward-compatibility libraries.
FORWARD_COMPATIBLE = GpuEnvironment("2.11.0+cu130", "13.0", True, "570.133.20", device_count=8, driver_device=True)
#: a machine with no NVIDIA driver at all.
NO_DRIVER = GpuEnvironment("2.11.0+cu130", "13.0", False, None)

DRIVER_CONFIG = OmegaConf.create({"actor_rollout_ref": {"model": {"override_config": {"attn_implementation": "sdpa"}}},
                                  "trainer": {"device": "cuda"}})


def _play(monkeypatch, facts: GpuEnvironment) -> None:
    """This process sees ``facts`` (the GPU backend, not the CPU one)."""
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    monkeypatch.setattr(gpu_env, "gpu_facts", lambda: facts)


def test_the_taskrunner_does_not_check_the_gpu_environment(monkeypatch):
    """SetGRPOTrainer is built in verl's TaskRunner, a Ray actor without GPUs: under Ray 2.41-2.55 torch sees no GPU
    there, and the driver and the workers have checked already, so its config check leaves the environment out."""
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from setgrpo_verl.integration.trainer import SetGRPOTrainer
    from tests.integration.test_pre_ray_checks import CAL_ONLY, LOCAL, _compose

    cfg = _compose(LOCAL, CAL_ONLY)

    class ReachedVerl(Exception):
        pass

    def verl_init(self, config):
        raise ReachedVerl

    monkeypatch.setattr(PPOTrainerSync, "__init__", verl_init)
    for facts in (GPU_LESS_ACTOR_RAY_255, GPU_LESS_ACTOR_RAY_256):
        _play(monkeypatch, facts)
        with pytest.raises(ReachedVerl):
            SetGRPOTrainer(cfg)


def test_the_driver_check_never_runs_in_a_ray_actor(monkeypatch):
    """check_driver_gpus speaks for the driver; in a Ray actor (the TaskRunner) it checks nothing and blames no one."""
    _play(monkeypatch, GPU_LESS_ACTOR_RAY_255)
    with pytest.raises(ValueError, match=r"^the driver \(where main_ppo starts\): CUDA is not available"):
        gpu_env.check_driver_gpus(DRIVER_CONFIG)  # the same facts on the driver itself are refused

    class Context:
        def get_actor_id(self):
            return "actor-1"

    ray = types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=Context)
    monkeypatch.setitem(sys.modules, "ray", ray)
    assert gpu_env.in_ray_actor()
    gpu_env.check_driver_gpus(DRIVER_CONFIG)


def test_an_empty_cuda_visible_devices_is_named(monkeypatch):
    """A process Ray gave no GPU (Ray <= 2.55) is told so, not told that the node lacks GPUs or its driver is old."""
    text = gpu_environment_error(GPU_LESS_ACTOR_RAY_255, where="actor worker (actor_rollout) rank 0 on n1")
    assert "CUDA_VISIBLE_DEVICES is empty in this process" in text and "older than" not in text
    assert "the driver" not in text.split(":")[0]
    assert gpu_environment_error(GPU_LESS_ACTOR_RAY_256, where="x") is None


def test_a_forward_compatibility_driver_with_working_cuda_passes(monkeypatch):
    """R570 + cuda-compat-13-0: torch uses the GPU, so nothing is refused; the driver only explains a failure."""
    assert gpu_environment_error(FORWARD_COMPATIBLE, where="x") is None
    _play(monkeypatch, FORWARD_COMPATIBLE)
    gpu_env.check_driver_gpus(DRIVER_CONFIG)
    assert gpu_check(SDPA, where="w", run_kernel=True) is None
    broken = dataclasses.replace(FORWARD_COMPATIBLE, cuda_available=False, device_count=0)
    text = gpu_environment_error(broken, where="x")
    assert text.startswith("x: CUDA is not available to torch") and "older than R580" in text
    assert "cuda-compat-13-0" in text


def test_no_driver_at_all(monkeypatch):
    """No NVIDIA driver: the driver process leaves the check to the workers; a worker names the missing driver."""
    _play(monkeypatch, NO_DRIVER)
    assert not gpu_env.has_nvidia_driver()
    gpu_env.check_driver_gpus(DRIVER_CONFIG)
    text = gpu_check(SDPA, where="actor worker (actor_rollout) rank 0 on n1", run_kernel=True)
    assert "no NVIDIA driver is loaded" in text and "R580" in text


def test_gpu_facts_reads_this_machine():
    facts = gpu_env.gpu_facts()
    import torch

    assert facts.torch_version == str(torch.__version__) and facts.cuda_available == torch.cuda.is_available()
    assert facts.flash_attn_error is None and facts.device_count == (torch.cuda.device_count() if
                                                                      facts.cuda_available else 0)
