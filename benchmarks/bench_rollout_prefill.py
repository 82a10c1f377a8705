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

from harness import alternated

from setgrpo_verl.models import embedded_model_dir
from setgrpo_verl.verl_cpu.rollout import TransformersRolloutServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (the validate and paper profiles)")
    parser.add_argument("--response", type=int, default=48, help="new tokens (the validate and paper profiles)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    server = TransformersRolloutServer(str(embedded_model_dir()), response_length=args.response,
                                       max_batch_size=args.groups * args.k, seed=0, dtype=dtype,
                                       num_threads=torch.get_num_threads())
    vocab = server.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.groups)]
    batch = [p for p in prompts for _ in range(args.k)]
    key = (1.0, 1.0, -1, args.response, True)  # temperature, top_p, top_k, new tokens, log-probs

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
