"""Every phase of one judge-profile training step and calibration batch on this host, next to its floor.

Runs the phases through the code a CPU run runs, in one process on the embedded SmolLM2-135M-Instruct, at the
judge profile's sizes (``setgrpo-verl quickstart --judge local``, the main job's sizes and judge before it moved to
the rules grader: a step of 4 groups x K=4, a calibration batch of 32 groups in rollout batches of at most 64; 96
prompt + 24 response tokens, the longest the profile allows) and the precision the launcher picks for this CPU
(``--precision``):

* rollout: ``TransformersRolloutServer._generate_batch`` (the CPU rollout); the decode step is
  (24 new tokens - 1 new token) / 23 of the same batch;
* reward: the reward manager's ``DualScorer`` with the profile's grader (the local judge) on IFBench rubrics, every
  response twice;
* fused old-log-prob + sketch pass: ``sketch_and_log_probs`` through verl's engine code on the FSDP2-wrapped actor;
* actor update: verl's engine ``train_batch`` (the CPU backend's engine, setgrpo_verl/verl_cpu/engine.py) with
  verl's ``ppo_loss`` (the composed actor config), AdamW;
* weight sync: the rollout adapter's writes into the shared weight buffer and the server's copy from it into its
  parameters (in one process; between processes only the buffer's layout travels through Ray besides);
* checkpoint: verl's ``FSDPCheckpointManager.save_checkpoint`` (model, optimizer, extra) to a temporary directory.

Each floor is the larger of the phase's multiply-adds (``benchmarks/floors.py``) at the host's matmul rate measured
at the phase's row count and dtype and its bytes moved at the host's copy rate (docs/benchmarks.md#step-floor).
The calibration batch's sketch pass and reward are measured on one micro-batch of 16 rows and scaled to the
batch's 128 (the micro-batches are alike). The last lines are the ratios measured / floor. ``--quick`` measures the
host rates and the decode step only, over 9 new tokens (under half a minute on a 2-core machine); ``--phases``
picks phases. It sets ``OMP_WAIT_POLICY=PASSIVE`` unless set, as a CPU run does.

    python benchmarks/bench_step_floor.py [--quick] [--precision bf16|fp32] [--phases rollout,reward,actor]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: what a CPU run sets

from _engine import CPUActorEngine, single_rank_fsdp2  # noqa: E402  (before verl: selects verl's CPU platform)
from bench_integration import _batch  # noqa: E402
import floors  # noqa: E402

import torch  # noqa: E402

#: The judge profile's sizes (setgrpo_verl.runner.profiles.PROFILES["judge"], the main job's before it moved to the
#: rules grader; the floor table of docs/benchmarks.md was measured at them), the launcher's micro-batch and
#: ``rollout.max_num_seqs``.
GROUPS, K, PROMPT, RESPONSE = 4, 4, 96, 24
CALIBRATION_GROUPS, ROLLOUT_BATCH, MICRO = 32, 64, 16
#: New tokens of the decode measurement with ``--quick``.
QUICK_TOKENS = 9


def cpu_name() -> str:
    """``lscpu``'s model name and which bf16 units the CPU has (AVX-512 BF16, AMX)."""
    text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    flags = set(fields.get("Flags", "").split())
    units = [label for flag, label in (("avx512_bf16", "AVX-512 BF16"), ("amx_bf16", "AMX-BF16")) if flag in flags]
    return f"{name}, {os.cpu_count()} CPUs, {' + '.join(units) or 'no bf16 units'}"


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def matmul_rate(rows: int, dtype: torch.dtype, inner: int = 576, outer: int = 1536, seconds: float = 0.3) -> float:
    """Multiply-adds per second of ``[rows, inner] @ [inner, outer]`` in ``dtype`` (the MLP's shape), the best of
    three runs of about ``seconds`` each."""
    a, b = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, outer, dtype=dtype)
    a @ b
    reps = max(1, int(seconds / max(timed(lambda: a @ b)[0], 1e-6)))
    best = min(timed(lambda: [a @ b for _ in range(reps)])[0] for _ in range(3))
    return rows * inner * outer * reps / best


