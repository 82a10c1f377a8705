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
    ref_sk, ref_lp, _ = worker.sketch_and_log_probs(BareEngine(copy.deepcopy(model)), _data(rows, mine, False), cfg,
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
            sk, lp, _ = worker.sketch_and_log_probs(engine, _data(rows, mine, packed), cfg, loss_agg_mode="token-mean")
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


def _uneven_rows(rank: int, world: int):
    """Rank r's rows: rank 0 short sequences, rank 1 long ones, so a token budget gives them unequal micro-batch
    counts (verl then pads the shorter list with empty micro-batches: ``same_micro_num_in_dp``)."""
    g = torch.Generator().manual_seed(11)
    rows = []
    for r in range(world):
        n_tok = 3 if r == 0 else 9
        prompts = [torch.randint(1, 96, (n_tok,), generator=g) for _ in range(4)]
        responses = [torch.randint(1, 96, (n_tok,), generator=g) for _ in range(4)]
        rows.append((prompts, responses, [torch.ones_like(x) for x in responses]))
    return rows[rank]


def gpu_like_rank(rank: int, world: int) -> dict:
    """One rank of :func:`test_bf16_offloaded_uneven_micro_batches_and_one_failing_rank_on_two_gloo_ranks`: FSDP2
    with bf16 parameters and CPU offload under the engine's eval mode, a token budget giving the ranks 2 and 4
    micro-batches, then non-finite log-probs on rank 1 only."""
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu

    from setgrpo_verl.integration import worker
    from setgrpo_verl.sketch import SketchConfig

    use_cpu_platform()
    result = {}
    model = tiny_llama(dtype=torch.float32, layers=2)
    prompts, responses, masks = _uneven_rows(rank, world)
    cfg = SketchConfig(rank_out=2, rank_in=2, copies=4, seed=3)

    def data():
        td = nested_batch(prompts, responses, masks)
        tu.assign_non_tensor(td, use_remove_padding=True, use_dynamic_bsz=True, max_token_len_per_gpu=20,
                             temperature=1.0)
        return td

    ref_sk, _, _ = worker.sketch_and_log_probs(BareEngine(copy.deepcopy(model)), data(), cfg, loss_agg_mode="token-mean")
    bf16 = copy.deepcopy(model)
    bf16.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrapped = wrap_like_verl(bf16, "fsdp2", world, param_dtype=torch.bfloat16, offload=True)
    engine = BareEngine(wrapped, autocast_dtype=torch.bfloat16)
    engine.get_data_parallel_group = lambda: dist.group.WORLD
    calls = []
    original = worker._sketch_micro_batch

    def counting(*args):
        calls.append(1)
        return original(*args)

    worker._sketch_micro_batch = counting
    sk, _, _ = worker.sketch_and_log_probs(engine, data(), cfg, loss_agg_mode="token-mean")
    worker._sketch_micro_batch = original
    result["micro_batches"] = len(calls)
    gram, gram_ref = sk.double() @ sk.double().T, ref_sk.double() @ ref_sk.double().T
    result["bf16_gram_rel_err"] = float((gram - gram_ref).abs().max() / gram_ref.abs().max())
    result["grad_none"] = all(p.grad is None for p in wrapped.parameters())

    if rank == 1:  # a rank-local fault between the forward and the sketch backward
        def poison(module, args, output):
            return output.index_fill(-1, torch.tensor([5]), float("nan"))

        wrapped.model.norm.register_forward_hook(poison)  # inside the root unit: FSDP's own hooks unchanged
    try:
        worker.sketch_and_log_probs(engine, data(), cfg, loss_agg_mode="token-mean")
        result["raised"] = None
    except Exception as exc:  # every rank must raise, none may hang
        result["raised"] = f"{type(exc).__name__}: {exc}"
    result["ok"] = True
    return result


@pytest.mark.slow
def test_bf16_offloaded_uneven_micro_batches_and_one_failing_rank_on_two_gloo_ranks(tmp_path):
    results, proc = run_two_gloo_ranks(f"{__name__}:gpu_like_rank", tmp_path, timeout=400)
    for res in results:
        assert "traceback" not in res, res["traceback"]
        assert res["grad_none"]
        assert res["bf16_gram_rel_err"] < 0.05, res  # bf16 parameters keep the geometry
    # the token budget gives rank 0 two micro-batches and rank 1 four; verl splits rank 0's rows into four too
    assert [r["micro_batches"] for r in results] == [4, 4]
    r0, r1 = results[0]["raised"], results[1]["raised"]
    assert r1 is not None and r1.startswith("FloatingPointError: non-finite log-probabilities"), r1
    assert r0 is not None and r0.startswith("RuntimeError: the sketch pass failed on rank(s) [1]"), r0
    assert proc.returncode == 0, proc.stderr[-5000:]


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
