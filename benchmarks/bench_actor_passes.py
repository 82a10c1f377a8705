"""verl's old-log-prob pass and actor update at the outcome comparison's shapes, before and after the CPU engine.

One process, the embedded SmolLM2-135M-Instruct wrapped as verl's FSDP2 engine wraps the actor (float32 master
weights, bf16 mixed precision on a CPU with bf16 units, eager attention, padded sequences), one batch of the
comparison (``setgrpo-verl compare``: 8 prompts x K=4, prompts of 81-128 tokens, responses of 12-48 tokens, most
48; micro-batches of 16), through verl's ``infer_batch`` (with the entropy, as verl's old-log-prob pass asks) and
``train_batch`` (verl's ``ppo_loss``, AdamW, gradient clipping). The variants alternate within each round, so load
from other processes hits them alike:

* ``verl``: verl 0.9.1's own ``FSDPEngineWithLMHead`` (the CPU backend before its engine);
* ``chunked``: the CPU backend's ``CPUEngineWithLMHead`` (setgrpo_verl/verl_cpu/engine.py);
* ``+fsdp`` (a suffix): parameters kept gathered between a micro-batch's forward and backward
  (``reshard_after_forward=false``) and AdamW's fused CPU kernel;
* ``+entropy32`` (a suffix): verl's ``entropy_from_logits_with_chunking`` (float32 entropies).

``--logits`` times verl's log-prob step alone, on random logits of one micro-batch.

Prints each variant's median seconds and the largest differences of its log-probs, entropies and gradient norm
from ``verl``'s (AdamW runs with learning rate 0, so every pass sees the same weights).

    python benchmarks/bench_actor_passes.py [--threads 1] [--rounds 3] [--variants verl,chunked,chunked+fsdp]
        [--passes old_log_prob,update] [--logits]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: what a CPU run sets

from _engine import ActorEngine, CPUActorEngine, single_rank_fsdp2  # noqa: E402  (before verl: CPU platform)
from harness import peak_rss_gb  # noqa: E402

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from verl.utils import tensordict_utils as tu  # noqa: E402

#: The comparison's batch: rows (8 prompts x K=4), micro-batch, prompt and response lengths.
ROWS, MICRO, PROMPTS, RESPONSE = 32, 16, (81, 128), 48


def comparison_batch(vocab: int, seed: int = 0) -> TensorDict:
    """:data:`ROWS` sequences in verl's no-padding layout: prompt lengths uniform in :data:`PROMPTS`, three in four
    responses of :data:`RESPONSE` tokens (the cap), the rest 12 to 47."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(PROMPTS[0], PROMPTS[1] + 1, (ROWS,), generator=g).tolist()
    response_lengths = [RESPONSE if torch.rand(1, generator=g).item() < 0.75
                        else int(torch.randint(12, RESPONSE, (1,), generator=g)) for _ in range(ROWS)]
    nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    prompts = [torch.randint(5, vocab, (n,), generator=g) for n in prompt_lengths]
    responses = [torch.randint(5, vocab, (n,), generator=g) for n in response_lengths]
    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    data = TensorDict({"prompts": nested(prompts), "responses": nested(responses),
                       "response_mask": nested([torch.ones_like(r) for r in responses]), "input_ids": nested(ids),
                       "position_ids": nested([torch.arange(i.numel()) for i in ids])}, batch_size=[ROWS])
    data["loss_mask"] = data["response_mask"]
    data["old_log_probs"] = nested([-torch.rand(r.numel(), generator=g) for r in responses])
    data["advantages"] = nested([torch.full((r.numel(),), float(torch.randn(1, generator=g))) for r in responses])
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=MICRO, use_remove_padding=False,
                         use_fused_kernels=False, temperature=1.0, pad_token_id=0)
    return data


