"""The sketch on a GPU: time, peak memory, precision in bf16, Qwen3-4B widths (docs/benchmarks.md#gpu-check).

Needs torch and transformers only (sdpa attention; no flash-attn, hub, verl, Ray or vLLM; run with ``PYTHONPATH=.`` from
the repository root, nothing installed). It builds a Qwen3-4B-shaped configuration locally (36 layers, width 2,560, MLP
9,728, 32 query and 8 key-value heads of 128, vocabulary 151,936, tied head) with random bfloat16 weights, activation
checkpointing on (non-reentrant, as verl enables it), and for each batch size prints the median time and the peak
memory of

* ``fwd+bwd``: a plain training pass: forward, the log-probs of every position in float32 row chunks, backward with
  parameter gradients;
* ``fwd+lp``: a plain forward with log-probs under ``no_grad`` (verl's old-log-prob pass: every position's logits);
* ``sketch``: :func:`setgrpo_verl.sketch.compute_sketches` with the default settings (the forward with
  ``logits_to_keep``, the log-probs of the response tokens, one activation-only backward with the sketch hooks). This
  is the core of the trainer's fused old-log-prob + sketch pass, which adds verl's input preparation and log-prob
  function around the same forward, hooks and backward;

their ratios with the targets (``sketch`` <= 1.05 ``fwd+bwd`` at 12k tokens, <= 1.10 at 41k), the agreement of the
sketch with the same projections in float32 (largest difference of the responses' cosines, against the documented
error of the sketch itself, docs/sketch.md#measured-accuracy), and whether the response log-probs of the forward with
``logits_to_keep`` are bit-equal to those of the full logits.

Run: ``bash benchmarks/gpu_check.sh`` (about 2-3 minutes on one H100 or H200); ``--tiny`` runs the same code on a
2-layer model and tiny batches in seconds, on the CPU when there is no GPU (``tests/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

#: (rows, prompt tokens, response tokens) per batch, named by its token count.
SHAPES = {"12k": (8, 512, 1024), "41k": (10, 1024, 3072)}
TINY_SHAPES = {"tiny-a": (4, 8, 16), "tiny-b": (4, 16, 32)}
#: The largest sketch / fwd+bwd time ratio aimed at, per batch.
TARGETS = {"12k": 1.05, "41k": 1.10}
#: The sketch's own documented error (docs/sketch.md#measured-accuracy): max |cosine error| within a group of 4.
SKETCH_ERROR = 0.065


def qwen3_4b_config(tiny: bool):
    """Qwen3-4B's configuration (random weights; nothing is downloaded), or a 2-layer one of the same kind."""
    from transformers import Qwen3Config

    if tiny:
        widths = dict(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    else:
        widths = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    return Qwen3Config(**widths, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, attn_implementation="sdpa")


def build_model(tiny: bool, device: torch.device):
    """The model in bfloat16 on ``device``, training mode (dropout is 0) with non-reentrant checkpointing."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(qwen3_4b_config(tiny))
    finally:
        torch.set_default_dtype(default)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def batch(rows: int, prompt: int, response: int, vocab: int, device: torch.device):
    """Random token ids in verl's layout, every row full length (no padding: sdpa's causal kernel)."""
    g = torch.Generator().manual_seed(rows * 7919 + prompt)
    ids = torch.randint(1, vocab, (rows, prompt + response), generator=g).to(device)
    return ids, torch.ones_like(ids), torch.ones(rows, response, dtype=torch.long, device=device)


def _all_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 log-probs of the next token at every position [B, T - 1], in row chunks split from the logits (each
    recomputed in the backward), as a training pass takes them; no copy of the [B, T, V] logits is made."""
    flat, targets = logits.reshape(-1, logits.shape[-1]), ids.roll(-1, dims=1).reshape(-1)  # last column: unused

    def chunk(part, tgt):
        return torch.log_softmax(part.float(), -1).gather(-1, tgt[:, None])[:, 0]

    step = max(1, (1 << 28) // (4 * logits.shape[-1]))
    parts = [checkpoint(chunk, p, t, use_reentrant=False) if p.requires_grad else chunk(p, t)
             for p, t in zip(flat.split(step), targets.split(step))]
    return torch.cat(parts).reshape(ids.shape)[:, :-1]


def fwd_bwd(model, ids, am, rm):
    """A plain training pass: forward, every position's log-probs, backward of the response tokens' sum."""
    logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits
    lp = _all_log_probs(logits, ids)[:, -rm.shape[1]:]
    del logits
    (lp * rm).sum().backward()
    model.zero_grad(set_to_none=True)


def fwd_lp(model, ids, am, rm):
    """verl's plain old-log-prob pass: a forward under no_grad, every position's log-probs; returns the response's."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits
        return _all_log_probs(logits, ids)[:, -rm.shape[1]:]


def sketch(model, ids, am, rm, projection_dtype=None):
    from setgrpo_verl.sketch import compute_sketches

    return compute_sketches(model, ids, am, rm, projection_dtype=projection_dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, device: torch.device, reps: int) -> tuple[float, float | None]:
    """(median seconds over ``reps`` runs after one warm-up run, peak allocated GiB or None on the CPU)."""
    fn()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        seconds.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return statistics.median(seconds), peak


def _cosine(s: torch.Tensor) -> torch.Tensor:
    gram = s.double() @ s.double().T
    d = gram.diagonal().sqrt()
    return gram / d[:, None] / d[None, :]


def agreement(model, ids, am, rm) -> dict:
    """The sketch with the layers' bfloat16 projections against the same projections in float32, and the response
    log-probs with ``logits_to_keep`` against those of the full logits."""
    # the model's dtype explicitly: the trainer's own choice on a GPU, and on the CPU (--tiny), where the trainer
    # projects in float32, the same comparison
    low = sketch(model, ids, am, rm, projection_dtype=next(model.parameters()).dtype)
    ref = sketch(model, ids, am, rm, projection_dtype=torch.float32)
    full = fwd_lp(model, ids, am, rm)
    return {
        "relative": float((low.sketches - ref.sketches).norm() / ref.sketches.norm()),
        "cosine": float((_cosine(low.sketches) - _cosine(ref.sketches)).abs().max()),
        "log_probs_bit_equal": bool(torch.equal(low.log_probs, full.float())),
        "log_probs_diff": float((low.log_probs - full.float()).abs().max()),
    }


def no_gpu_diagnosis() -> str:
    """Why torch cannot use a GPU here, for the full-size check, which would otherwise build the 4B model on the CPU
    until its timeout: torch's build, ``CUDA_VISIBLE_DEVICES`` and the NVIDIA driver (the same facts as
    ``setgrpo_verl.integration.gpu_env``, read without verl)."""
    import os

    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            driver = fh.readline().strip()
    except OSError:
        driver = "no NVIDIA driver is loaded (/proc/driver/nvidia/version is missing)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    build = (f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None
             else f"torch {torch.__version__} is a CUDA {torch.version.cuda} build (CUDA 13 needs driver R580+)")
    return (f"no GPU that torch can use: torch.cuda.is_available() is False; {build}; driver: {driver}; "
            f"CUDA_VISIBLE_DEVICES={visible!r}. The full-size check needs one CUDA GPU (H100/H200); --tiny runs the "
            "same code on the CPU")


def _gib(x: float | None) -> str:
    return "n/a (cpu)" if x is None else f"{x:.1f} GiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and tiny batches (the test's mode)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu (--tiny only)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per pass, after one warm-up run")
    ap.add_argument("--shapes", default=None, help="comma-separated batch names (default: all of the mode)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not args.tiny and (device.type != "cuda" or not torch.cuda.is_available()):
        print(f"gpu_check: {no_gpu_diagnosis()}", file=sys.stderr, flush=True)
        return 2
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        torch.set_num_threads(1)
        name = "cpu, 1 thread"
    shapes = TINY_SHAPES if args.tiny else SHAPES
    chosen = list(shapes) if args.shapes is None else args.shapes.split(",")
    import transformers

    tf32 = torch.backends.cuda.matmul.allow_tf32
    print(f"device: {name}; torch {torch.__version__}, transformers {transformers.__version__}; bfloat16 (TF32 "
          f"{'on' if tf32 else 'off'}); "
          f"{'tiny 2-layer Qwen3' if args.tiny else 'Qwen3-4B widths, 36 layers'}, random weights, sdpa, "
          "activation checkpointing", flush=True)
    t0 = time.perf_counter()
    model = build_model(args.tiny, device)
    print(f"model built in {time.perf_counter() - t0:.0f} s "
          f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters)", flush=True)
    vocab = model.config.vocab_size
    for label in chosen:
        rows, prompt, response = shapes[label]
        ids, am, rm = batch(rows, prompt, response, vocab, device)
        times = {}
        for what, fn in (("fwd+bwd", fwd_bwd), ("fwd+lp", fwd_lp), ("sketch", sketch)):
            times[what] = measure(lambda fn=fn: fn(model, ids, am, rm), device, args.reps)
            print(f"[{label}] {rows} x ({prompt} + {response}) = {ids.numel():,} tokens  {what:<8} "
                  f"{times[what][0]:8.3f} s  peak {_gib(times[what][1])}", flush=True)
        ratio = times["sketch"][0] / times["fwd+bwd"][0]
        target = TARGETS.get(label)
        verdict = "" if target is None else f" (target <= {target:.2f}: {'met' if ratio <= target else 'NOT met'})"
        print(f"[{label}] sketch / fwd+bwd = {ratio:.3f}{verdict}", flush=True)
        print(f"[{label}] sketch / fwd+lp  = {times['sketch'][0] / times['fwd+lp'][0]:.3f}", flush=True)
    first = shapes[chosen[0]]
    agree = agreement(model, *batch(*first, vocab, device))
    inside = agree["cosine"] <= SKETCH_ERROR
    print(f"[precision] bfloat16 projections against float32 ones ({chosen[0]}): relative sketch difference "
          f"{agree['relative']:.2e}, max |cosine difference| {agree['cosine']:.2e} (the sketch's own error: "
          f"<= {SKETCH_ERROR} within a group; {'inside' if inside else 'OUTSIDE'})", flush=True)
    print(f"[precision] response log-probs with logits_to_keep against the full logits: "
          f"{'bit-equal' if agree['log_probs_bit_equal'] else 'not bit-equal'}, max |difference| "
          f"{agree['log_probs_diff']:.2e}", flush=True)
    loaded = sorted(m for m in ("verl", "ray", "vllm", "flash_attn") if sys.modules.get(m) is not None)
    print(f"modules loaded from verl, ray, vllm, flash_attn: {loaded or 'none'}", flush=True)
    return 0 if inside and not loaded else 1


if __name__ == "__main__":
    sys.exit(main())
