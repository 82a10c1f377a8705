"""A worker rank's sketch pass on one torch thread (Ray's default for an actor) against the cores the CPU backend
gives it (``setgrpo_verl.verl_cpu.platform.rank_threads``, docs/verl_integration.md#cpu-backend).

On the embedded SmolLM2-135M-Instruct through verl's engine code (``benchmarks/_engine.py``), the fused old-log-prob +
sketch pass over ``--groups`` x ``--k`` responses of ``--prompt`` + ``--response`` tokens in micro-batches of
``--micro``, float32; by default 16 responses at the paper profile's lengths, a quarter of one of its batches. The
two thread counts alternate in one process (medians of ``--repeats`` rounds), so load from other processes hits
them alike. The last line is the ratio.

    python benchmarks/bench_rank_threads.py [--groups 4 --k 4 --prompt 128 --response 48 --micro 4 --repeats 4]
"""

from __future__ import annotations

import argparse
import os
import statistics

from _engine import PlainEngine  # before verl: selects verl's CPU platform
from bench_integration import _batch
from harness import alternated

import torch

from verl.utils import tensordict_utils as tu

from setgrpo_verl.integration.worker import sketch_and_log_probs
from setgrpo_verl.models import load_causal_lm
from setgrpo_verl.sketch import SketchConfig
from setgrpo_verl.verl_cpu.platform import rank_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=48)
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch (verl's micro_batch_size_per_gpu)")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()

    cores = rank_threads(len(os.sched_getaffinity(0)), 1)
    model, _ = load_causal_lm()
    model.eval()
    b = args.groups * args.k
    data = _batch(b, args.prompt, args.response, model.config.vocab_size)
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=min(args.micro, b))
    engine = PlainEngine(model, torch.float32)
    cfg = SketchConfig()

    def sketch_pass(threads: int):
        def run():
            torch.set_num_threads(threads)
            return sketch_and_log_probs(engine, data, cfg, loss_agg_mode="token-mean")
        return run

    measured = alternated({"one thread": sketch_pass(1), f"{cores} threads": sketch_pass(cores)}, args.repeats)
    t = {name: statistics.median(v) for name, v in measured.items()}
    print(f"SmolLM2-135M, float32, {args.groups} groups x K={args.k}, ({args.prompt}+{args.response}) tokens, "
          f"micro-batch {min(args.micro, b)}, one rank on {cores} cores")
    for name, v in measured.items():
        print(f"  {name:<11} median {t[name]:7.3f} s   ({', '.join(f'{x:.3f}' for x in v)})")
    print(f"sketch pass on the rank's {cores} threads / on one thread: {t[f'{cores} threads'] / t['one thread']:.3f}")


if __name__ == "__main__":
    main()
