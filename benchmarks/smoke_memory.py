"""The memory model of recipes/smoke_qwen3_1gpu.sh at its first actor update, measured on the CPU
(docs/benchmarks.md#one-gpu-smoke-memory).

A Qwen3-0.6B-shaped model (28 layers, width 1,024, MLP 3,072, 16 query and 8 key-value heads of 128, vocabulary
151,936, tied head) is built locally from its configuration with random float32 weights (no hub), with non-reentrant
activation checkpointing as verl enables it. The script

* counts its parameters N exactly, which fixes the state the actor keeps: float32 master weights (4N bytes), their
  float32 gradients (4N), AdamW's two moments (8N) and FSDP2's bfloat16 compute copy of the weights (2N);
* measures, in a fresh process per token count T, the peak resident memory of one training pass (forward, float32
  log-probs of every position, backward with parameter gradients) above the process after the model was built, and
  fits ``peak = a + b T``: ``b`` is the memory per token of the pass (activations, logits and their gradients) in
  float32, an upper bound of the same pass under bfloat16 autocast on a GPU;
* prints the GPU memory at the first update: the judge's and the sleeping rollout's share, then the actor's state
  and ``b`` times the recipe's tokens per GPU, with and without FSDP parameter/optimizer offload.

Run: ``flock /tmp/setgrpo-heavy.lock python benchmarks/smoke_memory.py [--tokens 256,512]`` (about 8 GB of RAM and a
few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

GIB = 2 ** 30


def qwen3_0_6b_config():
    """Qwen/Qwen3-0.6B's architecture (its config.json), built locally."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, attn_implementation="sdpa")


def parameters() -> int:
    """N, counted on the meta device (no memory)."""
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(qwen3_0_6b_config())
    return sum(p.numel() for p in model.parameters())


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def one_pass(tokens: int) -> dict:
    """In this process: build the model, then one training pass over ``tokens`` tokens; peak RSS before and after."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_0_6b_config())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    built = _peak_kib()
    ids = torch.randint(1, 151936, (1, tokens))
    logits = model(input_ids=ids).logits.float()
    log_probs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-log_probs.mean()).backward()
    return {"tokens": tokens, "built_kib": built, "peak_kib": _peak_kib()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="256,512", help="token counts of the measured passes (two or more)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--card-gb", type=float, default=24.0, help="the card's memory in GB (24 GB = 22.35 GiB)")
    ap.add_argument("--recipe-tokens", default="8192,4096", help="actor tokens per GPU to evaluate")
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one_pass(args.one)))
        return 0
    n = parameters()
    runs = []
    for t in [int(x) for x in args.tokens.split(",")]:
        out = subprocess.run([sys.executable, __file__, "--one", str(t)], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = runs[-1]
        print(f"measured: T={t:5d}: model built {r['built_kib'] / 2**20:.2f} GiB RSS, peak of the pass "
              f"{(r['peak_kib'] - r['built_kib']) / 2**20:.2f} GiB above it", flush=True)
    (t0, p0), (t1, p1) = [(r["tokens"], (r["peak_kib"] - r["built_kib"]) * 1024) for r in (runs[0], runs[-1])]
    per_token = (p1 - p0) / (t1 - t0)
    rest = p0 - per_token * t0 - 4 * n  # the pass's own fixed part: its peak less the parameter gradients
    print(f"N = {n:,} parameters; a pass holds the fp32 gradients (4N = {4 * n / GIB:.2f} GiB) + {rest / GIB:.2f} GiB "
          f"+ {per_token / 2**20:.3f} MiB x T (float32 on the CPU, an upper bound of bf16 autocast)")
    card = args.card_gb * 1e9 / GIB
    judge, residue = 0.25 * card, 1.0  # the judge's vLLM share; the sleeping rollout's residue (estimate)
    for tokens in [int(x) for x in args.recipe_tokens.split(",")]:
        activ = (rest + per_token * tokens) / GIB
        for offload in (False, True):
            # FSDP2 offload keeps master weights, gradients and AdamW on the CPU: the GPU holds the bf16 copy
            on_gpu = 2 * n + (0 if offload else 16 * n)
            total = judge + residue + on_gpu / GIB + activ
            print(f"T={tokens}, offload={'on ' if offload else 'off'}: judge {judge:.1f} + rollout residue {residue:.1f}"
                  f" + actor state {on_gpu / GIB:.1f} + pass {activ:.1f} = {total:.1f} GiB of {card:.2f} "
                  f"({args.card_gb:.0f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