def copy_rate(nbytes: int = 256 * 2**20) -> float:
    """Bytes moved (read + written) per second by ``Tensor.copy_`` of ``nbytes``, the best of five."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    return 2 * nbytes / min(timed(lambda: dst.copy_(src))[0] for _ in range(5))


#: One part of a phase's work: (work, rows of its matrix products, dtype); ``rows`` 0 for work without products.
Part = tuple[floors.Work, int, torch.dtype]


class Table:
    """Rows of (phase, measured seconds, parts of its work); floors from the host rates at printing."""

    def __init__(self):
        self.rows: list[tuple[str, float, list[Part]]] = []

    def add(self, phase: str, seconds: float, *parts: Part) -> None:
        self.rows.append((phase, seconds, list(parts)))

    def shapes(self) -> set[tuple[int, torch.dtype]]:
        """(rows, dtype) of every part's products: the matmul rates the floors need."""
        return {(rows, dtype) for _, _, parts in self.rows for _, rows, dtype in parts if rows}

    def floors(self, rates: dict, copy: float) -> list[tuple[str, float, float, float, float]]:
        """(phase, measured, floor, compute, memory) seconds: compute the sum of each part's multiply-adds at its
        rate, memory all bytes at the copy rate."""
        out = []
        for phase, seconds, parts in self.rows:
            compute = sum(w.macs / rates[rows, dtype] for w, rows, dtype in parts if w.macs)
            memory = sum(w.bytes for w, _, _ in parts) / copy
            out.append((phase, seconds, max(compute, memory), compute, memory))
        return out


def bucket(rows: float) -> int:
    """``rows`` rounded to a power of two in log scale, at least 16: the row counts whose matmul rate is measured."""
    return max(16, 2 ** round(math.log2(max(1.0, rows))))


