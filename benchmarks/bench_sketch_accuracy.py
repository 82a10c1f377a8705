"""Accuracy of the gradient sketch on the embedded SmolLM2-135M-Instruct (docs/sketch.md#measured-accuracy).

Samples ``--responses-per-prompt`` responses to each of ``--prompts`` prompts (default 8 x 4 = 32 responses of up to
``--max-new-tokens`` tokens, seeded), computes the exact Gram matrix of their per-response gradients over every
``nn.Linear`` weight (the blocks the default sketch covers; the LM head untied from the embedding, same values), and
for each sketch setting and projection seed the sketch's Gram matrix through :func:`setgrpo_verl.sketch.compute_sketches`
(the real hooks). It prints, per setting, the maximum absolute error of the 32 x 32 cosine matrix (all pairs) and of
the within-prompt pairs (the groups the algorithm uses), mean and worst over the seeds.

The exact Gram matrix takes one batched forward + backward: forward hooks keep each Linear call's input x, tensor hooks
receive the output gradient delta, and each block's per-response gradients sum_t delta_t x_t^T give its Gram term
(the LM head's from the factors, <g_i, g_j> = sum_{t in i, s in j} (delta_t . delta_s)(x_t . x_s)).

The model runs in float32, so by default the projections run in float32 too (the precision of the layers,
docs/sketch.md#precision). ``--projection-dtype bfloat16`` runs every projection in bfloat16 with float32 accumulation,
as a bfloat16 model's sketch does on CUDA, on the same float32 forward and backward: the error then includes what the bfloat16
projections add, and the script also prints, per seed, the largest difference of the cosines from those of float32
projections with the same seed.

Run: ``python benchmarks/bench_sketch_accuracy.py [--seeds 10 --prompts 8 --responses-per-prompt 4]
[--projection-dtype bfloat16]`` (on 2 CPU cores: about 2 minutes for the batch and the exact Gram matrix, then 20-25 s
per seed and setting, twice that with ``--projection-dtype bfloat16``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

PROMPTS = [
    "Write a haiku about autumn leaves.",
    "Explain why the sky is blue in two sentences.",
    "Give three tips for learning a new language.",
    "What is the capital of Australia, and why was it chosen?",
    "Write a short apology email for missing a meeting.",
    "Describe how a bicycle works to a child.",
    "List two pros and two cons of remote work.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Suggest a name for a bakery and explain it.",
]

#: (label, SketchConfig kwargs): the default first.
SETTINGS = [
    ("(1, 2, 64) + head (1, 8, 256) [default]", {}),
    ("(1, 4, 64) + head (1, 8, 256)", dict(rank_in=4)),
    ("(1, 2, 128) + head (1, 8, 256)", dict(copies=128)),
    ("(1, 4, 64) + head (1, 16, 256)", dict(rank_in=4, head_rank_in=16)),
]


def _batch(model, tok, prompts, per_prompt, max_new_tokens, seed):
    """verl layout: prompt left-padded, response right-padded; returns ids, attention mask, response mask, group ids."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    rows = []
    gen = torch.Generator().manual_seed(seed)
    for g, text in enumerate(prompts):
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        for _ in range(per_prompt):
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=True, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad)
            response = out[0, len(prompt):].tolist()
            if tok.eos_token_id in response:
                response = response[: response.index(tok.eos_token_id) + 1]
            rows.append((g, prompt, response))
    t_prompt = max(len(p) for _, p, _ in rows)
    t_resp = max(len(r) for _, _, r in rows)
    ids, am = [], []
    for _, p, r in rows:
        ids.append([pad] * (t_prompt - len(p)) + p + r + [pad] * (t_resp - len(r)))
        am.append([0] * (t_prompt - len(p)) + [1] * (len(p) + len(r)) + [0] * (t_resp - len(r)))
    ids, am = torch.tensor(ids), torch.tensor(am)
    return ids, am, am[:, t_prompt:].clone(), torch.tensor([g for g, _, _ in rows])


def exact_gram(model, ids, am, rm) -> torch.Tensor:
    """float64 [B, B] Gram matrix of the exact per-response gradients of sum_t log pi(o_t) over every nn.Linear weight."""
    bsz, seqlen = ids.shape
    t_resp = rm.shape[1]
    seg = torch.where(am.bool(), torch.arange(bsz)[:, None], torch.full_like(ids, -1)).reshape(-1)
    onehot = torch.zeros(seg.numel(), bsz, dtype=torch.float64)
    onehot[(seg >= 0).nonzero().squeeze(1), seg[seg >= 0]] = 1.0
    gram = torch.zeros(bsz, bsz, dtype=torch.float64)
    handles = []

    def forward_hook(module, args, output):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()

        def grad_hook(grad):
            nonlocal gram
            d = grad.detach().reshape(-1, grad.shape[-1]).double()
            rows = d.ne(0).any(-1).nonzero().squeeze(1)
            dr, xr, h = d[rows], x[rows].double(), onehot[rows]
            if module.out_features * module.in_features > 8 * rows.numel() ** 2:  # LM head: factored form
                gram += h.T @ ((dr @ dr.T) * (xr @ xr.T)) @ h
            else:  # per-response gradients [B, out * in]
                owner = seg[rows]
                g = torch.stack([dr[owner == i].T @ xr[owner == i] for i in range(bsz)]).reshape(bsz, -1)
                gram += g @ g.T

        output.register_hook(grad_hook)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_hook(forward_hook))
    try:
        logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0),
                       use_cache=False).logits[:, seqlen - t_resp - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, -t_resp:, None]).squeeze(-1)
        (lp * rm).sum().backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return gram


