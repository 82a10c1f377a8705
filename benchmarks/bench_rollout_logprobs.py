"""The CPU rollout's log-probs of the sampled tokens: step by step from ``generate``'s logits (the server's) against
one log-softmax over the stacked ``[B, T, V]`` tensor divided by the temperature (before 4b87b26).

Random float32 logits of the comparison's rollout (``--rows`` 32 responses, ``--tokens`` 48 new tokens, the embedded
model's 49,152-token vocabulary) stand in for ``generate``'s; the two ways alternate in one process (medians of
``--repeats`` rounds). It checks first that both give the same numbers bit for bit, and prints the bytes of the
[B, T, V] float32 tensors the stacked way allocates (the stack, its division, its log-softmax). The last line is the
ratio step by step / stacked.

    python benchmarks/bench_rollout_logprobs.py [--rows 32 --tokens 48 --temperature 1.0]
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: what a CPU run sets

import torch  # noqa: E402

from harness import alternated  # noqa: E402

from setgrpo_verl.verl_cpu.streams import token_log_probs as step_by_step  # noqa: E402

VOCAB = 49152


def stacked(logits: tuple[torch.Tensor, ...], tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, T] log-probs the way the server took them before: one log-softmax over the stacked logits."""
    full = torch.stack(logits, dim=1).float()
    if temperature > 0:
        full = full / temperature
    return torch.log_softmax(full, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32, help="responses in the batch (8 groups x K=4)")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens (the comparison's)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    logits = tuple(4 * torch.randn(args.rows, VOCAB, generator=gen) for _ in range(args.tokens))
    tokens = torch.randint(0, VOCAB, (args.rows, args.tokens), generator=gen)
    same = torch.equal(stacked(logits, tokens, args.temperature), step_by_step(logits, tokens, args.temperature))
    seconds = alternated({"stacked": lambda: stacked(logits, tokens, args.temperature),
                          "step by step": lambda: step_by_step(logits, tokens, args.temperature)}, args.repeats)
    medians = {name: statistics.median(ts) for name, ts in seconds.items()}
    copies = (3 if args.temperature > 0 else 2) * args.rows * args.tokens * VOCAB * 4
    print(f"{args.rows} responses x {args.tokens} tokens x {VOCAB} logits, temperature {args.temperature:g}, "
          f"{torch.get_num_threads()} threads; bit-equal: {same}; the stacked way allocates {copies / 2**20:.0f} MiB "
          "of [B, T, V] float32 tensors")
    for name, ts in seconds.items():
        print(f"{name}: {medians[name]:.3f} s ({', '.join(f'{t:.3f}' for t in ts)})")
    print(f"step by step / stacked: {medians['step by step'] / medians['stacked']:.3f}")


if __name__ == "__main__":
    main()
