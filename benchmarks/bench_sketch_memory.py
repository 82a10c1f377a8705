"""Peak memory of the sketch pass vs verl's update pass on the same micro-batch, recipe settings, on the CPU.

The model has Qwen3-4B's widths (hidden 2560, MLP 9728, 32/8 heads of 128, vocabulary 151,936, tied embeddings) and
``--layers`` decoder layers (default 2), random bf16 weights; the micro-batch is ``--responses`` sequences of
``--prompt`` + ``--response`` tokens (default 1 x (256 + 2,048)).  Engine settings as the recipes (``recipes/``):
verl's ``FSDPEngineWithLMHead`` input/output preparation with remove-padding (packed), bf16 autocast, temperature
``--temperature``, gradient checkpointing on (non-reentrant, as verl enables it).

* ``update``: verl's update on the micro-batch: the engine's ``forward_step`` in train mode with a policy-gradient
  loss on the response log-probs, then ``loss.backward()`` (parameter gradients); the optimizer step is not
  included (it runs once per mini-batch and its states are resident in both passes alike);
* ``sketch``: :func:`setgrpo_verl.integration.worker.sketch_and_log_probs` with the default ``SketchConfig`` in eval
  mode (the fused sketch + old-log-prob pass the trainer runs).

Memory: each pass runs in a fresh subprocess that builds the same model and batch and then runs that one pass
(nothing else precedes it); the peak resident set (``VmHWM``, which includes the weights, as a GPU's
``max_memory_allocated`` does) is reset to the current resident set just before the pass (``/proc/self/clear_refs``)
so that the construction's transient peak does not mask the pass's; the resident set before the pass is printed.
The last line is ``sketch/update peak memory: R`` (target R <= 1.10).  A projection of both passes per GPU for the
4B and 14B recipes (8 GPUs, FSDP full shard, 6,144 sketch tokens per micro-batch) is a count of named terms
(:func:`projection`), not a measurement.

Run: ``python benchmarks/bench_sketch_memory.py [--layers 2 --prompt 256 --response 2048 --responses 1]``
(about 2 minutes and 5.5 GB on 2 CPU cores; measured 0.99, docs/sketch.md#memory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

from _engine import PlainEngine  # before verl: selects verl's CPU platform
from harness import peak_rss_gb, reset_peak_rss, rss_gb, run_child

import torch  # noqa: E402

QWEN3_4B = dict(hidden=2560, inter=9728, heads=32, kv_heads=8, head_dim=128, vocab=151936, layers=36, tied=True)
QWEN3_14B = dict(hidden=5120, inter=17408, heads=40, kv_heads=8, head_dim=128, vocab=151936, layers=40, tied=False)


def _model(layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    w = QWEN3_4B
    cfg = Qwen3Config(vocab_size=w["vocab"], hidden_size=w["hidden"], intermediate_size=w["inter"],
                      num_hidden_layers=layers, num_attention_heads=w["heads"], num_key_value_heads=w["kv_heads"],
                      head_dim=w["head_dim"], tie_word_embeddings=w["tied"], max_position_embeddings=40960,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # build in bf16: no float32 copy of the weights ever exists
    try:
        model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _batch(args, vocab: int):
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (args.prompt,), generator=g) for _ in range(args.responses)]
    responses = [torch.randint(1, vocab, (args.response,), generator=g) for _ in range(args.responses)]
    nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    td = TensorDict({"prompts": nested(prompts), "responses": nested(responses),
                     "response_mask": nested([torch.ones_like(r) for r in responses]), "input_ids": nested(ids),
                     "position_ids": nested([torch.arange(i.numel()) for i in ids]),
                     "loss_mask": nested([torch.ones_like(r) for r in responses]),
                     "advantages": nested([torch.ones(r.numel()) for r in responses])},
                    batch_size=[args.responses])
    tu.assign_non_tensor(td, use_remove_padding=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=args.responses,
                         temperature=args.temperature, use_fused_kernels=False)
    return td


def _pg_loss(model_output, data, dp_group=None):
    """Vanilla policy-gradient token-mean loss on the response log-probs (the PPO ratio's terms are elementwise on
    [B, R] and do not change the memory of the [tokens, V] logits or of the parameter gradients)."""
    from verl.workers.utils.padding import no_padding_2_padding

    log_probs = no_padding_2_padding(model_output["log_probs"], data)
    mask = data["response_mask"].to_padded_tensor(0, output_size=log_probs.shape).float()
    adv = data["advantages"].to_padded_tensor(0.0, output_size=log_probs.shape)
    return -(log_probs.float() * adv * mask).sum() / mask.sum(), {}


def child(args) -> dict:
    torch.set_num_threads(args.threads)
    from setgrpo_verl.integration.worker import sketch_and_log_probs
    from setgrpo_verl.sketch import SketchConfig

    model = _model(args.layers)
    engine = PlainEngine(model, torch.bfloat16)
    data = _batch(args, QWEN3_4B["vocab"])
    setup_peak = peak_rss_gb()
    reset_peak_rss()
    before = rss_gb()
    t0 = time.perf_counter()
    if args.child == "update":
        model.train()
        loss, _ = engine.forward_step(data, loss_function=_pg_loss, forward_only=False)
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
    else:
        model.eval()
        sketches, _, _ = sketch_and_log_probs(engine, data, SketchConfig(), loss_agg_mode="token-mean")
        assert all(p.grad is None for p in model.parameters()) and torch.isfinite(sketches).all()
    return dict(pass_=args.child, before_gb=before, setup_peak_gb=setup_peak, peak_gb=peak_rss_gb(),
                seconds=time.perf_counter() - t0)


def _run_child(name: str, args) -> dict:
    return run_child(__file__, ["--child", name, "--layers", str(args.layers), "--prompt", str(args.prompt),
                                "--response", str(args.response), "--responses", str(args.responses),
                                "--temperature", str(args.temperature), "--threads", str(args.threads)])


def _block_shapes(w: dict) -> list[tuple[int, int]]:
    """(out, in) of every nn.Linear of one decoder layer."""
    h, q, kv = w["hidden"], w["heads"] * w["head_dim"], w["kv_heads"] * w["head_dim"]
    return [(q, h), (kv, h), (kv, h), (h, q), (w["inter"], h), (w["inter"], h), (h, w["inter"])]


def projection(w: dict, *, tokens: int, gpus: int = 8, offload: bool = False) -> dict:
    """Estimated peak bytes per GPU of each pass for a recipe (FSDP full shard over ``gpus``, float32 sharded
    parameters, gradients and AdamW states, bf16 compute, default SketchConfig), as a sum of named terms:

    * both passes: float32 parameter shards 4 P / gpus (AdamW states 8 P / gpus unless ``offload``), the unsharded bf16
      root unit (embedding and head, the largest unit) and the checkpointed layer inputs (tokens x hidden bf16 per
      layer), and at the LM head the [tokens, V] bf16 logits, their saved log-softmax and their gradient;
    * update only: float32 gradient shards 4 P / gpus, the unsharded bf16 gradient of the root unit, and with
      ``offload`` the AdamW states, which the train-mode context loads (eval mode does not);
    * sketch only: the device projections (k r_out x out + k r_in x in float32 per block, not sharded), the stored
      P_in x of every block (tokens x k r_in float32) and the head's accumulation temporaries (tokens x 2,048 float32,
      twice)."""
    layer = _block_shapes(w)
    params_layer = sum(o * i for o, i in layer)
    head = w["vocab"] * w["hidden"]
    root = head * (1 if w["tied"] else 2)
    params = w["layers"] * params_layer + root
    body_k, body_r_out, body_r_in = 64, 1, 2
    head_k, head_r_out, head_r_in = 256, 1, 8
    proj = w["layers"] * sum(body_k * (body_r_out * o + body_r_in * i) for o, i in layer) * 4
    proj += head_k * (head_r_out * w["vocab"] + head_r_in * w["hidden"]) * 4
    stored = tokens * (w["layers"] * len(layer) * body_k * body_r_in + head_k * head_r_in) * 4
    head_tmp = 2 * tokens * head_k * head_r_out * head_r_in * 4
    adam = 8 * params / gpus
    common = 4 * params / gpus + (0 if offload else adam) + 2 * root + w["layers"] * tokens * w["hidden"] * 2
    common += 3 * tokens * w["vocab"] * 2
    update_only = 4 * params / gpus + 2 * root + (adam if offload else 0)
    sketch_only = proj + stored + head_tmp
    return dict(update=common + update_only, sketch=common + sketch_only, update_only=update_only,
                sketch_only=sketch_only, params=params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=2048)
    parser.add_argument("--responses", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=["update", "sketch"], default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    tokens = args.responses * (args.prompt + args.response)
    print(f"Qwen3-4B widths, {args.layers} layers, {args.responses} x ({args.prompt} + {args.response}) = {tokens} "
          f"packed tokens, bf16, gradient checkpointing, temperature {args.temperature}")
    results = {name: _run_child(name, args) for name in ("update", "sketch")}
    for name, r in results.items():
        print(f"  {name:>6}: peak RSS {r['peak_gb']:.2f} GB (before the pass {r['before_gb']:.2f} GB, setup peak "
              f"{r['setup_peak_gb']:.2f} GB), {r['seconds']:.1f} s")
    for label, w, offload in (("4B", QWEN3_4B, False), ("14B", QWEN3_14B, True)):
        p = projection(w, tokens=6144, offload=offload)
        print(f"  projection {label} recipe per GPU (8 GPUs, 6,144 tokens, offload={offload}): update "
              f"{p['update'] / 2**30:.1f} GB, sketch {p['sketch'] / 2**30:.1f} GB (only in the update "
              f"{p['update_only'] / 2**30:.2f} GB, only in the sketch {p['sketch_only'] / 2**30:.2f} GB), "
              f"sketch/update {p['sketch'] / p['update']:.2f}")
    ratio = results["sketch"]["peak_gb"] / results["update"]["peak_gb"]
    print(f"sketch/update peak memory: {ratio:.2f}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
