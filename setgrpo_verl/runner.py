"""Single-machine SetGRPO: calibrate, train and compare with GRPO on one CPU/GPU box, no Ray, no vLLM.

This is the project's "main job" (README.md): the same pieces verl uses on a cluster, wired into a plain loop.

* rollouts: transformers ``generate`` (K samples per prompt, left-padded prompts, right-padded responses), packed
  into verl's :class:`~verl.DataProto` with verl's key names (``prompts``, ``responses``, ``input_ids``,
  ``attention_mask``, ``position_ids``, ``response_mask``, non-tensor ``uid``);
* rewards: :class:`setgrpo_verl.grading.DualScorer` scores every response twice (point r, reference r');
* geometry: :func:`setgrpo_verl.sketch.compute_sketches` (per-response gradient sketches, docs/algorithm.md#5-sketches),
  Gram matrices ``M_g = S_g S_g^T`` in float64;
* coefficients: :func:`setgrpo_verl.core.setgrpo_coefficients` (SetGRPO) or verl's
  ``compute_grpo_outcome_advantage`` (the GRPO baseline);
* update: verl's ``core_algos.get_policy_loss_fn(<loss_mode>)`` and ``agg_loss`` on an ``FSDPActorConfig`` (PPO-clip
  surrogate, entropy bonus), AdamW, gradient clipping; a step whose coefficients are all zero performs no
  optimizer step (the parameters stay bit-identical);
* metrics: verl's ``compute_data_metrics`` / ``compute_timing_metrics`` names plus ``setgrpo/*``, one JSON line per
  step.

Run directory layout (every stage writes ``COMPLETE`` last; a failed stage writes ``FAILED`` with the reason)::

    <run-dir>/config.json                 RunConfig of the last command (also per stage)
    <run-dir>/calibration/record.json     the frozen CalibrationRecord (docs/algorithm.md#7-record)
    <run-dir>/calibration/paired_scores.npz  point [G,K], reference [G,K], gram [G,K,K] (re-fit offline)
    <run-dir>/calibration/rollouts.jsonl  prompts, responses and both scores
    <run-dir>/train_<estimator>/metrics.jsonl, groups.jsonl, checkpoint/
    <run-dir>/report/*.png, summary.txt
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "PROFILES",
    "RunConfig",
    "UserInputError",
    "generate_rollouts",
    "inspect_record",
    "policy_update",
    "quickstart",
    "run_calibration",
    "run_training",
]

#: Marker written last into a finished stage directory; its absence means "incomplete".
COMPLETE = "COMPLETE"
FAILED = "FAILED"


class UserInputError(ValueError):
    """Bad input (missing file, invalid rubric, too few prompts, unreachable judge, bad flag); the message names the
    fix. The CLI prints it as ``error: ...`` and exits with status 2."""


# ----------------------------------------------------------------------------------------------------------- config
@dataclass
class RunConfig:
    """Everything a run depends on; written to ``<run-dir>/config.json`` (and each stage directory).

    Units: lengths in tokens, ``lr`` per optimizer step, probabilities in (0, 1).
    ``None`` for ``model`` / ``data`` / ``judge_model`` means the embedded offline defaults.
    """

    profile: str = "default"
    # inputs
    model: str | None = None
    data: str | None = None
    judge: str = "local"
    judge_model: str | None = None
    judge_base_url: str | None = None
    judge_api_key_env: str = "OPENAI_API_KEY"
    judge_temperature: float = 1.0
    seed: int = 0
    # rollout (verl: actor_rollout_ref.rollout.*)
    rollout_n: int = 4
    max_prompt_length: int = 96
    max_response_length: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    gen_batch_groups: int = 8
    # sketch (docs/algorithm.md#5-sketches)
    sketch_rank: int = 8
    sketch_seed: int = 0
    # calibration (docs/algorithm.md#2-jrsc, #4-srgo)
    calib_groups: int = 48
    alpha: float = 0.5
    beta: float = 0.65
    delta: float = 0.2
    rho: float = 0.1
    split_seed: int = 0
    tau_grid: tuple[float, ...] | None = (0.0, 0.2, 0.4, 0.6)
    on_infeasible: str = "error"
    ablation: str | None = None
    fixed_tau: float | None = None
    # training (verl: actor_rollout_ref.actor.*)
    train_steps: int = 3
    train_groups: int = 4
    lr: float = 1e-5
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    entropy_coeff: float = 0.0
    loss_agg_mode: str = "token-mean"
    policy_loss: str = "vanilla"
    norm_by_std: bool = True
    micro_batch_size: int = 8
    online_monitor: bool = True

    @classmethod
    def from_profile(cls, profile: str = "default", **overrides: Any) -> RunConfig:
        """The named profile (:data:`PROFILES`) with ``overrides`` applied.

        Raises:
            UserInputError: unknown profile or field name, or an invalid value (see :meth:`validate`).
        """
        if profile not in PROFILES:
            raise UserInputError(f"unknown profile {profile!r}; choose one of {sorted(PROFILES)}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - names
        if unknown:
            raise UserInputError(f"unknown run settings {sorted(unknown)}; known: {sorted(names)}")
        cfg = cls(**{**PROFILES[profile], **overrides, "profile": profile})
        cfg.validate()
        return cfg

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> RunConfig:
        """Read a ``config.json`` written by :meth:`to_json` (UserInputError if missing or malformed)."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise UserInputError(f"{os.fspath(path)} does not exist; is this a setgrpo-verl run directory?") from None
        if data.get("tau_grid") is not None:
            data["tau_grid"] = tuple(data["tau_grid"])
        cfg = cls(**data)
        cfg.validate()
        return cfg

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the config as indented JSON."""
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    def validate(self) -> None:
        """Check ranges and choices.

        Raises:
            UserInputError: naming the field, the bad value and the allowed range.
        """
        def bad(name: str, why: str) -> None:
            raise UserInputError(f"{name}={getattr(self, name)!r} is invalid: {why}")

        if self.rollout_n < 2:
            bad("rollout_n", "GRPO needs K >= 2 responses per prompt")
        for name in ("alpha", "beta", "delta"):
            if not 0.0 < getattr(self, name) < 1.0:
                bad(name, "must lie in (0, 1)")
        for name in ("max_prompt_length", "max_response_length", "gen_batch_groups", "calib_groups", "train_groups",
                     "micro_batch_size", "sketch_rank"):
            if getattr(self, name) < 1:
                bad(name, "must be a positive integer")
        if self.train_steps < 0:
            bad("train_steps", "must be >= 0")
        if self.judge not in ("local", "openai"):
            bad("judge", "choose 'local' or 'openai'")
        if self.judge == "openai" and not (self.judge_base_url and self.judge_model):
            bad("judge", "--judge openai needs --judge-base-url and --judge-model")
        if self.loss_agg_mode not in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                      "seq-mean-token-sum-norm"):
            bad("loss_agg_mode", "see verl's actor.loss_agg_mode")
        if not 0 < self.temperature:
            bad("temperature", "must be > 0 (sampling)")
        if self.on_infeasible not in ("error", "reject_all"):
            bad("on_infeasible", "choose 'error' or 'reject_all'")


#: Named presets. ``default`` is the quickstart (about 10 minutes on 2 CPU cores with SmolLM2-135M); ``smoke`` is
#: the CI end-to-end profile (under 3 minutes). The statistical levels are looser than the paper's (alpha 0.05,
#: beta 0.08), because the paper's levels need hundreds of calibration groups (README, "Known limits").
PROFILES: dict[str, dict[str, Any]] = {
    "default": {},  # the RunConfig field defaults
    "smoke": dict(rollout_n=3, max_prompt_length=80, max_response_length=12, calib_groups=12, alpha=0.5,
                  beta=0.8, delta=0.3, tau_grid=(0.0, 0.3, 0.6), train_steps=2, train_groups=3, lr=1e-5,
                  gen_batch_groups=6),
}


# ------------------------------------------------------------------------------------------------------- run dirs
def _stage_dir(run_dir: Path, name: str, *, overwrite: bool) -> Path:
    """Create ``run_dir/name`` fresh; refuse to clobber a finished or running stage unless ``overwrite``."""
    stage = Path(run_dir) / name
    if stage.exists():
        if not overwrite:
            state = "finished" if (stage / COMPLETE).exists() else "incomplete"
            raise UserInputError(f"{stage} already exists ({state}); pass --overwrite to replace it or choose "
                                 "another --run-dir")
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    return stage


@contextlib.contextmanager
def _stage(stage: Path):
    """Mark ``stage`` FAILED (with the reason) if the body raises, COMPLETE if it returns."""
    try:
        yield
    except BaseException as exc:
        (stage / FAILED).write_text(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
        raise
    (stage / COMPLETE).write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + "\n")


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """JSON lines hold numbers or null (NaN/inf -> null), like verl's file logger after json.dumps."""
    out = {}
    for k, v in d.items():
        v = v.item() if isinstance(v, (torch.Tensor, np.generic)) else v
        out[k] = None if isinstance(v, float) and not math.isfinite(v) else v
    return out


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _progress(iterable=None, **kw):
    from tqdm.auto import tqdm

    return tqdm(iterable, dynamic_ncols=True, leave=False, **kw)


