"""Two gloo CPU ranks for the FSDP tests: the launcher, the per-rank entry point, and a model wrapped as verl wraps
the actor.

A test names a rank function ``"package.module:function"``; :func:`run_two_gloo_ranks` starts this file under
``torch.distributed.run`` on 2 CPU ranks, each rank calls ``function(rank, world)`` and writes the returned dict (or
the traceback of its exception) to ``out_dir/rank{r}.json``; the test asserts on both ranks' dicts.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def run_two_gloo_ranks(target: str, out_dir, *, timeout: float = 600):
    """Run the rank function ``target`` (``"module:function"``) on 2 gloo CPU ranks.

    Returns:
        ``(results, proc)``: both ranks' dicts (asserting that each rank wrote one, with the run's output) and the
        finished ``subprocess.CompletedProcess`` (return code 0 when both ranks returned ``ok`` true).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, target,
           str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    results = []
    for rank in range(2):
        path = Path(out_dir) / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        results.append(json.loads(path.read_text()))
    return results, proc


def wrap_like_verl(model: torch.nn.Module, strategy: str, world: int, *, param_dtype: torch.dtype = torch.float32,
                   offload: bool = False) -> torch.nn.Module:
    """``model`` sharded over the ``world`` gloo ranks as verl 0.9.1's FSDP engine shards the actor.

    Args:
        strategy: ``"fsdp"`` (FSDP1 ``FullyShardedDataParallel`` with verl's ``get_fsdp_wrap_policy``, full shard,
            ``use_orig_params=False``) or ``"fsdp2"`` (``verl.utils.fsdp_utils.apply_fsdp2``).
        param_dtype: the mixed-precision compute dtype of the parameters (verl's default is bf16); reductions and
            buffers float32.
        offload: FSDP2 only: ``CPUOffloadPolicy`` (verl's ``offload_policy``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from verl.utils.fsdp_utils import apply_fsdp2, get_fsdp_wrap_policy

    if strategy == "fsdp":
        mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
        return FSDP(model, auto_wrap_policy=get_fsdp_wrap_policy(model, config=None),
                    sharding_strategy=ShardingStrategy.FULL_SHARD, mixed_precision=mp, use_orig_params=False,
                    device_id=torch.device("cpu"))  # verl: get_device_id()
    if strategy != "fsdp2":
        raise ValueError(f"strategy must be 'fsdp' or 'fsdp2', got {strategy!r}")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)
    policy = CPUOffloadPolicy(pin_memory=False) if offload else None
    apply_fsdp2(model, {"mesh": mesh, "mp_policy": mp, "offload_policy": policy, "reshard_after_forward": True}, {})
    return model


def _main(target: str, out_dir: str) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    result = {"rank": rank, "ok": False}
    try:
        module, name = target.split(":")
        result.update(getattr(importlib.import_module(module), name)(rank, world))
    except Exception:  # reported to the test through the JSON file
        result["traceback"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(_main(sys.argv[1], sys.argv[2]))
