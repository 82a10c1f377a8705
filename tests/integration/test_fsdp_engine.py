"""The worker's sketch pass under FSDP1 (verl's default) and FSDP2 on two gloo CPU ranks equals the single-process
pass, and FSDP1 units are resharded during the activation-only backward (docs/sketch.md#memory).

Each rank builds the same tiny random Llama, computes single-process reference sketches and log-probs of its rows
(plain module), then wraps a copy as verl wraps the actor (gradient checkpointing on) and reruns the worker's sketch
pass in both layouts.  It also records how many FSDP1 units (FSDP2 groups) are unsharded when the backward reaches
the input embedding (the end of the sketch backward): FSDP1 reshards in AccumulateGrad hooks, which the
activation-only backward does not run.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from tests.gloo_ranks import run_two_gloo_ranks, wrap_like_verl
from tests.integration._engine import BareEngine, nested_batch, use_cpu_platform
from tests.sketch._tiny import tiny_llama


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


def engine_rank(rank: int, world: int) -> dict:
    """One rank of :func:`test_fsdp1_and_fsdp2_two_gloo_ranks_match_one_process_and_fsdp1_reshards`."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from setgrpo_verl.integration import worker
    from setgrpo_verl.sketch import SketchConfig

    use_cpu_platform()
    result = {}
    model = tiny_llama(dtype=torch.float32, layers=3)
    rows = _rows(world)
    mine = slice(3 * rank, 3 * rank + 3)
    cfg = SketchConfig(rank_out=2, rank_in=2, copies=4, seed=7)
    ref_sk, ref_lp = worker.sketch_and_log_probs(BareEngine(copy.deepcopy(model)), _data(rows, mine, False), cfg,
                                                 loss_agg_mode="token-mean")
    errors, unsharded = {}, {}
    for strategy in ("fsdp-without-reshard", "fsdp", "fsdp2"):
        # the control: FSDP1 without the sketch's reshard hooks (what the activation-only backward alone does)
        reshard = worker.fsdp1_reshard_in_backward
        if strategy == "fsdp-without-reshard":
            worker.fsdp1_reshard_in_backward = lambda module: contextlib.nullcontext()
        wrapped = copy.deepcopy(model)
        wrapped.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        wrapped = wrap_like_verl(wrapped, "fsdp2" if strategy == "fsdp2" else "fsdp", world)
        count = _unsharded_fsdp2_groups if strategy == "fsdp2" else _unsharded_fsdp1_units
        seen = []

        def probe(module, args, output, seen=seen, wrapped=wrapped, count=count):
            if output.requires_grad:  # fires when the backward reaches the input embedding
                output.register_hook(lambda g: seen.append(count(wrapped)))

        wrapped.get_input_embeddings().register_forward_hook(probe)
        engine = BareEngine(wrapped)
        for packed in (False, True):
            sk, lp = worker.sketch_and_log_probs(engine, _data(rows, mine, packed), cfg, loss_agg_mode="token-mean")
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
    result["ok"] = all(v <= 1e-4 for v in errors.values()) and result["fsdp/grad_none"] and result["fsdp2/grad_none"]
    return result


@pytest.mark.slow
def test_fsdp1_and_fsdp2_two_gloo_ranks_match_one_process_and_fsdp1_reshards(tmp_path):
    results, proc = run_two_gloo_ranks(f"{__name__}:engine_rank", tmp_path)
    for res in results:
        assert "traceback" not in res, res["traceback"]
        for key, err in res["errors"].items():  # both strategies, padded and packed, sketches and log-probs
            assert err <= 1e-4, (res["rank"], key, err)
        assert res["fsdp/grad_none"] and res["fsdp2/grad_none"]
        seen = res["unsharded_at_embedding"]
        units = seen["fsdp_units"]  # 3 decoder layers + the root
        # the activation-only backward alone leaves every unit unsharded until the end of the backward ...
        assert seen["fsdp-without-reshard"] == [units, units]
        # ... with the sketch's hooks only the root and the first layer are still unsharded at the embedding; FSDP2
        # needs no hook for that (it reshards from the gradient of each unit's inputs)
        assert seen["fsdp"] == [2, 2] and seen["fsdp2"] == [2, 2]
        assert seen["fsdp/after"] == seen["fsdp-without-reshard/after"] == seen["fsdp2/after"] == 0
        assert res["ok"]
    assert proc.returncode == 0, proc.stderr[-5000:]