def _cosine(gram: torch.Tensor) -> torch.Tensor:
    d = gram.diagonal().sqrt()
    return gram / d[:, None] / d[None, :]


def _check_exact(model, ids, am, rm, gram, rows=(0, 1)):
    """The hook-based Gram entries of two responses against autograd, one response at a time."""
    t_resp = rm.shape[1]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    grads = []  # per response: the float32 weight gradients
    for b in rows:
        model.zero_grad(set_to_none=True)
        sl = slice(b, b + 1)
        logits = model(input_ids=ids[sl], attention_mask=am[sl], position_ids=(am[sl].cumsum(-1) - 1).clamp(min=0),
                       use_cache=False).logits[0, -t_resp - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[b, -t_resp:, None]).squeeze(-1)
        (lp * rm[b]).sum().backward()
        grads.append([m.weight.grad.detach().clone() for m in linears])
    model.zero_grad(set_to_none=True)
    ref = torch.tensor([[sum(float((a.double() * c.double()).sum()) for a, c in zip(gi, gj)) for gj in grads]
                        for gi in grads], dtype=torch.float64)
    sub = gram[list(rows)][:, list(rows)]
    rel = float((sub - ref).abs().max() / ref.abs().max())
    if rel > 1e-4:
        raise AssertionError(f"hook-based exact Gram differs from autograd by {rel:.2e} (relative)")
    return rel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--responses-per-prompt", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--sample-seed", type=int, default=0)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--settings", type=str, default=None, help="comma-separated indices into SETTINGS (default all)")
    ap.add_argument("--projection-dtype", choices=("layer", "bfloat16", "float32"), default="layer",
                    help="the projections' precision: the layers' own (float32 here), or this dtype everywhere")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from setgrpo_verl.models import load_causal_lm
    from setgrpo_verl.sketch import SketchConfig, compute_sketches

    model, tok = load_causal_lm()
    model.eval()
    # untie the LM head (same values, same forward): the default sketch covers nn.Linear blocks, the head's use only
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    t0 = time.perf_counter()
    ids, am, rm, groups = _batch(model, tok, PROMPTS[: args.prompts], args.responses_per_prompt, args.max_new_tokens,
                                 args.sample_seed)
    lengths = rm.sum(-1).tolist()
    print(f"{ids.shape[0]} responses to {args.prompts} prompts, {min(lengths)}-{max(lengths)} tokens "
          f"(mean {statistics.mean(lengths):.1f}), sampled in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    gram = exact_gram(model, ids, am, rm)
    rel = _check_exact(model, ids, am, rm, gram)
    exact = _cosine(gram)
    same = groups[:, None] == groups[None, :]
    off = ~torch.eye(len(groups), dtype=torch.bool)
    print(f"exact Gram in {time.perf_counter() - t0:.0f} s (checked against autograd: {rel:.1e}); exact cosines: "
          f"within-prompt mean {float(exact[same & off].mean()):.3f}, across prompts mean "
          f"{float(exact[~same].mean()):.3f}", flush=True)
    chosen = SETTINGS if args.settings is None else [SETTINGS[int(i)] for i in args.settings.split(",")]
    projection = None if args.projection_dtype == "layer" else getattr(torch, args.projection_dtype)
    compare = projection is not None and projection != torch.float32
    print(f"projections: {args.projection_dtype}" + (" (against float32 projections, same seeds)" if compare else ""))
    print(f"{'sketch (r_out, r_in, k)':<40} {'floats':>7} | all pairs: mean / worst | within prompt: mean / worst")
    for label, kwargs in chosen:
        errs_all, errs_group = [], []
        t0 = time.perf_counter()
        dim, drift = 0, []
        for seed in range(args.seeds):
            out = compute_sketches(model, ids, am, rm, SketchConfig(seed=seed, **kwargs),
                                   micro_batch_size=args.micro_batch, projection_dtype=projection)
            s = out.sketches.double()
            dim = s.shape[1]
            cos = _cosine(s @ s.T)
            err = (cos - exact).abs()
            errs_all.append(float(err.max()))
            errs_group.append(float(err[same].max()))
            if compare:
                ref = compute_sketches(model, ids, am, rm, SketchConfig(seed=seed, **kwargs),
                                       micro_batch_size=args.micro_batch, projection_dtype=torch.float32).sketches
                ref = ref.double()
                drift.append(float((cos - _cosine(ref @ ref.T)).abs().max()))
        extra = f"; against float32 projections: max |cos diff| {max(drift):.1e}" if drift else ""
        print(f"{label:<40} {dim:>7} | {statistics.mean(errs_all):.3f} / {max(errs_all):.3f}            | "
              f"{statistics.mean(errs_group):.3f} / {max(errs_group):.3f}   "
              f"({(time.perf_counter() - t0) / args.seeds:.0f} s per seed{extra})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
