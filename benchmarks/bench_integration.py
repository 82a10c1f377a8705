"""Cost of the SetGRPO trainer mode's extra work per step, relative to verl's old-log-prob pass.

Prints (no assertions; timings on a shared CPU are noisy):
* sketch pass / log-prob forward: the worker's ``sketch_batch`` (one forward + one activation-only backward per
  micro-batch, verl's micro-batching and engine code) vs verl's own no-grad log-prob forward (the engine's
  ``forward_step``), on the embedded SmolLM2-135M-Instruct;
* driver glue: ``setgrpo_step`` (grouping, Gram matrices, coefficients) for the paper's batch (64 groups x K=8)
  with SmolLM2-sized sketches.

    python benchmarks/bench_integration.py [--batch 8] [--prompt 64] [--response 64] [--repeats 2]
"""

from __future__ import annotations

import argparse

from _engine import PlainEngine  # before verl: selects verl's CPU platform
from harness import min_seconds

import torch
from tensordict import TensorDict

from verl.utils import tensordict_utils as tu

from setgrpo_verl.core import CalibrationSettings, calibrate
from setgrpo_verl.integration.estimator import setgrpo_step
from setgrpo_verl.integration.worker import sketch_batch
from setgrpo_verl.models import load_causal_lm
from setgrpo_verl.sketch import SketchConfig


def _batch(b: int, p: int, r: int, vocab: int) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, vocab, (p,), generator=g) for _ in range(b)]
    responses = [torch.randint(5, vocab, (r,), generator=g) for _ in range(b)]
    nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    ids = [torch.cat([x, y]) for x, y in zip(prompts, responses)]
    td = TensorDict({"prompts": nested(prompts), "responses": nested(responses),
                     "response_mask": nested([torch.ones_like(y) for y in responses]), "input_ids": nested(ids),
                     "position_ids": nested([torch.arange(i.numel()) for i in ids])},
                    batch_size=[b])
    tu.assign_non_tensor(td, use_dynamic_bsz=False, micro_batch_size_per_gpu=b, use_remove_padding=False,
                         temperature=1.0)
    return td


def _log_prob_forward(engine: PlainEngine, data: TensorDict) -> torch.Tensor:
    """verl's own log-prob pass on the batch (the engine's forward_step without a loss, no grad)."""
    with torch.no_grad():
        _, out = engine.forward_step(data, loss_function=None, forward_only=True)
    return out["model_output"]["log_probs"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)

    model, _ = load_causal_lm()
    model.eval()
    data = _batch(args.batch, args.prompt, args.response, model.config.vocab_size)
    cfg = SketchConfig()
    engine = PlainEngine(model, torch.float32)
    forward = min_seconds(lambda: _log_prob_forward(engine, data), args.repeats)
    sketch = min_seconds(lambda: sketch_batch(engine, data, cfg, loss_agg_mode="token-mean"), args.repeats)
    m = sketch_batch(engine, data, cfg, loss_agg_mode="token-mean").shape[1]
    print(f"SmolLM2-135M, {args.batch} x ({args.prompt}+{args.response}) tokens, sketch dim m={m}")
    print(f"  log-prob forward (no grad):          {forward:7.2f} s")
    print(f"  sketch pass (fwd + act.-only bwd):    {sketch:7.2f} s")
    print(f"  ratio sketch / log-prob forward:      {sketch / forward:7.2f}")
    print(f"  extra cost per step, in log-prob forwards: separate sketch pass {sketch / forward:.2f}, "
          f"fused (sketch.fuse_old_log_prob) {sketch / forward - 1:.2f}")

    # driver glue at the paper's batch: 64 groups x K=8, SmolLM2-sized sketches
    g = torch.Generator().manual_seed(1)
    k, groups = 8, 64
    n_cal = 200
    mu = torch.rand(n_cal, k, generator=g, dtype=torch.float64)
    s_cal = torch.randn(n_cal, k, 32, generator=g, dtype=torch.float64)
    record = calibrate(mu + 0.1 * torch.randn(n_cal, k, generator=g, dtype=torch.float64),
                       mu + 0.1 * torch.randn(n_cal, k, generator=g, dtype=torch.float64),
                       s_cal @ s_cal.transpose(1, 2),
                       CalibrationSettings(alpha=0.05, beta=0.3, delta=0.05, on_infeasible="reject_all"))
    b = groups * k
    rewards = torch.zeros(b, 16)
    rewards[:, -1] = torch.rand(b, generator=g)
    mask = torch.ones(b, 16, dtype=torch.long)
    uids = [f"u{i // k}" for i in range(b)]
    sketches = torch.randn(b, m, generator=g)
    glue = min_seconds(lambda: setgrpo_step(rewards, mask, uids, sketches, record), args.repeats)
    step = setgrpo_step(rewards, mask, uids, sketches, record)
    print(f"driver glue for {groups} groups x K={k}, m={m}: {glue:.3f} s "
          f"(gram {step.metrics['setgrpo/timing_s/gram']:.3f} s, geometry "
          f"{step.metrics['setgrpo/timing_s/geometry']:.3f} s, recovery {step.metrics['setgrpo/timing_s/recovery']:.3f} s)")


if __name__ == "__main__":
    main()
