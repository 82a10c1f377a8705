"""torchrun worker for tests/sketch/test_fsdp.py: sketches under verl's own FSDP2 wrapping on gloo CPU ranks.

Each rank builds the same tiny random Llama, computes single-process reference sketches for its responses,
wraps the model with ``verl.utils.fsdp_utils.apply_fsdp2`` (decoder layers, untied embedding and LM head, root)
and recomputes the sketches (padded and packed layouts).  Afterwards a normal backward must still work and
produce the data-parallel mean gradient, i.e. the sketch pass left FSDP's gradient state untouched.
Writes ``rank<r>.json`` into the output directory given as argv[1]; exits non-zero on failure.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from setgrpo_verl.sketch import SketchConfig, compute_sketches  # noqa: E402
from tests.sketch._tiny import tiny_llama, verl_batch  # noqa: E402


def _objective(model, ids, am, rm):
    pos = torch.clip(am.cumsum(-1) - 1, min=0)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
    t_resp = rm.shape[1]
    lp = torch.log_softmax(logits[:, -t_resp - 1 : -1].float(), -1).gather(-1, ids[:, -t_resp:, None]).squeeze(-1)
    return (lp * rm).sum()


def main(out_dir: str) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "ok": False}
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from verl.utils.fsdp_utils import apply_fsdp2

        torch.set_num_threads(1)
        model = tiny_llama(dtype=torch.float32)
        reference = copy.deepcopy(model)
        ids, am, rm = verl_batch(bsz=2 * world)
        mine = slice(2 * rank, 2 * rank + 2)
        cfg = SketchConfig(rank_out=2, rank_in=2, copies=4, seed=7, include_embeddings=True)
        ref = compute_sketches(reference, ids[mine], am[mine], rm[mine], cfg)
        ref_full = compute_sketches(reference, ids, am, rm, cfg)

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)
        apply_fsdp2(model, {"mesh": mesh, "mp_policy": mp, "offload_policy": None, "reshard_after_forward": True}, {})
        sharded = [p for p in model.parameters() if type(p.data).__name__ == "DTensor"]
        result["num_dtensor_params"] = len(sharded)

        errors = {}
        for packed in (False, True):
            out = compute_sketches(model, ids[mine], am[mine], rm[mine], cfg, use_remove_padding=packed)
            scale = ref.sketches.abs().max().item()
            errors[f"packed={packed}"] = (out.sketches - ref.sketches).abs().max().item() / scale
            errors[f"packed={packed}/vs_full"] = (out.sketches - ref_full.sketches[mine]).abs().max().item() / scale
            errors[f"packed={packed}/log_probs"] = (out.log_probs - ref.log_probs).abs().max().item()
        result["errors"] = errors
        result["grad_none_after_sketch"] = all(p.grad is None for p in model.parameters())

        # FSDP state untouched: a normal backward gives the data-parallel mean of the per-rank gradients.
        _objective(model, ids[mine], am[mine], rm[mine]).backward()
        grads = []
        for b in range(world):
            reference.zero_grad(set_to_none=True)
            sl = slice(2 * b, 2 * b + 2)
            _objective(reference, ids[sl], am[sl], rm[sl]).backward()
            grads.append({n: p.grad.clone() for n, p in reference.named_parameters()})
        worst = 0.0
        for n, p in model.named_parameters():
            full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            expect = sum(g[n] for g in grads) / world
            worst = max(worst, (full - expect).abs().max().item() / (expect.abs().max().item() + 1e-12))
        result["dp_grad_rel_err"] = worst
        result["ok"] = (
            result["grad_none_after_sketch"]
            and len(sharded) > 0
            and all(v < 1e-4 for v in errors.values())
            and worst < 1e-4
        )
    except Exception:  # report the failure to the test through the JSON file
        result["traceback"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