# ------------------------------------------------------------------------------------------------------- rollouts
def _chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as a single user turn with the model's chat template (plain text if it has none)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers >= 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


def generate_rollouts(model, tokenizer, prompts: list[str], *, n: int, max_response_length: int,
                     temperature: float = 1.0, top_p: float = 1.0, batch_groups: int = 8, seed: int = 0,
                     progress: bool = True):
    """Sample ``n`` responses per prompt with transformers' ``generate`` and pack them as a verl ``DataProto``.

    Args:
        model, tokenizer: a causal LM (eval mode) and its tokenizer (``padding_side`` is handled here).
        prompts: G prompt strings; each becomes one chat user turn.
        n: responses per prompt (verl ``rollout.n`` = K).
        max_response_length: new tokens per response; responses are right-padded to exactly this length.
        temperature, top_p: sampling parameters (``do_sample=True``).
        batch_groups: prompts per ``generate`` call (each call holds ``batch_groups * n`` sequences).
        seed: torch seed of the sampler (the same seed gives the same responses for the same policy).
        progress: show a progress bar over ``generate`` calls.

    Returns:
        ``DataProto`` with B = G*n rows ordered group-major (rows ``g*n .. g*n+n-1`` belong to prompt g):
        tensors ``prompts`` [B, P] (left-padded), ``responses`` [B, R], ``input_ids`` [B, P+R],
        ``attention_mask`` [B, P+R], ``position_ids`` [B, P+R], ``response_mask`` [B, R] (int64, 1 up to and
        including the first EOS); non-tensors ``uid`` (group index as str), ``prompt_text``, ``response_text``.
    """
    from verl import DataProto
    from verl.utils.torch_functional import get_response_mask, pad_2d_list_to_length

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
        else tokenizer.eos_token_id
    prompt_ids = [_chat_prompt_ids(tokenizer, p) for p in prompts]
    width = max(len(p) for p in prompt_ids)
    left = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids], dtype=torch.long)
    left_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    responses = []
    with torch.no_grad():
        for start in _progress(range(0, len(prompts), batch_groups), desc="rollout", unit="batch",
                               disable=not progress):
            ids, mask = left[start:start + batch_groups], left_mask[start:start + batch_groups]
            torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                                 top_p=top_p, top_k=0, max_new_tokens=max_response_length, num_return_sequences=n,
                                 pad_token_id=pad_id, eos_token_id=eos)
            responses.extend(out[:, width:].tolist())
    resp = pad_2d_list_to_length(responses, pad_id, max_length=max_response_length)[:, :max_response_length]
    response_mask = get_response_mask(resp, eos_token=eos, dtype=torch.long)
    prompts_t = left.repeat_interleave(n, dim=0)
    prompt_mask = left_mask.repeat_interleave(n, dim=0)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    texts = tokenizer.batch_decode([r[: int(m.sum())] for r, m in zip(resp.tolist(), response_mask)],
                                   skip_special_tokens=True)
    return DataProto.from_dict(
        tensors=dict(prompts=prompts_t, responses=resp, input_ids=torch.cat([prompts_t, resp], dim=1),
                     attention_mask=attention_mask, position_ids=position_ids, response_mask=response_mask),
        non_tensors=dict(uid=np.array([str(i // n) for i in range(len(responses))], dtype=object),
                         prompt_text=np.array([p for p in prompts for _ in range(n)], dtype=object),
                         response_text=np.array(texts, dtype=object)),
    )


# ------------------------------------------------------------------------------------------------------ the update
def _actor_config(cfg: RunConfig, batch_size: int):
    """verl's actor config for the policy-loss functions (``clip_ratio*``, ``loss_agg_mode``, ``global_batch_info``)."""
    from verl.workers.config.actor import FSDPActorConfig

    return FSDPActorConfig(strategy="fsdp", rollout_n=cfg.rollout_n, ppo_mini_batch_size=batch_size,
                           ppo_micro_batch_size_per_gpu=cfg.micro_batch_size, clip_ratio=cfg.clip_ratio,
                           clip_ratio_low=cfg.clip_ratio, clip_ratio_high=cfg.clip_ratio,
                           loss_agg_mode=cfg.loss_agg_mode, entropy_coeff=cfg.entropy_coeff, use_torch_compile=False)


def _forward_log_probs(model, batch, *, with_entropy: bool, temperature: float = 1.0):
    """Response-token log-probs [b, R] (and entropies [b, R]) of a micro-batch with verl's torch_functional helpers;
    logits are divided by the rollout temperature first, as verl's actor does."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    responses = batch.batch["responses"]
    r = responses.shape[1]
    logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                   position_ids=batch.batch["position_ids"], use_cache=False).logits[:, -r - 1:-1]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logits = logits / temperature
    log_prob = logprobs_from_logits(logits, responses)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return log_prob, entropy


def compute_log_probs(model, batch, micro_batch_size: int, temperature: float = 1.0):
    """Old-policy log-probs and entropies, both float32 [B, R] without grad, of a rollout ``DataProto``."""
    lps, ents = [], []
    with torch.no_grad():
        for mb in batch.split(micro_batch_size):
            lp, ent = _forward_log_probs(model, mb, with_entropy=True, temperature=temperature)
            lps.append(lp)
            ents.append(ent)
    return torch.cat(lps), torch.cat(ents)


def policy_update(model, optimizer, batch, cfg: RunConfig) -> dict[str, float]:
    """One PPO-clip optimizer step on a rollout batch, with verl's policy-loss function and ``agg_loss``.

    The batch (one PPO mini-batch, ``ppo_epochs = 1``) must hold ``advantages`` [B, R] float32 (response-level
    coefficients broadcast over response tokens, zero for rejected groups) and ``old_log_probs`` [B, R]. The
    loss is ``pg_loss - entropy_coeff * entropy`` aggregated with ``cfg.loss_agg_mode`` over the whole mini-batch
    (``global_batch_info`` makes micro-batch gradient accumulation exact). At ratio 1 its gradient is
    ``-sum_i c_i g_i`` up to one global constant (docs/algorithm.md#0-notation).

    If every advantage is exactly zero (all groups rejected or degenerate) nothing is computed and no optimizer
    step is taken, so the parameters (and AdamW's state) stay bit-identical; ``actor/update_skipped`` is 1.

    Returns:
        verl metric names: ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``,
        ``actor/entropy``, ``actor/grad_norm``, ``actor/lr``, ``actor/update_skipped``.
    """
    from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn

    lr = optimizer.param_groups[0]["lr"]
    mask = batch.batch["response_mask"]
    if not bool(batch.batch["advantages"].ne(0).any()):
        return {"actor/update_skipped": 1.0, "actor/lr": lr}
    actor_cfg = _actor_config(cfg, len(batch))
    actor_cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=len(batch),
                                       loss_scale_factor=actor_cfg.loss_scale_factor)
    loss_fn = get_policy_loss_fn(cfg.policy_loss)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    n_micro = 0
    for mb in batch.split(cfg.micro_batch_size):
        log_prob, entropy = _forward_log_probs(model, mb, with_entropy=True, temperature=cfg.temperature)
        m = mb.batch["response_mask"]
        pg_loss, pg_metrics = loss_fn(old_log_prob=mb.batch["old_log_probs"], log_prob=log_prob,
                                      advantages=mb.batch["advantages"], response_mask=m,
                                      loss_agg_mode=cfg.loss_agg_mode, config=actor_cfg)
        entropy_loss = agg_loss(loss_mat=entropy, loss_mask=m, loss_agg_mode=cfg.loss_agg_mode,
                                **actor_cfg.global_batch_info)
        loss = pg_loss - cfg.entropy_coeff * entropy_loss
        loss.backward()
        n_micro += 1
        for k, v in pg_metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        sums["actor/pg_loss"] = sums.get("actor/pg_loss", 0.0) + float(pg_loss.detach())  # partial sums
        sums["actor/entropy"] = sums.get("actor/entropy", 0.0) + float(entropy_loss.detach())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    out = {k: (v if k in ("actor/pg_loss", "actor/entropy") else v / n_micro) for k, v in sums.items()}
    out.update({"actor/grad_norm": float(grad_norm), "actor/lr": lr, "actor/update_skipped": 0.0})
    return out


# ------------------------------------------------------------------------------------------ data, judge, geometry
def load_prompt_rows(cfg: RunConfig, tokenizer) -> list[dict]:
    """RubricHub rows for the run: ``cfg.data`` (JSONL/JSON/parquet) or the embedded IFBench conversion.

    Every row is validated with the grading data model (a criterion list with positive points, known rules);
    rows whose chat-formatted prompt exceeds ``cfg.max_prompt_length`` tokens are dropped (verl's
    ``data.filter_overlong_prompts``). The rows are shuffled with ``cfg.seed``.

    Raises:
        UserInputError: missing/unreadable file, an invalid row (the grading message names the row and field),
            or no prompt short enough.
    """
    from .grading import as_rubric, load_ifbench_rubrics, read_rubric_rows

    if cfg.data is None:
        rows, source = load_ifbench_rubrics(), "the embedded IFBench rubric conversion"
    else:
        path = Path(cfg.data).expanduser()
        if not path.is_file():
            raise UserInputError(f"--data {cfg.data}: no such file; pass a RubricHub-format .jsonl/.json/.parquet "
                                 "file (rows with question, id, rubrics) or omit --data for the embedded IFBench "
                                 "prompts")
        try:
            rows = read_rubric_rows(path)
        except (ValueError, OSError) as exc:
            raise UserInputError(f"--data {cfg.data}: {exc}") from None
        source = str(path)
    kept = []
    for row in rows:
        try:
            rubric = as_rubric(row)
        except ValueError as exc:
            raise UserInputError(f"{source}: {exc}; fix or remove that row") from None
        if not any(c.points > 0 for c in rubric.criteria):
            raise UserInputError(f"{source}: rubric row {rubric.id!r} has no criterion with positive points, so its "
                                 "score (sum of met points / sum of positive points) is undefined; give it at least "
                                 "one positive-points criterion or remove the row")
        if len(_chat_prompt_ids(tokenizer, rubric.question)) <= cfg.max_prompt_length:
            kept.append(row)
    if not kept:
        raise UserInputError(f"{source}: none of its {len(rows)} prompts fits in --max-prompt-length "
                             f"{cfg.max_prompt_length} tokens; raise --max-prompt-length")
    random.Random(cfg.seed).shuffle(kept)
    return kept


def grader_config(cfg: RunConfig) -> dict:
    """The grader config (:func:`setgrpo_verl.grading.build_grader`) of the run's judge."""
    if cfg.judge == "local":
        return {"type": "local_hf", "model_path": cfg.judge_model, "temperature": cfg.judge_temperature,
                "seed": cfg.seed}
    return {"type": "openai", "base_url": cfg.judge_base_url, "model": cfg.judge_model,
            "api_key": os.environ.get(cfg.judge_api_key_env) or "EMPTY", "temperature": cfg.judge_temperature,
            "seed": cfg.seed}


def build_scorer(cfg: RunConfig):
    """The run's :class:`~setgrpo_verl.grading.DualScorer`; an HTTP judge is probed once before any rollout.

    Raises:
        UserInputError: the judge model cannot be loaded or the HTTP judge cannot be reached (names the URL).
    """
    from .grading import DualScorer

    try:
        scorer = DualScorer(grader_config(cfg))
    except (ValueError, FileNotFoundError, OSError) as exc:
        raise UserInputError(f"judge: {exc}") from None
    if cfg.judge == "openai":
        _probe_judge(cfg, scorer)
    return scorer


def _probe_judge(cfg: RunConfig, scorer) -> None:
    from .grading import GradingError

    probe = {"question": "Say hello.", "id": "probe", "rubrics": [{"criterion": "The response greets.", "points": 1}]}
    try:
        scorer.score([None], ["Hello!"], [probe])
    except (GradingError, OSError, ValueError) as exc:
        raise UserInputError(
            f"the judge at {cfg.judge_base_url} (model {cfg.judge_model!r}) cannot be reached or did not answer: "
            f"{exc}. Start the OpenAI-compatible server, fix --judge-base-url/--judge-model, or use --judge local"
        ) from None


def score_batch(scorer, batch, rows: list[dict], n: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Score every response twice; returns point and reference ``[B]`` float64 and ``grading/*`` metrics."""
    rubrics = [rows[i // n] for i in range(len(batch))]
    scores = scorer.score([None] * len(batch), list(batch.non_tensor_batch["response_text"]), rubrics)
    return (torch.from_numpy(scores.point), torch.from_numpy(scores.reference), scores.metrics())


def sketch_config(cfg: RunConfig):
    """The :class:`~setgrpo_verl.sketch.SketchConfig` of the run (rank r_o = r_i = ``cfg.sketch_rank``)."""
    from .sketch import SketchConfig

    return SketchConfig(rank_out=cfg.sketch_rank, rank_in=cfg.sketch_rank, seed=cfg.sketch_seed)


def sketch_batch(model, batch, cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-response gradient sketches float32 ``[B, m]`` and old log-probs ``[B, R]`` (one forward + backward per
    micro-batch, :func:`setgrpo_verl.sketch.compute_sketches`, docs/algorithm.md#5-sketches)."""
    from .sketch import compute_sketches

    out = compute_sketches(model, batch.batch["input_ids"], batch.batch["attention_mask"],
                           batch.batch["response_mask"], sketch_config(cfg),
                           position_ids=batch.batch["position_ids"], loss_agg_mode=cfg.loss_agg_mode,
                           temperature=cfg.temperature, micro_batch_size=cfg.micro_batch_size)
    return out.sketches, out.log_probs


def _token_level(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """verl's token_level_rewards: the outcome score on the last response token, zeros elsewhere [B, R]."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = (response_mask.sum(-1) - 1).clamp(min=0)
    out[torch.arange(len(scores)), last] = scores.float()
    return out


def _min_groups(cfg: RunConfig) -> tuple[int, int]:
    """Fewest non-degenerate coverage groups (alpha) and accepted risk groups (beta, delta, grid) that can work."""
    from .core import DEFAULT_TAU_GRID, clopper_pearson_upper, min_calibration_groups

    m = len(cfg.tau_grid or DEFAULT_TAU_GRID)
    n_risk = 1
    while clopper_pearson_upper([0], [n_risk], 1 - cfg.delta / m)[0] > cfg.beta and n_risk < 100000:
        n_risk += 1
    return min_calibration_groups(cfg.alpha), n_risk


def _load_policy(cfg: RunConfig):
    from .models import load_causal_lm

    try:
        return load_causal_lm(cfg.model)
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise UserInputError(f"--model: {exc}") from None


def _load_tokenizer(cfg: RunConfig):
    """The policy's tokenizer alone (fast), to validate prompts before any model is loaded."""
    from transformers import AutoTokenizer

    from .models import embedded_model_dir

    try:
        path = embedded_model_dir() if cfg.model is None else Path(cfg.model).expanduser()
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"{cfg.model!r} is not a local Hugging Face model directory (no config.json); "
                                    "pass a directory saved with save_pretrained or omit --model for the embedded "
                                    "SmolLM2-135M-Instruct")
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise UserInputError(f"--model: {exc}") from None


def _policy_identity(cfg: RunConfig) -> dict:
    from .models import EMBEDDED_MODEL_NAME

    return {"model": EMBEDDED_MODEL_NAME if cfg.model is None else os.path.abspath(cfg.model),
            "rollout_n": cfg.rollout_n, "max_response_length": cfg.max_response_length,
            "temperature": cfg.temperature, "top_p": cfg.top_p}


@contextlib.contextmanager
def _timer(name: str, timing: dict[str, float]):
    t0 = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - t0


def _check_prompt_budget(cfg: RunConfig, n_rows: int, *, calibrating: bool) -> None:
    """Fail before any rollout when the calibration or the prompt set cannot possibly be large enough."""
    if calibrating:
        need_cov, need_risk = _min_groups(cfg)
        need = 2 * max(need_cov, need_risk)  # the calibration groups are split 50/50 into coverage and risk
        if cfg.calib_groups < need:
            raise UserInputError(
                f"--calib-groups {cfg.calib_groups} is too small: alpha={cfg.alpha} needs >= {need_cov} "
                f"non-degenerate coverage groups and beta={cfg.beta}, delta={cfg.delta} over "
                f"{len(cfg.tau_grid or ()) or 20} thresholds need >= {need_risk} accepted risk groups even with no "
                f"reversal; with a 50/50 split use --calib-groups >= {need} (more, since degenerate groups are "
                "dropped), or raise --alpha / --beta / --delta")
    train_need = cfg.train_groups if cfg.train_steps > 0 else 0
    if n_rows < cfg.calib_groups + train_need:
        raise UserInputError(
            f"the prompt set has {n_rows} usable prompts (after --max-prompt-length {cfg.max_prompt_length}) but "
            f"calibration needs {cfg.calib_groups} and training at least {train_need} more, disjoint from them; "
            "provide more prompts (--data), lower --calib-groups / --groups-per-step, or raise --max-prompt-length")


def _rollout_jsonl(batch, point, reference, n: int, rows: list[dict], extra: dict | None = None) -> list[str]:
    lines = []
    for g in range(len(batch) // n):
        sl = slice(g * n, (g + 1) * n)
        lines.append(json.dumps({
            **(extra or {}), "group": g, "prompt_id": rows[g].get("id"), "prompt": rows[g].get("question"),
            "responses": list(batch.non_tensor_batch["response_text"][sl]),
            "point": point[sl].tolist(), "reference": reference[sl].tolist()}, ensure_ascii=False))
    return lines


def run_calibration(cfg: RunConfig, run_dir: str | os.PathLike, *, overwrite: bool = False):
    """Calibration stage: rollouts of ``cfg.calib_groups`` prompts, two scorings, sketches, core ``calibrate``.

    Implements the driver side of docs/algorithm.md#2-jrsc, #4-srgo, #5-sketches and #7-record at the initial policy (no update). Writes
    ``<run_dir>/calibration/{record.json, paired_scores.npz, rollouts.jsonl, config.json, COMPLETE}``;
    ``paired_scores.npz`` holds ``point`` / ``reference`` float64 [G, K], ``gram`` float64 [G, K, K] and
    ``prompt_id`` [G], so the record can be re-fitted offline with :func:`setgrpo_verl.core.calibrate`.

    Returns:
        the frozen :class:`~setgrpo_verl.core.CalibrationRecord`.

    Raises:
        UserInputError: bad inputs (see :func:`load_prompt_rows`, :func:`build_scorer`), too few prompts or
            calibration groups for alpha/beta/delta, an existing stage without ``overwrite``, or a calibration the
            core rejects (too few non-degenerate groups, no risk-feasible threshold: its message names the fix).
    """
    from .core import calibrate
    import verl  # noqa: F401  - load verl (and its plugins, i.e. ours) before our verl glue module
    from .integration.estimator import group_gram, group_rows

    run_dir = Path(run_dir)
    rows = load_prompt_rows(cfg, _load_tokenizer(cfg))
    _check_prompt_budget(cfg, len(rows), calibrating=True)
    scorer = build_scorer(cfg)
    model, tokenizer = _load_policy(cfg)
    stage = _stage_dir(run_dir, "calibration", overwrite=overwrite)
    cfg.to_json(run_dir / "config.json")
    cfg.to_json(stage / "config.json")
    with _stage(stage):
        _seed_everything(cfg.seed)
        calib = rows[: cfg.calib_groups]
        n = cfg.rollout_n
        points, refs, grams, lines = [], [], [], []
        timing: dict[str, float] = {}
        bar = _progress(total=len(calib), desc="calibration groups", unit="group")
        for start in range(0, len(calib), cfg.gen_batch_groups):
            chunk = calib[start:start + cfg.gen_batch_groups]
            with _timer("gen", timing):
                batch = generate_rollouts(model, tokenizer, [r["question"] for r in chunk], n=n,
                                          max_response_length=cfg.max_response_length,
                                          temperature=cfg.temperature,
                                          top_p=cfg.top_p, batch_groups=len(chunk),
                                          seed=cfg.seed * 100003 + start, progress=False)
            with _timer("reward", timing):
                point, reference, _ = score_batch(scorer, batch, chunk, n)
            with _timer("sketch", timing):
                sketches, _ = sketch_batch(model, batch, cfg)
            groups, _ = group_rows(batch.non_tensor_batch["uid"], batch.batch["response_mask"])
            points.append(point[groups])
            refs.append(reference[groups])
            grams.append(group_gram(sketches, groups))
            lines += _rollout_jsonl(batch, point, reference, n, chunk, {"offset": start})
            bar.update(len(chunk))
        bar.close()
        point, reference, gram = torch.cat(points), torch.cat(refs), torch.cat(grams)
        (stage / "rollouts.jsonl").write_text("\n".join(lines) + "\n")
        np.savez(stage / "paired_scores.npz", point=point.numpy(), reference=reference.numpy(), gram=gram.numpy(),
                 prompt_id=np.array([str(r.get("id")) for r in calib]))
        metadata = {"loss_agg_mode": cfg.loss_agg_mode, "sketch": dataclasses.asdict(sketch_config(cfg)),
                    "grader": scorer.identity, "policy": _policy_identity(cfg)}
        try:
            record = calibrate(point, reference, gram, alpha=cfg.alpha, beta=cfg.beta, delta=cfg.delta,
                               tau_grid=cfg.tau_grid, rho=cfg.rho, split_seed=cfg.split_seed,
                               norm_by_std=cfg.norm_by_std, ablation=cfg.ablation, fixed_tau=cfg.fixed_tau,
                               on_infeasible=cfg.on_infeasible, metadata=metadata)
        except ValueError as exc:
            raise UserInputError(f"calibration failed: {exc} (the paired scores are kept in {stage}/"
                                 "paired_scores.npz)") from None
        record.to_json(stage / "record.json")
        _write_json(stage / "timing.json", {f"timing_s/{k}": v for k, v in timing.items()})
    print(f"calibration timing (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timing.items()))
    print(f"calibration record: {stage / 'record.json'}\n{format_table4(record)}")
    return record


def _resolve_record(cfg: RunConfig, run_dir: Path, record_path: Path | None, scorer):
    """Load the frozen record (``record_path`` or the run's own), calibrating first when the run has none."""
    from .core import CalibrationRecord

    if record_path is None:
        calib = run_dir / "calibration"
        if not calib.exists():
            print(f"no calibration record in {run_dir}: calibrating first")
            run_calibration(cfg, run_dir)
        elif not (calib / COMPLETE).exists():
            raise UserInputError(f"{calib} is incomplete (no {COMPLETE} marker: an earlier calibration failed or was "
                                 "interrupted); rerun `setgrpo-verl calibrate --overwrite` or pass --record")
        record_path = calib / "record.json"
    try:
        record = CalibrationRecord.from_json(record_path)
        record.check_compatible(K=cfg.rollout_n, norm_by_std=cfg.norm_by_std, loss_agg_mode=cfg.loss_agg_mode,
                                grader=scorer.identity, sketch=dataclasses.asdict(sketch_config(cfg)))
    except ValueError as exc:
        raise UserInputError(f"--record {record_path}: {exc}") from None
    return record


def run_training(cfg: RunConfig, run_dir: str | os.PathLike, *, estimator: str = "setgrpo",
                 record_path: str | os.PathLike | None = None, overwrite: bool = False) -> Path:
    """Training stage: ``cfg.train_steps`` on-policy steps of SetGRPO (or plain GRPO with ``estimator="grpo"``).

    Each step: rollouts of ``cfg.train_groups`` prompts (seed ``cfg.seed + step``, the same for both estimators),
    two scorings, then
      * ``setgrpo``: sketches + old log-probs in one pass, coefficients from the frozen record via the verl
        estimator's glue :func:`setgrpo_verl.integration.estimator.setgrpo_step` (docs/algorithm.md#3-ggsr and #6-diagnostics),
        online coverage / reversal monitor on the reference scores;
      * ``grpo``: old log-probs and verl's ``compute_grpo_outcome_advantage`` on the point scores;
    then one PPO-clip optimizer step (:func:`policy_update`; none when every coefficient is zero). Training prompts
    follow the calibration prompts in the shuffled prompt order (disjoint from them) and cycle when exhausted.

    Writes ``<run_dir>/train_<estimator>/{metrics.jsonl, groups.jsonl, checkpoint/, config.json, COMPLETE}``.
    ``metrics.jsonl``: one object per step with verl's metric names (``training/global_step``,
    ``critic/score/mean``, ``actor/entropy``, ``actor/pg_loss``, ``timing_s/*``, ...) plus ``setgrpo/*``.

    Returns:
        the stage directory.

    Raises:
        UserInputError: bad inputs, a missing/incompatible record, too few prompts, or an existing stage.
    """
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.trainer.ppo.metric_utils import compute_data_metrics, compute_timing_metrics

    from .core import OnlineRiskMonitor
    import verl  # noqa: F401  - see run_calibration
    from .integration.estimator import setgrpo_step

    if estimator not in ("setgrpo", "grpo"):
        raise UserInputError(f"--estimator {estimator!r}: choose setgrpo or grpo")
    run_dir = Path(run_dir)
    rows = load_prompt_rows(cfg, _load_tokenizer(cfg))
    _check_prompt_budget(cfg, len(rows), calibrating=False)
    scorer = build_scorer(cfg)
    record = _resolve_record(cfg, run_dir, record_path, scorer) if estimator == "setgrpo" else None
    model, tokenizer = _load_policy(cfg)
    train_rows = rows[cfg.calib_groups:]
    stage = _stage_dir(run_dir, f"train_{estimator}", overwrite=overwrite)
    cfg.to_json(stage / "config.json")
    if not (run_dir / "config.json").exists():
        cfg.to_json(run_dir / "config.json")
    with _stage(stage):
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        monitor = OnlineRiskMonitor(record) if record is not None and cfg.online_monitor else None
        n = cfg.rollout_n
        with open(stage / "metrics.jsonl", "w") as mf, open(stage / "groups.jsonl", "w") as gf:
            bar = _progress(range(1, cfg.train_steps + 1), desc=f"train {estimator}", unit="step")
            for step in bar:
                timing: dict[str, float] = {}
                first = ((step - 1) * cfg.train_groups) % len(train_rows)
                step_rows = [train_rows[(first + j) % len(train_rows)] for j in range(cfg.train_groups)]
                with _timer("step", timing):
                    with _timer("gen", timing):
                        batch = generate_rollouts(model, tokenizer, [r["question"] for r in step_rows], n=n,
                                                  max_response_length=cfg.max_response_length,
                                                  temperature=cfg.temperature, top_p=cfg.top_p,
                                                  batch_groups=cfg.gen_batch_groups, seed=cfg.seed * 100003 + 7919 * step,
                                                  progress=False)
                    mask = batch.batch["response_mask"]
                    with _timer("reward", timing):
                        point, reference, metrics = score_batch(scorer, batch, step_rows, n)
                    rewards = _token_level(point, mask)
                    uid = batch.non_tensor_batch["uid"]
                    if record is not None:
                        with _timer("sketch", timing):
                            sketches, old_log_probs = sketch_batch(model, batch, cfg)
                        with _timer("adv", timing):
                            out = setgrpo_step(rewards, mask, uid, sketches, record,
                                               reference_scores=reference if monitor else None, monitor=monitor)
                        advantages = out.advantages
                        metrics.update(out.metrics)
                        res = out.result
                        for g in range(res.coefficients.shape[0]):
                            rows_g = out.groups[g]
                            gf.write(json.dumps(_finite({
                                "step": step, "group": g, "prompt_id": step_rows[g].get("id"),
                                "status": res.status[g], "recovery_ratio": float(res.recovery_ratio[g]),
                                "m_full": float(res.m_full[g]), "m_reward": float(res.m_reward[g]),
                                "point": point[rows_g].tolist(), "reference": reference[rows_g].tolist(),
                                "coefficients": res.coefficients[g].tolist()})) + "\n")
                    else:
                        with _timer("old_log_prob", timing):
                            old_log_probs, _ = compute_log_probs(model, batch, cfg.micro_batch_size, cfg.temperature)
                        with _timer("adv", timing):
                            advantages, _ = compute_grpo_outcome_advantage(rewards, mask, index=uid, epsilon=1e-6,
                                                                           norm_adv_by_std_in_grpo=cfg.norm_by_std)
                    batch.batch["token_level_scores"] = rewards
                    batch.batch["token_level_rewards"] = rewards
                    batch.batch["advantages"] = advantages.float()
                    batch.batch["returns"] = advantages.float()
                    batch.batch["old_log_probs"] = old_log_probs.detach().float()
                    with _timer("update_actor", timing):
                        metrics.update(policy_update(model, optimizer, batch, cfg))
                    if metrics["actor/update_skipped"]:
                        _, entropy = compute_log_probs(model, batch, cfg.micro_batch_size, cfg.temperature)
                        from verl.trainer.ppo.core_algos import agg_loss

                        metrics["actor/entropy"] = float(agg_loss(entropy, mask, cfg.loss_agg_mode))
                metrics.update(compute_data_metrics(batch, use_critic=False))
                metrics.update(compute_timing_metrics(batch, timing))
                metrics["critic/score_reference/mean"] = float(reference.mean())
                metrics.update({"training/global_step": step, "training/epoch": (step - 1) * cfg.train_groups
                                // len(train_rows)})
                mf.write(json.dumps(_finite(metrics), sort_keys=True) + "\n")
                mf.flush()
                gf.flush()
                bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}",
                                acc=f"{metrics.get('setgrpo/accepted_ratio', 1.0):.2f}")
            bar.close()
        model.save_pretrained(stage / "checkpoint", safe_serialization=True)
        tokenizer.save_pretrained(stage / "checkpoint")
    return stage


# --------------------------------------------------------------------------------------------- record, quickstart
def format_table4(record, label: str = "this run") -> str:
    """The paper's Table 4 row (Cov., Risk, Q_alpha, tau_sel, N, F, ECR, U) of a record, as a fixed-width table."""
    row = record.table4_row()
    cells = [label, str(row["Cov."]), str(row["Risk"]), f"{row['Qα']:.3f}",
             "none" if row["τsel"] is None else f"{row['τsel']:.2f}", str(row["N"]), str(row["F"]),
             "nan" if math.isnan(row["ECR"]) else f"{row['ECR']:.4f}", f"{row['U']:.3f}"]
    head = ["Backbone", "Cov.", "Risk", "Qα", "τsel", "N", "F", "ECR", "U"]
    widths = [max(len(h), len(c)) for h, c in zip(head, cells)]
    fmt = "  ".join("{:<%d}" % widths[0] if i == 0 else "{:>%d}" % w for i, w in enumerate(widths))
    return fmt.format(*head) + "\n" + fmt.format(*cells)


def _record_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "calibration" / "record.json" if (p / "calibration").is_dir() else p / "record.json"
    if not p.is_file():
        raise UserInputError(f"{path}: no calibration record there; pass a record.json or a run directory "
                             "made by `setgrpo-verl calibrate`")
    return p


def inspect_record(path: str | os.PathLike, *, thresholds: bool = False) -> str:
    """Text view of a frozen record: its Table 4 row, levels and identities (and, optionally, the threshold grid).

    Raises:
        UserInputError: no record at ``path`` or the record does not validate (edited, wrong schema).
    """
    from .core import CalibrationRecord

    p = _record_path(path)
    try:
        rec = CalibrationRecord.from_json(p)
    except ValueError as exc:
        raise UserInputError(str(exc)) from None
    label = str(rec.policy.get("model", "policy")).split(" (")[0]
    lines = [format_table4(rec, label), "",
             f"alpha={rec.alpha}  beta={rec.beta}  delta={rec.delta}  rho={rec.rho}  K={rec.K}  "
             f"norm_by_std={rec.norm_by_std}  loss_agg_mode={rec.loss_agg_mode}  ablation={rec.ablation}",
             f"UCB at tau_sel={rec.ucb_sel:.4f} (<= beta={rec.beta})  coverage on risk groups="
             f"{rec.coverage_risk_set:.3f} (target >= {1 - rec.alpha:.2f})  degenerate groups dropped="
             f"{rec.n_degenerate}",
             f"grader: {rec.grader}", f"policy: {rec.policy}", f"created {rec.created_at}, file {p}"]
    if thresholds:
        lines += ["", f"{'tau':>6} {'N_j':>5} {'F_j':>5} {'UCB_j':>8} {'U_j':>7}"]
        for t, nj, fj, u, uu in zip(rec.tau_grid, rec.n_accepted, rec.n_reversals, rec.ucb, rec.utility):
            mark = "  <- tau_sel" if t == rec.tau_sel else ""
            lines.append(f"{t:6.2f} {nj:5d} {fj:5d} {u:8.4f} {uu:7.3f}{mark}")
    return "\n".join(lines)


def quickstart(cfg: RunConfig, run_dir: str | os.PathLike, *, baseline: bool = True, overwrite: bool = False) -> str:
    """calibrate + train SetGRPO (+ the GRPO baseline on the same seeds) + report; ``COMPLETE`` written last.

    Returns:
        the closing summary: Table 4 row, per-step accepted ratio and mean recovery ratio, where the plots are.

    Raises:
        UserInputError: see :func:`run_calibration`, :func:`run_training`; an existing run directory without
            ``overwrite``.
    """
    from . import report

    run_dir = Path(run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            raise UserInputError(f"{run_dir} already exists; pass --overwrite to replace it or choose --run-dir")
        if not (run_dir / "config.json").exists():
            raise UserInputError(f"{run_dir} is not empty and is not a setgrpo-verl run directory; refusing to "
                                 "delete it - choose another --run-dir")
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    run_calibration(cfg, run_dir)
    run_training(cfg, run_dir, estimator="setgrpo")
    if baseline:
        run_training(cfg, run_dir, estimator="grpo")
    summary = report.make_report(run_dir)
    (run_dir / COMPLETE).write_text(f"{time.perf_counter() - t0:.1f} s\n")
    return summary + f"\n\nquickstart finished in {time.perf_counter() - t0:.0f} s; run directory {run_dir}"
