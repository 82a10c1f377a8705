"""The CPU rollout's decoding of one batch of groups, each distinct prompt prefilled once against once per request.

On the embedded SmolLM2-135M-Instruct, one batch of ``--groups`` prompts of ``--prompt`` tokens, each sent ``--k``
times (a group's responses, as verl's agent loop sends them), decoded by ``TransformersRolloutServer`` with
``--response`` new tokens at temperature 1. The two passes alternate in one process (medians of ``--repeats``
rounds), so load from other processes hits them alike:

* ``per_request``: ``generate`` prefills every request's prompt (the server without shared prompts);
* ``shared``: every distinct prompt prefilled once, its KV cache repeated for the K requests.

The last line is the ratio shared / per_request.

    python benchmarks/bench_rollout_prefill.py [--groups 16 --k 4 --prompt 128 --response 48 --dtype fp32]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from harness import alternated, rollout_batch



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (the validate and paper profiles)")
    parser.add_argument("--response", type=int, default=48, help="new tokens (the validate and paper profiles)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    server, batch, key = rollout_batch(args.groups, args.k, args.prompt, args.response, args.dtype)

    def decode(share: bool):
        def run():
            server._share_prompts = share
            server._generate_batch(batch, key)
        return run

    seconds = alternated({"per_request": decode(False), "shared": decode(True)}, args.repeats)
    medians = {name: statistics.median(ts) for name, ts in seconds.items()}
    print(f"{args.groups} groups x K={args.k}, {args.prompt}+{args.response} tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    for name, s in medians.items():
        print(f"{name}: {s:.2f} s per batch, {s / args.groups:.2f} s per group")
    print(f"shared / per_request: {medians['shared'] / medians['per_request']:.2f}")


if __name__ == "__main__":
    main()