def actor_config():
    """The comparison's composed actor config (verl's ``ppo_loss`` reads it)."""
    from hydra import compose, initialize_config_dir

    hydra_dir = Path(__file__).resolve().parents[1] / "hydra_configs"
    with initialize_config_dir(str(hydra_dir), version_base=None):
        config = compose("setgrpo_trainer", overrides=[
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16"])
    return config.actor_rollout_ref.actor


def build(model_dir: str, compute: torch.dtype):
    """The FSDP2-wrapped model all variants share (one copy of the weights in memory)."""
    from setgrpo_verl.models import load_causal_lm

    model, _ = load_causal_lm(model_dir, dtype=torch.float32)
    model.config._attn_implementation = "eager"  # what the launcher's override_config sets for the actor
    return single_rank_fsdp2(model, compute)


def engine_of(variant: str, model, compute: torch.dtype, actor_cfg):
    """(engine, optimizer) of one variant over the shared ``model``."""
    from types import SimpleNamespace

    # learning rate 0: AdamW runs all its arithmetic and leaves the weights as they were, so every variant's passes
    # see the same weights and their gradient norms compare
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=float(actor_cfg.optim.weight_decay),
                                  fused=True if "+fsdp" in variant else None)
    cls = ActorEngine if variant == "verl" else CPUActorEngine
    engine = cls(model, optimizer, float(actor_cfg.grad_clip), compute)
    engine.engine_config = SimpleNamespace(**vars(engine.engine_config), entropy_checkpointing=False,
                                           entropy_from_logits_with_chunking="+entropy32" in variant,
                                           entropy_from_logits_chunk_size=2048)
    return engine, optimizer


def logits_step(rounds: int) -> None:
    """verl's ``prepare_model_outputs`` alone (verl's engine and the CPU engine alternating) on one micro-batch of
    random bf16 logits ``[16, S, 49,152]``: with the entropy and no gradient (old-log-prob), and the log-probs'
    forward and backward (update); prints the medians after a warm-up and whether the gradients are bit-equal."""
    from types import SimpleNamespace

    data = comparison_batch(49152)
    micro = tu.index_select_tensor_dict(data, torch.arange(MICRO))
    config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    engines = {}
    for name, cls in (("verl", ActorEngine), ("chunked", CPUActorEngine)):
        engine = cls.__new__(cls)  # the output step reads the engine's config only
        engine.engine_config, engine.pad_to_length, engine.pad_to_length_bucket = config, False, 0
        engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = False, 1
        engines[name] = engine
    _, output_args = engines["verl"].prepare_model_inputs(micro)
    length = int(micro["input_ids"].offsets().diff().max())
    logits = (3 * torch.randn(MICRO, length, 49152, generator=torch.Generator().manual_seed(0))).bfloat16()

    def old_log_prob(engine):
        batch = micro.clone()
        tu.assign_non_tensor(batch, calculate_entropy=True)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return engine.prepare_model_outputs(SimpleNamespace(logits=logits), output_args, batch, None)

    def update(engine):
        batch = micro.clone()
        tu.assign_non_tensor(batch, calculate_entropy=False)
        x = logits.detach().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = engine.prepare_model_outputs(SimpleNamespace(logits=x), output_args, batch, None)
        out["log_probs"].values().float().sum().backward()
        return x.grad

    times: dict = {}
    for round_ in range(rounds + 1):  # the first round warms up
        for name, engine in engines.items():
            for what, fn in (("old_log_prob", old_log_prob), ("update", update)):
                t0 = time.perf_counter()
                fn(engine)
                if round_:
                    times.setdefault(name, {}).setdefault(what, []).append(time.perf_counter() - t0)
    print(f"log-prob step of one micro-batch [{MICRO}, {length}, 49152] bf16, torch threads "
          f"{torch.get_num_threads()}, {rounds} rounds (medians)")
    for name, by_pass in times.items():
        print(f"{name:<14} " + ", ".join(f"{what} {statistics.median(ts):.2f} s" for what, ts in by_pass.items()))
    print(f"gradients bit-equal: {torch.equal(update(engines['verl']), update(engines['chunked']))}")


def main() -> None:
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    from setgrpo_verl.models import embedded_model_dir
    from setgrpo_verl.runner.launch import cpu_precision

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="verl,chunked,chunked+fsdp")
    ap.add_argument("--passes", default="old_log_prob,update",
                    help="old_log_prob, update or both (old_log_prob alone needs no gradients or optimizer state)")
    ap.add_argument("--logits", action="store_true",
                    help="time the log-prob step alone on random logits (little memory; no model)")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.logits:
        logits_step(args.rounds)
        return
    precision = args.precision or cpu_precision()
    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    actor_cfg = actor_config()
    loss_fn = partial(ppo_loss, config=omega_conf_to_dataclass(actor_cfg))
    variants = args.variants.split(",")
    model = build(str(embedded_model_dir()), compute)
    built = {v: engine_of(v, model, compute, actor_cfg) for v in variants}
    data = comparison_batch(model.config.vocab_size)
    times = {v: {"old_log_prob": [], "update": []} for v in variants}
    base, reference, diffs = variants[0], {}, {v: [0.0, 0.0, 0.0] for v in variants}

    def old_log_prob(v):
        engine, _ = built[v]
        model.set_reshard_after_forward("+fsdp" not in v)
        batch = data.clone()
        tu.assign_non_tensor(batch, calculate_entropy=True, compute_loss=False)
        model.eval()
        return engine.infer_batch(batch, loss_function=None)["model_output"]

    def update(v):
        engine, optimizer = built[v]
        model.set_reshard_after_forward("+fsdp" not in v)
        batch = data.clone()
        tu.assign_non_tensor(batch, global_batch_size=ROWS, calculate_entropy=False, compute_loss=True)
        model.train()
        out = engine.train_batch(batch, loss_fn)
        model.eval()
        optimizer.state.clear()
        return out["metrics"]["grad_norm"]

    def record(v, name, out):
        if name == "old_log_prob":
            values = (out["log_probs"].values().float(), out["entropy"].values().float())
            if v == base:
                reference["lp"], reference["h"] = values
            else:
                diffs[v][0] = max(diffs[v][0], (values[0] - reference["lp"]).abs().max().item())
                diffs[v][1] = max(diffs[v][1], (values[1] - reference["h"]).abs().max().item())
        elif v == base:
            reference["grad_norm"] = out
        else:
            diffs[v][2] = max(diffs[v][2], abs(out / reference["grad_norm"] - 1))

    passes = [(name, fn) for name, fn in (("old_log_prob", old_log_prob), ("update", update))
              if name in args.passes.split(",")]
    for v in variants:  # warm-up round
        for name, fn in passes:
            record(v, name, fn(v))
    for _ in range(args.rounds):
        for v in variants:
            for name, fn in passes:
                t0 = time.perf_counter()
                out = fn(v)
                times[v][name].append(time.perf_counter() - t0)
                record(v, name, out)
                del out
    print(f"{ROWS} rows ({PROMPTS[0]}-{PROMPTS[1]} + <= {RESPONSE} tokens), micro-batches of {MICRO}, {precision}, "
          f"torch threads {torch.get_num_threads()}, {args.rounds} rounds (medians)")
    for v in variants:
        line = ", ".join(f"{name} {statistics.median(ts):.2f} s" for name, ts in times[v].items() if ts)
        extra = "" if v == base else (f"; max |diff| from {base}: log-probs {diffs[v][0]:.3g}, entropies "
                                      f"{diffs[v][1]:.3g}, gradient norm (relative) {diffs[v][2]:.3g}")
        print(f"{v:<14} {line}{extra}")
    print(f"peak resident set {peak_rss_gb():.1f} GB")

if __name__ == "__main__":
    main()
