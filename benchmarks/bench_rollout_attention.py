"""The CPU rollout's decoding of one calibration batch with ``sdpa`` attention (the server's) against ``eager``.

On the embedded SmolLM2-135M-Instruct, one batch of ``--groups`` prompts of ``--prompt`` tokens, each sent ``--k``
times, decoded by ``TransformersRolloutServer`` with ``--response`` new tokens at temperature 1, once by a server
with each attention. The defaults are one calibration batch of the quickstart (32 groups x K=4, 96 + 24 tokens,
bf16). The two servers alternate in one process (medians of ``--repeats`` rounds), so load from other processes hits
them alike. The last line is the ratio sdpa / eager.

    python benchmarks/bench_rollout_attention.py [--groups 32 --k 4 --prompt 96 --response 24 --dtype bf16]
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
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=96, help="prompt tokens (the quickstart's longest)")
    parser.add_argument("--response", type=int, default=24, help="new tokens (the quickstart's)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    servers = {
        attn: TransformersRolloutServer(str(embedded_model_dir()), response_length=args.response,
                                        max_batch_size=args.groups * args.k, seed=0, dtype=dtype,
                                        num_threads=torch.get_num_threads(), attn_implementation=attn)
        for attn in ("eager", "sdpa")
    }
    vocab = servers["sdpa"].tokenizer.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.groups)]
    batch = [p for p in prompts for _ in range(args.k)]
    key = (1.0, 1.0, -1, args.response, True)  # temperature, top_p, top_k, new tokens, log-probs

    seconds = alternated({attn: (lambda s=s: s._generate_batch(batch, key)) for attn, s in servers.items()},
                         args.repeats)
    medians = {attn: statistics.median(ts) for attn, ts in seconds.items()}
    print(f"{args.groups} groups x K={args.k}, {args.prompt}+{args.response} tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    for attn, s in medians.items():
        print(f"{attn}: {s:.2f} s per batch, {s / args.groups:.3f} s per group")
    print(f"sdpa / eager: {medians['sdpa'] / medians['eager']:.2f}")


if __name__ == "__main__":
    main()