def rollout_phase(table: Table, model_dir: str, dtype: torch.dtype, quick: bool) -> list[str]:
    """Rollout rows: the decode step at the calibration batch (64), and unless ``quick`` the step's and calibration
    batch's whole rollouts. Returns the decoded responses of the step's batch (for the reward phase)."""
    from setgrpo_verl.verl_cpu.rollout import TransformersRolloutServer

    server = TransformersRolloutServer(model_dir, response_length=RESPONSE, max_batch_size=ROLLOUT_BATCH, seed=0,
                                       dtype=dtype, num_threads=torch.get_num_threads())
    config, element = server.model.config, torch.finfo(dtype).bits // 8
    weights = sum(p.numel() for p in server.model.parameters()) * element
    gen = torch.Generator().manual_seed(0)
    vocab = server.tokenizer.vocab_size

    def batch(groups: int) -> list[list[int]]:
        prompts = [torch.randint(100, vocab, (PROMPT,), generator=gen).tolist() for _ in range(groups)]
        return [p for p in prompts for _ in range(K)]

    def key(tokens: int) -> tuple:
        return (1.0, 1.0, -1, tokens, True)  # temperature, top_p, top_k, new tokens, log-probs (what verl asks)

    groups = ROLLOUT_BATCH // K
    full_batch = batch(groups)
    new_tokens = QUICK_TOKENS if quick else RESPONSE
    server._generate_batch(full_batch, key(2))  # warm-up
    one, _ = timed(lambda: server._generate_batch(full_batch, key(1)))
    full, outs = timed(lambda: server._generate_batch(full_batch, key(new_tokens)))
    steps = max(len(o.token_ids) for o in outs)  # generate runs until every row ended
    context = PROMPT + steps // 2
    table.add(f"decode step (batch {ROLLOUT_BATCH}, context ~{context})", (full - one) / max(1, steps - 1),
              (floors.decode_step(config, ROLLOUT_BATCH, context, weights, element), ROLLOUT_BATCH, dtype))
    if quick:
        return []

    def parts(groups: int) -> list[Part]:
        return [(floors.prefill(config, groups, PROMPT, weights, element), bucket(groups * PROMPT), dtype),
                (floors.decode_steps(config, groups * K, PROMPT, RESPONSE, weights, element), groups * K, dtype)]

    step_batch = batch(GROUPS)
    seconds, outs = timed(lambda: server._generate_batch(step_batch, key(RESPONSE)))
    table.add(f"step: rollout ({GROUPS} x {K})", seconds, *parts(GROUPS))
    calibration = full + sum(timed(lambda: server._generate_batch(batch(groups), key(RESPONSE)))[0]
                             for _ in range(CALIBRATION_GROUPS // groups - 1))
    table.add(f"calibration: rollout ({CALIBRATION_GROUPS} x {K}, batches of {ROLLOUT_BATCH})", calibration,
              *[(w.scaled(CALIBRATION_GROUPS / groups), r, d) for w, r, d in parts(groups)])
    return [server.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]


class LinearCounter:
    """The work of every ``nn.Linear`` call while active (a global module hook): its multiply-adds per row count of
    its product (:func:`bucket`) and its weight's bytes (read once per call): what the judge's forwards do, padding
    included."""

    def __init__(self):
        self.macs: dict[int, float] = {}
        self.bytes = 0.0

    def hook(self, module, args, output):
        if isinstance(module, torch.nn.Linear):
            rows = args[0].numel() // module.in_features
            key = bucket(rows)
            self.macs[key] = self.macs.get(key, 0.0) + rows * module.in_features * module.out_features
            self.bytes += module.weight.numel() * module.weight.element_size()

    def parts(self, dtype: torch.dtype) -> list[Part]:
        return [(floors.Work(macs, 0.0), rows, dtype) for rows, macs in self.macs.items()] + [
            (floors.Work(0.0, self.bytes), 0, dtype)]

    def __enter__(self):
        self.handle = torch.nn.modules.module.register_module_forward_hook(self.hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def reward_phase(table: Table, responses: list[str], grader_config: dict) -> None:
    """Reward rows: the step's responses scored twice by the profile's grader (as verl's reward loop calls the
    manager: one request per response, concurrently); the calibration batch's as 8 such micro-batches."""
    from setgrpo_verl.grading import DualScorer, GradingItem, Rubric, build_grader
    from setgrpo_verl.grading.convert import load_ifbench_rubrics

    scorer = DualScorer(build_grader(grader_config), scoring_indices=(0, 1))
    rubrics = [Rubric.from_row(row) for row in load_ifbench_rubrics(GROUPS)]

    def score(tag: str) -> float:
        # a tag per round: the judge caches P(yes) by content, and a real step scores text it has not seen
        items = [GradingItem(response=f"{text} {tag}", rubric=rubrics[i // K], nonce=f"{tag}-{i}")
                 for i, text in enumerate(responses)]

        async def all_items():
            await asyncio.gather(*(scorer.ascore([item]) for item in items))

        return timed(lambda: asyncio.run(all_items()))[0]

    score("warm-up")
    with LinearCounter() as count:
        seconds = score("step")
    parts = count.parts(torch.float32)  # the local judge runs in float32
    table.add(f"step: reward ({GROUPS * K} responses x 2 scorings)", seconds, *parts)
    table.add(f"calibration: reward ({CALIBRATION_GROUPS * K} x 2, 8 x step)", 8 * seconds,
              *[(w.scaled(8), r, d) for w, r, d in parts])


def actor_phases(table: Table, model_dir: str, config, compute: torch.dtype, rollout_dtype: torch.dtype,
                 checkpoint_config) -> None:
    """Sketch pass, actor update, weight sync and checkpoint rows, on the FSDP2-wrapped actor."""
    from functools import partial

    from verl.utils import tensordict_utils as tu
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    from setgrpo_verl.integration.worker import sketch_and_log_probs
    from setgrpo_verl.models import load_causal_lm
    from setgrpo_verl.sketch import SketchConfig
    from setgrpo_verl.verl_cpu.rollout import TransformersRolloutServer
    from setgrpo_verl.verl_cpu.weight_buffer import Layout, WeightBuffer

    actor_cfg = config.actor_rollout_ref.actor
    model, tokenizer = load_causal_lm(model_dir, dtype=torch.float32)  # verl's fsdp_config.model_dtype=fp32
    single_rank_fsdp2(model, compute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(actor_cfg.optim.lr),
                                  weight_decay=float(actor_cfg.optim.weight_decay))
    engine = CPUActorEngine(model, optimizer, float(actor_cfg.grad_clip), compute)
    mcfg, rows = model.config, GROUPS * K
    params = sum(p.numel() for p in model.parameters())
    element = torch.finfo(compute).bits // 8
    tokens = bucket(MICRO * (PROMPT + RESPONSE))  # rows of the micro-batch's products

    data = _batch(rows, PROMPT, RESPONSE, mcfg.vocab_size)
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=MICRO)
    model.eval()
    sketch = SketchConfig()
    sketch_and_log_probs(engine, data, sketch, loss_agg_mode=actor_cfg.loss_agg_mode)  # warm-up
    seconds, _ = timed(lambda: sketch_and_log_probs(engine, data, sketch, loss_agg_mode=actor_cfg.loss_agg_mode))
    per_token = floors.sketch_pass(mcfg, sketch, PROMPT, RESPONSE, MICRO)
    work = floors.Work(rows * (PROMPT + RESPONSE) * (per_token["F"] + per_token["B"] + per_token["S"]),
                       2 * params * element * rows / MICRO)  # weights read in the forward and the backward
    table.add(f"step: old-log-prob + sketch pass ({rows} rows)", seconds, (work, tokens, compute))
    scale = CALIBRATION_GROUPS * K / rows
    table.add(f"calibration: sketch pass ({CALIBRATION_GROUPS * K} rows, {scale:.0f} x step)", scale * seconds,
              (work.scaled(scale), tokens, compute))

    train = data.clone()
    nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    responses = train["responses"].unbind()
    gen = torch.Generator().manual_seed(1)
    train["loss_mask"] = train["response_mask"]
    train["old_log_probs"] = nested([-torch.rand(r.numel(), generator=gen) for r in responses])
    train["advantages"] = nested([torch.full((r.numel(),), float(torch.randn(1, generator=gen))) for r in responses])
    tu.assign_non_tensor(train, global_batch_size=rows, calculate_entropy=False, compute_loss=True,
                         use_fused_kernels=False)
    loss_fn = partial(ppo_loss, config=omega_conf_to_dataclass(actor_cfg))

    def update():
        model.train()
        engine.train_batch(train.clone(), loss_fn)
        model.eval()

    update()  # warm-up (AdamW's states)
    seconds, _ = timed(update)
    table.add(f"step: actor update ({rows} rows, AdamW)", seconds,
              (floors.update(mcfg, rows, PROMPT, RESPONSE, params, element), tokens, compute))

    server = TransformersRolloutServer(model_dir, response_length=RESPONSE, max_batch_size=ROLLOUT_BATCH,
                                       dtype=rollout_dtype, num_threads=torch.get_num_threads())
    state = model.state_dict()
    buffer = WeightBuffer.create(Layout.of([(n, tuple(t.shape)) for n, t in state.items()], rollout_dtype))
    del state
    buffer.unlink()

    def sync():  # the adapter's writes into the shared buffer, then the server's copy into its parameters
        buffer.write_all(model.state_dict().items())
        server._load(buffer.views, 1)

    sync()
    seconds, _ = timed(sync)
    rollout_bytes = torch.finfo(rollout_dtype).bits // 8
    # read the float32 master weights, write the rollout's copy
    table.add("step: weight sync (in process, no Ray)", seconds,
              (floors.Work(0, params * (4 + rollout_bytes)), 0, compute))

    manager = FSDPCheckpointManager(model=model, optimizer=optimizer, lr_scheduler=None, processing_class=tokenizer,
                                    checkpoint_config=checkpoint_config)
    with tempfile.TemporaryDirectory() as tmp:
        save = lambda step: manager.save_checkpoint(  # noqa: E731
            local_path=os.path.join(tmp, f"global_step_{step}"), global_step=step, max_ckpt_to_keep=1)
        save(1)
        seconds, _ = timed(lambda: save(2))
        written = sum(f.stat().st_size for f in Path(tmp, "global_step_2").rglob("*") if f.is_file())
    table.add(f"step: checkpoint ({written / 2**20:.0f} MiB written)", seconds,
              (floors.Work(0, 2 * written), 0, compute))  # one copy of what verl writes


def main() -> None:
    from hydra import compose, initialize_config_dir

    from setgrpo_verl.runner.cli import build_parser, overrides_from_args
    from setgrpo_verl.runner.launch import cpu_precision
    from setgrpo_verl.runner.run import make_plan

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="host rates and the decode step only")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                    help="default: what the launcher picks for this CPU (bf16 with bf16 units)")
    ap.add_argument("--phases", default="rollout,reward,actor",
                    help="comma-separated subset of rollout, reward (needs rollout), actor (sketch pass, update, "
                         "weight sync, checkpoint)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the process's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    precision = args.precision or cpu_precision()
    # the judge profile with its local judge: the sizes above and the grader the floor table was measured with
    cli = build_parser().parse_args(["quickstart", "--judge", "local", "--precision", precision])
    plan = make_plan(cli, overrides_from_args(cli))
    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent, check=False).stdout.strip() or "unknown"
    print(f"host: {cpu_name()}; torch threads {torch.get_num_threads()}; commit {commit}")
    print(f"default profile: step {GROUPS} x K={K}, calibration batch {CALIBRATION_GROUPS} x K={K}, "
          f"{PROMPT} + {RESPONSE} tokens, {precision}")

    copy = copy_rate()
    table = Table()
    phases = {"rollout"} if args.quick else set(args.phases.split(","))
    responses = rollout_phase(table, str(plan.model), compute, args.quick) if "rollout" in phases else []
    if "reward" in phases and responses:
        reward_phase(table, responses, plan.grader)
    if "actor" in phases:
        hydra_dir = Path(__file__).resolve().parents[1] / "hydra_configs"
        with initialize_config_dir(str(hydra_dir), version_base=None):
            config = compose("setgrpo_trainer", overrides=plan.common)
        actor_phases(table, str(plan.model), config, compute, compute, config.actor_rollout_ref.actor.checkpoint)
    # the host's rates after the phases, the better of two measurements (other jobs on the cores lower them)
    copy = max(copy, copy_rate())
    rates = {shape: max(matmul_rate(*shape), matmul_rate(*shape)) for shape in sorted(table.shapes(), key=str)}
    print(f"host rates: copy {copy / 1e9:.1f} GB/s (read + write); "
          "matmul [rows, 576] x [576, 1536], G multiply-adds/s: "
          + ", ".join(f"{rows} rows {str(dtype).removeprefix('torch.')} {r / 1e9:.0f}"
                      for (rows, dtype), r in sorted(rates.items(), key=lambda kv: (str(kv[0][1]), kv[0][0]))))
    result = table.floors(rates, copy)
    print(f"{'phase':<46} {'measured s':>10} {'floor s':>9} {'compute s':>9} {'memory s':>9} {'ratio':>6}")
    for phase, measured, floor, compute_s, memory_s in result:
        print(f"{phase:<46} {measured:>10.3f} {floor:>9.3f} {compute_s:>9.3f} {memory_s:>9.3f} "
              f"{measured / floor:>6.1f}")
    for phase, measured, floor, _, _ in result:
        print(f"{phase.split(' (')[0]} / floor {measured / floor:.2f}")

if __name__ == "__main__":
    main()
