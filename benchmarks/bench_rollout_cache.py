"""The CPU rollout's decoding with its preallocated key-value cache against ``transformers``' concatenating one.

On the embedded SmolLM2-135M-Instruct, one batch of ``--groups`` prompts of ``--prompt`` tokens, each sent ``--k``
times, decoded by ``TransformersRolloutServer`` with ``--response`` new tokens at temperature 1, the shared prompts'
cache either preallocated and written in place (the server's) or grown by concatenation every step. The two
alternate in one process (medians of ``--repeats`` rounds), so load from other processes hits them alike. It checks
first that both draw the same tokens and log-probs from one seed. The last line is the ratio preallocated /
concatenated. The default is float32: a bfloat16 server keeps ``generate``'s own prefill (docs/verl_integration.md,
the rollout replicas), so in bfloat16 both sides concatenate and the ratio says nothing.

    python benchmarks/bench_rollout_cache.py [--groups 16 --k 4 --prompt 96 --response 24 --dtype fp32]
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: what a CPU run sets

import torch  # noqa: E402

from harness import alternated, rollout_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16, help="groups per batch (64 responses: max_num_seqs)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=96, help="prompt tokens (the default profile's longest)")
    parser.add_argument("--response", type=int, default=24, help="new tokens (the default profile's)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()

    server, batch, key = rollout_batch(args.groups, args.k, args.prompt, args.response, args.dtype)

    def decode(preallocate: bool, seed: int | None = None):
        def run():
            server._preallocate = preallocate
            if seed is not None:
                torch.manual_seed(seed)
            return server._generate_batch(batch, key)
        return run

    first, second = decode(False, seed=3)(), decode(True, seed=3)()
    same = sum(a.token_ids == b.token_ids for a, b in zip(first, second))
    gap = max(abs(x - y) for a, b in zip(first, second) if a.token_ids == b.token_ids
              for x, y in zip(a.log_probs, b.log_probs))
    seconds = alternated({"concatenated": decode(False), "preallocated": decode(True)}, args.repeats)
    medians = {name: statistics.median(ts) for name, ts in seconds.items()}
    print(f"{args.groups} groups x K={args.k}, {args.prompt}+{args.response} tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads; same tokens in {same} of {len(batch)} responses, "
          f"largest log-prob difference {gap:.1e}")
    for name, ts in seconds.items():
        print(f"{name}: {medians[name]:.2f} s per batch ({', '.join(f'{t:.2f}' for t in ts)})")
    print(f"preallocated / concatenated: {medians['preallocated'] / medians['concatenated']:.3f}")


if __name__ == "__main__":
    main()
