"""Speed and memory of the per-response gradient sketch pass vs a plain forward+backward.

On one batch of SmolLM2-135M-Instruct (embedded model, or ``--random-init`` from its configuration: weights do
not change the timing) this prints the median time of

* ``plain``: forward + backward of sum_i sum_t log pi(o_it) with parameter gradients (what a training step does);
* ``sketch``: :func:`setgrpo_verl.sketch.compute_sketches` with the default :class:`SketchConfig` (one forward,
  one activation-only backward, the sketch hooks),

their ratio (target <= 0.9) and the peak memory of each (target: sketch overhead <= 10%).  Times: both passes
alternate in one subprocess (medians), so load from other processes hits both alike; peak memory: each pass in
its own subprocess (CUDA: ``max_memory_allocated``; CPU: peak RSS above the loaded model).  Run: ``python benchmarks/bench_sketch.py [--batch 8 --prompt 64 --response 64 --repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from harness import alternated, device_sync, peak_rss_gb, rss_gb, run_child, times


def _smollm2_random(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(  # SmolLM2-135M-Instruct's configuration
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device)


def _child(args) -> dict:
    from setgrpo_verl.sketch import SketchConfig, compute_sketches

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.random_init:
        model = _smollm2_random(device)
    else:
        from setgrpo_verl.models import load_causal_lm

        model, _ = load_causal_lm()
        model.to(device)
    model.eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    bsz, seqlen, t_resp = args.batch, args.prompt + args.response, args.response
    ids = torch.randint(0, vocab, (bsz, seqlen), generator=g).to(device)
    am = torch.ones(bsz, seqlen, dtype=torch.long, device=device)
    rm = torch.ones(bsz, t_resp, dtype=torch.long, device=device)

    def plain():
        logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits[:, -t_resp - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, -t_resp:, None]).squeeze(-1)
        (lp * rm).sum().backward()
        model.zero_grad(set_to_none=False)  # keep the grad buffers, as a training loop does

    def sketch():
        compute_sketches(model, ids, am, rm, SketchConfig())

    sync = device_sync(device)
    if args.mode == "time":  # both passes alternating in one process: shared-machine noise hits both alike
        measured = alternated({"plain": plain, "sketch": sketch}, args.repeats, sync=sync)
        return {k: statistics.median(v) for k, v in measured.items()} | {"times": measured}
    fn = plain if args.mode == "plain" else sketch
    base_rss = rss_gb() * 1024
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    measured = times(fn, args.repeats, sync=sync)
    out = {"mode": args.mode, "time_s": statistics.median(measured), "times": measured}
    if device.type == "cuda":
        out["peak_mb"] = (torch.cuda.max_memory_allocated() - base_cuda) / 2**20
    else:
        out["peak_mb"] = peak_rss_gb() * 1024 - base_rss
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--random-init", action="store_true", help="random SmolLM2-135M (no embedded model needed)")
    ap.add_argument("--mode", choices=["plain", "sketch", "time"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mode:
        print(json.dumps(_child(args)))
        return 0
    passthrough = list(argv if argv is not None else sys.argv[1:])
    results = {mode: run_child(__file__, [*passthrough, "--mode", mode]) for mode in ("time", "plain", "sketch")}
    p, s, t = results["plain"], results["sketch"], results["time"]
    p["time_s"], s["time_s"] = t["plain"], t["sketch"]
    tokens = args.batch * (args.prompt + args.response)
    print(f"device={args.device} threads={args.threads} batch={args.batch}x{args.prompt + args.response} tokens={tokens}")
    print(f"plain forward+backward (param grads): {p['time_s']:.3f} s   peak {p['peak_mb']:.0f} MB")
    print(f"sketch pass (default SketchConfig):   {s['time_s']:.3f} s   peak {s['peak_mb']:.0f} MB")
    print(f"time ratio sketch/plain: {s['time_s'] / p['time_s']:.3f}  (target <= 0.9)")
    print(f"peak memory ratio sketch/plain: {s['peak_mb'] / p['peak_mb']:.3f}  (target <= 1.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
