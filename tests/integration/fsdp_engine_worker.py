"""torchrun worker for tests/integration/test_fsdp_engine.py: the worker's sketch pass through verl's engine code
under FSDP1 (verl's default strategy) and FSDP2 on gloo CPU ranks, gradient checkpointing on, both layouts.

Each rank builds the same tiny random Llama, computes single-process reference sketches and log-probs of its rows
(plain module), then wraps a copy as verl wraps the actor (FSDP1: ``FullyShardedDataParallel`` with verl's
``get_fsdp_wrap_policy``, full shard; FSDP2: ``apply_fsdp2``) and reruns the sketch pass.  It also records how many
FSDP1 units are unsharded when the backward reaches the input embedding (the end of the sketch backward): FSDP1
reshards in AccumulateGrad hooks, which the activation-only backward does not run; FSDP2 units are counted
the same way.  Writes ``rank<r>.json`` into argv[1]; exits non-zero on failure.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from tests.integration._engine import BareEngine, nested_batch, use_cpu_platform  # noqa: E402
from tests.sketch._tiny import tiny_llama  # noqa: E402


def _rows(world: int):
    g = torch.Generator().manual_seed(9)
    n = 3 * world
    prompts = [torch.randint(1, 96, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g) for _ in range(n)]
    responses = [torch.randint(1, 96, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g) for _ in range(n)]
    return prompts, responses, [torch.ones_like(r) for r in responses]


def _data(rows, sl, packed: bool):
    from verl.utils import tensordict_utils as tu

    td = nested_batch(*(r[sl] for r in rows))
    tu.assign_non_tensor(td, use_remove_padding=packed, use_dynamic_bsz=False, micro_batch_size_per_gpu=3,
                         temperature=0.7)
    return td


def _unsharded_fsdp1_units(model) -> int:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    count = 0
    for m in model.modules():
        if isinstance(m, FSDP) and m._handle is not None:
            fp = m._handle.flat_param
            count += int(fp.data_ptr() != fp._local_shard.data_ptr())
    return count


def _unsharded_fsdp2_groups(model) -> int:
    from torch.distributed.fsdp import FSDPModule

    count = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            count += int(group is not None and group.is_unsharded)
    return count


def main(out_dir: str) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "ok": False}
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, ShardingStrategy

        from verl.utils.fsdp_utils import apply_fsdp2, get_fsdp_wrap_policy

        from setgrpo_verl.integration.worker import sketch_and_log_probs
        from setgrpo_verl.sketch import SketchConfig

        torch.set_num_threads(1)
        use_cpu_platform()
        model = tiny_llama(dtype=torch.float32, layers=3)
        rows = _rows(world)
        mine = slice(3 * rank, 3 * rank + 3)
        cfg = SketchConfig(rank_out=2, rank_in=2, copies=4, seed=7)
        ref_sk, ref_lp = sketch_and_log_probs(BareEngine(copy.deepcopy(model)), _data(rows, mine, False), cfg,
                                              loss_agg_mode="token-mean")
        errors, unsharded = {}, {}
        from setgrpo_verl.integration import worker

        for strategy in ("fsdp-without-reshard", "fsdp", "fsdp2"):
            # the control: FSDP1 without the sketch's reshard hooks (what the activation-only backward alone does)
            reshard = worker.fsdp1_reshard_in_backward
            if strategy == "fsdp-without-reshard":
                worker.fsdp1_reshard_in_backward = lambda module: contextlib.nullcontext()
            wrapped = copy.deepcopy(model)
            wrapped.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            seen = []
            if strategy.startswith("fsdp-") or strategy == "fsdp":
                fp32 = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                      buffer_dtype=torch.float32)
                wrapped = FSDP(wrapped, auto_wrap_policy=get_fsdp_wrap_policy(wrapped, config=None),
                               sharding_strategy=ShardingStrategy.FULL_SHARD, mixed_precision=fp32,
                               use_orig_params=False, device_id=torch.device("cpu"))  # verl: get_device_id()
                count = _unsharded_fsdp1_units
            else:
                mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
                mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                          cast_forward_inputs=True)
                apply_fsdp2(wrapped, {"mesh": mesh, "mp_policy": mp, "offload_policy": None,
                                      "reshard_after_forward": True}, {})
                count = _unsharded_fsdp2_groups

            def probe(module, args, output, seen=seen, wrapped=wrapped, count=count):
                if output.requires_grad:  # fires when the backward reaches the input embedding
                    output.register_hook(lambda g: seen.append(count(wrapped)))

            wrapped.get_input_embeddings().register_forward_hook(probe)
            engine = BareEngine(wrapped)
            for packed in (False, True):
                sk, lp = sketch_and_log_probs(engine, _data(rows, mine, packed), cfg, loss_agg_mode="token-mean")
                errors[f"{strategy}/packed={packed}"] = float(((sk - ref_sk).norm(dim=1) / ref_sk.norm(dim=1)).max())
                errors[f"{strategy}/packed={packed}/log_probs"] = float(
                    max((a - b).abs().max() for a, b in zip(lp.unbind(), ref_lp.unbind())))
            worker.fsdp1_reshard_in_backward = reshard
            result[f"{strategy}/grad_none"] = all(p.grad is None for p in wrapped.parameters())
            unsharded[strategy] = seen
            unsharded[f"{strategy}/after"] = count(wrapped)
            if strategy == "fsdp":
                unsharded["fsdp_units"] = sum(1 for m in wrapped.modules() if isinstance(m, FSDP))
        result["errors"] = errors
        result["unsharded_at_embedding"] = unsharded
        result["ok"] = (all(v <= 1e-4 for v in errors.values()) and result["fsdp/grad_none"]
                        and result["fsdp2/grad_none"])
    except Exception:  # report the failure to the test through the JSON file
        result["traceback"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
