"""The fused old-log-prob + sketch pass against verl's plain old-log-prob pass, with and without skipped rows.

On the embedded SmolLM2-135M-Instruct through verl's engine code (``benchmarks/_engine.py``), one batch of
``--groups`` groups of ``--k`` responses; a share ``--degenerate`` of the groups is marked as not to sketch
(``setgrpo_sketch_rows``, what the trainer does for groups whose point scores are tied). The passes alternate in one
process (medians of ``--repeats`` rounds), so load from other processes hits them alike:

* ``plain``: verl's own log-prob pass (the engine's ``forward_step`` without a loss, no grad);
* ``fused``: ``sketch_and_log_probs`` on every row (one forward + one activation-only backward per micro-batch);
* ``fused_skip``: the same with the degenerate groups' rows forward-only.

``--profile`` adds the operator table of one fused pass (torch.profiler, self CPU time). The last lines are the ratios,
after the floor that multiply-adds set for any exact fused pass (``floors.sketch_pass``, docs/sketch.md#speed).

    python benchmarks/bench_sketch_pass.py [--groups 4 --k 4 --prompt 96 --response 24 --micro 16 --dtype bf16]
"""

from __future__ import annotations

import argparse
import statistics

from _engine import PlainEngine  # before verl: selects verl's CPU platform
from bench_integration import _batch, _log_prob_forward
from floors import sketch_pass
from harness import alternated

import torch

from verl.utils import tensordict_utils as tu

from setgrpo_verl.integration.worker import SKETCH_ROWS_KEY, sketch_and_log_probs
from setgrpo_verl.models import load_causal_lm
from setgrpo_verl.sketch import SketchConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--response", type=int, default=24)
    ap.add_argument("--micro", type=int, default=16, help="rows per micro-batch (verl's micro_batch_size_per_gpu)")
    ap.add_argument("--degenerate", type=float, default=0.5, help="share of the groups not to sketch")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the engine's autocast dtype")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, _ = load_causal_lm()
    model.eval()
    b = args.groups * args.k
    data = _batch(b, args.prompt, args.response, model.config.vocab_size)
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=min(args.micro, b))
    engine = PlainEngine(model, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    cfg = SketchConfig()
    skipped_groups = round(args.groups * args.degenerate)
    rows = torch.ones(b, dtype=torch.bool)
    rows[: skipped_groups * args.k] = False  # the first groups' rows (rows of a group are contiguous here)
    masked = data.clone()
    masked[SKETCH_ROWS_KEY] = rows

    passes = {
        "plain": lambda: _log_prob_forward(engine, data),
        "fused": lambda: sketch_and_log_probs(engine, data, cfg, loss_agg_mode="token-mean"),
        "fused_skip": lambda: sketch_and_log_probs(engine, masked, cfg, loss_agg_mode="token-mean"),
    }
    measured = alternated(passes, args.repeats)
    t = {name: statistics.median(v) for name, v in measured.items()}
    print(f"SmolLM2-135M, {args.dtype}, {args.groups} groups x K={args.k}, ({args.prompt}+{args.response}) tokens, "
          f"micro-batch {min(args.micro, b)}, threads {args.threads}, {skipped_groups} group(s) not sketched")
    for name, v in measured.items():
        print(f"  {name:<11} median {t[name]:7.3f} s   ({', '.join(f'{x:.3f}' for x in v)})")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            passes["fused"]()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    fl = sketch_pass(model.config, cfg, args.prompt, args.response, min(args.micro, b))
    print(f"multiply-adds per token: forward {fl['F'] / 1e6:.1f} M, activation-only backward {fl['B'] / 1e6:.1f} M, "
          f"projections {fl['S'] / 1e6:.1f} M; exact floor of fused / plain {fl['floor']:.2f}")
    print(f"per group: plain {t['plain'] / args.groups:.3f} s, fused {t['fused'] / args.groups:.3f} s")
    print(f"fused / plain old-log-prob pass: {t['fused'] / t['plain']:.3f} (target <= 1.9)")
    print(f"fused with {skipped_groups}/{args.groups} groups forward-only / plain: {t['fused_skip'] / t['plain']:.3f}")
    print(f"fused with skipped groups / fused on every row: {t['fused_skip'] / t['fused']:.3f}")


if __name__ == "__main__":
    main()
