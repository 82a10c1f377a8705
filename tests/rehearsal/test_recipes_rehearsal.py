"""Every recipe's own configuration, rehearsed through ``python -m verl.trainer.main_ppo`` on a two-node Ray cluster
with declared GPUs, up to the first call that needs CUDA (docs/verl_integration.md#the-declared-gpu-rehearsal).

The recipe script itself runs (``recipes/run.sh <recipe> <mode>``, ``recipes/smoke_qwen3_1gpu.sh``), with the hub model swapped for a tiny random model of
the same family (``MODEL_PATH``), small local parquet files (``DATA_DIR``), a stub judge on the host's address
(``JUDGE_BASE_URL``), two nodes (``NNODES=2``; the 1-GPU smoke keeps its one node) and the cluster's address
(``RAY_ADDRESS``). Every process sees a GPU node's CUDA and driver facts at the one seam of
``setgrpo_verl.integration.gpu_env`` (``site/sitecustomize.py``); torch, Ray, verl and this package run as they are.
The run passes Hydra, the callback's checks and judge probe, ``ray.init``, the TaskRunner, the trainer's construction
and the placement of its worker groups, and must then stop in torch, verl or transformers code on CUDA (or a
CUDA-only package) - never in this package's code and never with a SetGRPO refusal.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from .conftest import GPU_NODE, rehearsal_environ, tiny_model

REPO = Path(__file__).resolve().parents[2]
RAY = f"ray{ray.__version__}"
#: A node whose driver is older than R580 while CUDA 13 runs through NVIDIA's forward-compatibility libraries.
COMPAT_DRIVER = {"SETGRPO_REHEARSAL_GPU": "cuda", "SETGRPO_REHEARSAL_DRIVER": "550.54.15"}
#: recipe -> (model family, mode, GPUs per node of its two nodes, the node's facts): every recipe calibrates, the
#: smoke recipe runs its own mode on its one GPU; each recipe's GPUs hold at least one rollout replica (its TP).
RECIPES = {
    "qwen3_4b": ("qwen3", "calibrate", 1, GPU_NODE),
    "qwen3_14b": ("qwen3", "calibrate", 2, GPU_NODE),  # rollout TP 4
    "qwen3_5_4b": ("qwen3_5", "calibrate", 1, GPU_NODE),
    "qwen3_5_9b": ("qwen3_5", "calibrate", 1, GPU_NODE),
    "llama3_2_3b": ("llama", "calibrate", 1, COMPAT_DRIVER),
    "smoke_qwen3_1gpu": ("qwen3", None, 1, GPU_NODE),
}
#: What the first CUDA call raises on this machine's CPU build of torch: verl's workers start their process group
#: with NCCL, and torch's ``init_process_group`` refuses.
CUDA_STOP = re.compile(r"Distributed package doesn't have NCCL built in|Torch not compiled with CUDA enabled")
#: The overrides each rehearsal adds after the recipe's own: calibration reads the 8 local prompts; one TransferQueue
#: storage unit instead of verl's default of several (each a Ray actor process, seconds of CI time per run); and the
#: policy loads with torch's attention, since with flash-attn (the recipes' default) the first CUDA call of a worker
#: would be its GPU-environment check's own flash-attn kernel (tests/integration/test_gpu_env.py covers that check).
OVERRIDES = ["algorithm.setgrpo.calibration.num_prompts=8", "data.train_batch_size=8",
             "actor_rollout_ref.actor.ppo_mini_batch_size=8",
             "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
             "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"]
_ACTOR_PREFIX = re.compile(r"^(\x1b\[\d+m)?\(\w*\s*pid=")


def last_raise(text: str) -> tuple[str, str]:
    """The innermost frame's file and the exception line of the last traceback the driver printed in ``text``
    (the actors' forwarded log lines, prefixed ``(... pid=N)``, left out)."""
    lines = [ln for ln in text.splitlines() if not _ACTOR_PREFIX.match(ln)]
    block = "\n".join(lines).rsplit("Traceback (most recent call last):", 1)[-1].splitlines()
    exc_at = max((i for i, ln in enumerate(block) if re.match(r"^[\w.]+(Error|Exception|Exit)\b", ln)), default=-1)
    frames = [m.group(1) for ln in block[:exc_at] for m in [re.search(r'File "([^"]+)", line \d+', ln)] if m]
    return (frames[-1] if frames else ""), (block[exc_at] if exc_at >= 0 else "")


def packed_qwen35_needs_fla() -> bool:
    """Whether this transformers' torch delta rule of Qwen3.5 (its fallback without flash-linear-attention) swallows
    ``cu_seqlens`` through ``**kwargs``, so that the check before Ray refuses packed sequences without
    flash-linear-attention (transformers 5.10); without ``**kwargs`` (5.5.3) verl splits the packed batch itself."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    params = inspect.signature(modeling_qwen3_5.torch_chunk_gated_delta_rule).parameters
    return any(p.kind == p.VAR_KEYWORD for p in params.values()) and "cu_seqlens" not in params


def seam_calls(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def run_recipe(name: str, mode, *extra: str, gpus: int, nodes: int, facts: dict, address: str, judge: str,
               data: Path, model: Path, run_root: Path):
    """``bash recipes/run.sh <name> <mode> OVERRIDES extra...`` (the smoke recipe: its own script) against the cluster at ``address``; its output is kept in
    ``run_root/main_ppo.log``."""
    run_root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHON": sys.executable, "MODEL_PATH": str(model), "DATA_DIR": str(data),
           "RUN_ROOT": str(run_root), "JUDGE_BASE_URL": judge, "RAY_ADDRESS": address, "HOME": str(run_root),
           "NNODES": str(nodes), "N_GPUS_PER_NODE": str(gpus), "HYDRA_FULL_ERROR": "1",
           "SETGRPO_SHARED_FS": "1",  # the two nodes are this one machine: the run folder is on every node's disk
           "SETGRPO_REHEARSAL_LOG": str(run_root / "seam.jsonl"), **rehearsal_environ(facts)}
    env.pop("WANDB_API_KEY", None)
    # the TaskRunner and the workers get the run's facts as Ray passes any variable: the job's runtime environment
    reach = [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}={env[k]}"
             for k in ("SETGRPO_REHEARSAL_GPU", "SETGRPO_REHEARSAL_DRIVER", "SETGRPO_REHEARSAL_LOG")]
    script = ([str(REPO / "recipes" / f"{name}.sh")] if name.startswith("smoke") else
              [str(REPO / "recipes" / "run.sh"), name, mode])
    argv = ["bash", *script, *OVERRIDES, *extra, *reach,
            f"hydra.run.dir={run_root / 'hydra'}"]
    start = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=run_root)
    (run_root / "main_ppo.log").write_text(proc.stdout + proc.stderr)
    return proc, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.rehearsal
@pytest.mark.timeout(900)
@pytest.mark.parametrize("recipe", list(RECIPES), ids=lambda r: f"{r}-{RAY}")
def test_recipe_rehearses_on_declared_gpus_until_verl_starts_nccl(recipe, declared_gpu_cluster, host_judge,
                                                                  rubric_data, tmp_path):
    family, mode, gpus, facts = RECIPES[recipe]
    nodes = 1 if recipe.startswith("smoke") else 2
    model = tiny_model(family, tmp_path / "model")
    run = dict(gpus=gpus, nodes=nodes, facts=facts, address=declared_gpu_cluster, judge=host_judge.url,
               data=rubric_data, model=model)
    extra = []
    if family == "qwen3_5" and packed_qwen35_needs_fla():
        # the recipe as it is stops before Ray here: packed sequences on Qwen3.5 need flash-linear-attention's
        # Triton kernels (the gpu extra), which a CPU machine lacks; the rehearsal goes on with padded sequences
        proc, _ = run_recipe(recipe, mode, run_root=tmp_path / "packed", **run)
        assert proc.returncode != 0 and "Install flash-linear-attention" in proc.stderr, proc.stderr[-3000:]
        assert "TaskRunner" not in proc.stdout + proc.stderr
        extra = ["actor_rollout_ref.model.use_remove_padding=false"]
    asked = len(host_judge.requests)
    proc, seconds = run_recipe(recipe, mode, *extra, run_root=tmp_path, **run)
    log = proc.stdout + proc.stderr
    where, exc = last_raise(log)
    print(f"{recipe} {RAY}: {seconds:.0f} s, stopped in {where}: {exc}")
    assert proc.returncode != 0, log[-4000:]
    # past the checks before Ray and the judge probe, on the declared-GPU cluster (not a Ray of its own)
    assert len(host_judge.requests) > asked, "the callback's judge probe never reached the judge"
    assert "Started a local Ray instance" not in log and "TaskRunner" in log, log[-4000:]
    # the actor workers, one per declared GPU, each on its own GPU, passed their GPU-environment check
    calls = seam_calls(tmp_path / "seam.jsonl")
    workers = [c for c in calls if "worker:__init__" in c["frames"]]
    assert len(workers) == gpus * nodes, calls
    assert all(c["cuda_visible_devices"] not in (None, "") for c in workers), workers
    # the driver checked before Ray; the TaskRunner, a Ray actor without GPUs, checks nothing
    assert [c for c in calls if "gpu_env:check_driver_gpus" in c["frames"] and "run_check:on_job_start" in c["frames"]]
    assert not [c for c in calls if "trainer:__init__" in c["frames"]], calls
    # then it stopped at the first CUDA call, in torch, outside this package, with no SetGRPO refusal
    assert "/setgrpo_verl/" not in where and "/torch/" in where, (where, exc, log[-4000:])
    assert CUDA_STOP.search(exc) and "setgrpo" not in exc.lower(), (where, exc, log[-4000:])


@pytest.mark.slow
@pytest.mark.rehearsal
@pytest.mark.timeout(600)
def test_smoke_recipe_on_a_node_without_a_driver_stops_at_the_workers_check_naming_it(
        declared_gpu_cluster, host_judge, rubric_data, tmp_path):
    """No NVIDIA driver anywhere: the driver has nothing to check before Ray, and the actor worker refuses when it
    starts, before verl touches CUDA, naming the missing driver."""
    model = tiny_model("qwen3", tmp_path / "model")
    proc, seconds = run_recipe("smoke_qwen3_1gpu", None, gpus=1, nodes=1,
                               facts={"SETGRPO_REHEARSAL_GPU": "none", "SETGRPO_REHEARSAL_DRIVER": ""},
                               address=declared_gpu_cluster, judge=host_judge.url, data=rubric_data, model=model,
                               run_root=tmp_path)
    log = proc.stdout + proc.stderr
    where, exc = last_raise(log)
    print(f"smoke_qwen3_1gpu without a driver {RAY}: {seconds:.0f} s, stopped in {where}: {exc}")
    assert proc.returncode != 0 and where.endswith("setgrpo_verl/integration/worker.py"), (where, exc, log[-4000:])
    assert "CUDA is not available" in exc and "no NVIDIA driver is loaded" in exc, exc
    assert "actor worker (actor_rollout) rank 0" in exc, exc
    assert not CUDA_STOP.search(log), "verl reached CUDA before the worker's check"
    calls = seam_calls(tmp_path / "seam.jsonl")
    assert [c for c in calls if "worker:__init__" in c["frames"]]
    assert not [c for c in calls if "gpu_env:gpu_check" in c["frames"] and "run_check:on_job_start" in c["frames"]]


@pytest.mark.slow
@pytest.mark.rehearsal
@pytest.mark.timeout(300)
def test_a_gpu_less_ray_actor_passes_the_check_before_ray(declared_gpu_cluster):
    """A Ray actor without GPUs, as verl's TaskRunner is: Ray 2.41-2.55 empty its ``CUDA_VISIBLE_DEVICES`` (torch then
    sees no GPU there), Ray 2.56 and later leave it unset. Either way the check before Ray does nothing in it (that
    check is the driver's), while a GPU check in it names the emptied variable (test ids carry the Ray version)."""
    from packaging.version import Version

    @ray.remote(num_gpus=0)
    class GpuLess:
        def check(self):
            from setgrpo_verl.integration import gpu_env

            config = {"actor_rollout_ref": {"model": {"override_config": {"attn_implementation": "sdpa"}}},
                      "trainer": {"device": "cuda"}}
            gpu_env.check_driver_gpus(config)  # raises ValueError where it refuses
            error = gpu_env.gpu_check(config["actor_rollout_ref"]["model"], where="a GPU-less actor", run_kernel=False)
            return os.environ.get("CUDA_VISIBLE_DEVICES"), error

    ray.init(address=declared_gpu_cluster, log_to_driver=False)
    try:
        actor = GpuLess.remote()
        visible, error = ray.get(actor.check.remote(), timeout=120)
    finally:
        ray.shutdown()
    if Version(ray.__version__) < Version("2.56"):
        assert visible == "" and "CUDA_VISIBLE_DEVICES is empty" in error, (visible, error)
    else:
        assert visible is None and error is None, (visible, error)
