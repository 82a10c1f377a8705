"""Typed configuration of the ``algorithm.setgrpo`` block (verl dataclass configs).

``hydra_configs/setgrpo_trainer.yaml`` points ``algorithm._target_`` at :class:`SetGRPOAlgoConfig`, a
subclass of verl's ``AlgoConfig`` with one extra field ``setgrpo``, so that verl's own
``omega_conf_to_dataclass(config.algorithm)`` accepts the extra block and rejects misspelled keys.
Every key's meaning and default is documented in the YAML file; this module only validates.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.experimental.callback import Callback

from verl.base_config import BaseConfig
from verl.trainer.config.algorithm import AlgoConfig

from setgrpo_verl.sketch import SketchConfig

from .resume import check_resume

#: Name under which the estimator, the trainer mode and the worker are registered in verl.
SETGRPO_NAME = "setgrpo"

#: The override that switches verl's v1 trainer to the SetGRPO trainer mode.
TRAINER_MODE_OVERRIDE = f"trainer.v1.trainer_mode={SETGRPO_NAME}"

#: ``reward_extra_info`` key of the noise-free score, present when the grader knows it
#: (docs/validation.md#noisy-grader); the calibration stage stores it as ``truth`` in ``paired_scores.npz``.
TRUTH_SCORE_KEY = "truth_score"

#: Ablations of docs/algorithm.md#6-diagnostics (``None`` is the full method).
ABLATIONS = ("spherical_set", "identity_geometry", "safe_anchor_only", "fixed_threshold", "random_discard")


def _field(default: Any = None, doc: str = "", *, factory: Any = None) -> Any:
    """A config field whose ``doc`` is the one description of the key (YAML comment and CLI ``--help``)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class SetGRPOCalibrationConfig(BaseConfig):
    """``algorithm.setgrpo.calibration``: the calibration phase (docs/algorithm.md#2-jrsc, #4-srgo)."""

    files: Optional[Any] = _field(None, "parquet file(s) of calibration prompts in verl's RL format; null = "
                                        "data.train_files (use prompts disjoint from training)")
    num_prompts: int = _field(512, "number of calibration prompts (groups of rollout.n responses), split 50/50 "
                                   "into coverage and risk groups")
    batch_size: Optional[int] = _field(None, "prompts per calibration rollout batch; null = data.train_batch_size")
    split_seed: int = _field(0, "seed of the coverage/risk split, stored in the record")
    on_infeasible: str = _field("error", "when no threshold meets beta: 'error' (stop, report the smallest UCB) "
                                         "or 'reject_all' (a record that accepts no group)")
    only: bool = _field(False, "true: stop after writing the record (a calibration-only run); false: calibrate, "
                               "then train")

    def __post_init__(self):
        if self.num_prompts < 2:
            raise ValueError(
                f"algorithm.setgrpo.calibration.num_prompts={self.num_prompts}: need at least 2 prompts "
                "(one coverage and one risk group); the paper used tens of thousands"
            )
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"algorithm.setgrpo.calibration.batch_size={self.batch_size} must be null or >= 1")
        if self.on_infeasible not in ("error", "reject_all"):
            raise ValueError(
                f"algorithm.setgrpo.calibration.on_infeasible={self.on_infeasible!r}: use 'error' or 'reject_all'"
            )


_SKETCH = SketchConfig()


@dataclass
class SetGRPOSketchConfig(BaseConfig):
    """``algorithm.setgrpo.sketch``: worker-side gradient sketches (docs/sketch.md). The first ten fields are
    :class:`setgrpo_verl.sketch.SketchConfig`'s, with its defaults; the last three choose the micro-batching."""

    rank_out: int = _field(_SKETCH.rank_out, "r_out: rows of each copy's output-side projection, body blocks")
    rank_in: int = _field(_SKETCH.rank_in, "r_in: rows of each copy's input-side projection, body blocks")
    copies: int = _field(_SKETCH.copies, "k: independent Kronecker copies summed per body block (scaled 1/sqrt(k))")
    head_rank_out: int = _field(_SKETCH.head_rank_out, "r_out of the LM head")
    head_rank_in: int = _field(_SKETCH.head_rank_in, "r_in of the LM head")
    head_copies: int = _field(_SKETCH.head_copies, "k of the LM head")
    seed: int = _field(_SKETCH.seed, "seed of the projections (derived from seed and module name on every rank)")
    include_embeddings: bool = _field(_SKETCH.include_embeddings, "also sketch the input-embedding gradient")
    include_norms: bool = _field(_SKETCH.include_norms, "also sketch the normalisation weights")
    identity: bool = _field(_SKETCH.identity, "debug: identity projections, i.e. exact per-response gradients "
                                              "(tiny models only)")
    max_token_len_per_gpu: Optional[int] = _field(None, "token budget of the sketch pass's dynamic micro-batches; "
                                                        "null = the actor's log-prob micro-batching")
    micro_batch_size_per_gpu: Optional[int] = _field(None, "fixed micro-batch size of the sketch pass instead; "
                                                           "null = as above; set at most one of the two")
    fuse_old_log_prob: bool = _field(True, "true: one pass gives verl's old_log_probs and the sketches; false: "
                                           "verl's own log-prob pass, then a separate sketch pass")

    def __post_init__(self):
        try:
            self.to_sketch_config()
        except ValueError as exc:
            raise ValueError(f"algorithm.setgrpo.sketch: {exc}") from None
        for key in ("max_token_len_per_gpu", "micro_batch_size_per_gpu"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"algorithm.setgrpo.sketch.{key}={value} must be null or >= 1")
        if self.max_token_len_per_gpu is not None and self.micro_batch_size_per_gpu is not None:
            raise ValueError(
                "set at most one of algorithm.setgrpo.sketch.max_token_len_per_gpu (dynamic micro-batches) and "
                "micro_batch_size_per_gpu (fixed micro-batches)"
            )

    def to_sketch_config(self) -> SketchConfig:
        """The :class:`~setgrpo_verl.sketch.SketchConfig` these settings describe (what workers and the record use)."""
        return SketchConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SketchConfig)})


@dataclass
class SetGRPOMonitorConfig(BaseConfig):
    """``algorithm.setgrpo.monitor``: online coverage and reversal monitor (docs/algorithm.md#6-diagnostics)."""

    enable: bool = _field(True, "compute setgrpo/online_* metrics when reference scores are present")
    warn_on_drift: bool = _field(True, "log a warning when the running Clopper-Pearson UCB of accepted reversals "
                                       "passes beta (policy drift)")


@dataclass
class SetGRPOConfig(BaseConfig):
    """The ``algorithm.setgrpo`` block: the one configuration schema of SetGRPO (docs/algorithm.md).

    Every field's ``doc`` metadata is its only description: the YAML comments (:func:`render_yaml`) and the
    command line's ``--help`` are generated from it.

    Raises:
        ValueError: a value outside its admissible range, naming the key and the range.
    """

    alpha: float = _field(0.05, "miscoverage of the joint coefficient set: P(T(r') in C) >= 1 - alpha (docs/algorithm.md#2-jrsc)")
    beta: float = _field(0.08, "bound on the conditional reversal risk of accepted updates (docs/algorithm.md#4-srgo)")
    delta: float = _field(0.05, "failure probability of the risk bound (Clopper-Pearson, Bonferroni over "
                                "tau_grid; docs/algorithm.md#4-srgo)")
    tau_grid: Optional[list[float]] = _field(None, "candidate full-geometry thresholds tau; null = 0.00, 0.05, "
                                                   "..., 0.95 (docs/algorithm.md#4-srgo)")
    rho: float = _field(0.1, "scale-free ridge of the set shape Sigma = J J^T + rho tr(J J^T)/(K-1) P (docs/algorithm.md#2-jrsc)")
    recovery_grid: int = _field(100, "N of the recovery grid {0, 1/N, ..., 1} for eta, then bisection to 1e-4 "
                                     "(docs/algorithm.md#3-ggsr)")
    record_path: Optional[str] = _field(None, "frozen calibration record (JSON) to load and check; null = run the "
                                              "calibration phase first (docs/algorithm.md#7-record)")
    record_out: Optional[str] = _field(None, "where the calibration phase writes its record; null = "
                                             "<trainer.default_local_dir>/setgrpo_calibration.json")
    resume_other_record: bool = _field(False, "resuming a checkpoint trained with another calibration record is "
                                              "refused before Ray; true = resume anyway, the online monitor restarting "
                                              "from zero (docs/cli.md#resuming-a-run)")
    group_log: Optional[str] = _field(None, "JSONL file of per-step, per-group status, recovery ratio and "
                                            "projections; null = none")
    ablation: Optional[str] = _field(None, "null (full SetGRPO) or one of spherical_set, identity_geometry, "
                                           "safe_anchor_only, fixed_threshold (needs fixed_tau), random_discard "
                                           "(docs/algorithm.md#6-diagnostics)")
    fixed_tau: Optional[float] = _field(None, "the threshold of ablation=fixed_threshold; null otherwise")
    seed: int = _field(0, "seed of the random_discard ablation's group choice")
    reference_score_key: str = _field("reference_score", "reward_extra_info key of the reference score r' "
                                                         "(the setgrpo_dual reward manager's)")
    calibration: SetGRPOCalibrationConfig = _field(doc="calibration phase", factory=SetGRPOCalibrationConfig)
    sketch: SetGRPOSketchConfig = _field(doc="per-response gradient sketches on the actor workers (docs/sketch.md)",
                                         factory=SetGRPOSketchConfig)
    monitor: SetGRPOMonitorConfig = _field(doc="online coverage / reversal monitor (docs/algorithm.md#6-diagnostics)",
                                           factory=SetGRPOMonitorConfig)

    def __post_init__(self):
        for key in ("alpha", "beta", "delta"):
            value = getattr(self, key)
            if not (0.0 < value < 1.0):
                raise ValueError(f"algorithm.setgrpo.{key}={value} must lie in the open interval (0, 1)")
        if not (math.isfinite(self.rho) and self.rho >= 0.0):
            raise ValueError(f"algorithm.setgrpo.rho={self.rho} must be a finite number >= 0")
        if self.recovery_grid < 1:
            raise ValueError(f"algorithm.setgrpo.recovery_grid={self.recovery_grid} must be >= 1")
        if self.tau_grid is not None:
            grid = [float(t) for t in self.tau_grid]
            if not grid or any(not (-1.0 <= t <= 1.0) for t in grid):
                raise ValueError(f"algorithm.setgrpo.tau_grid={grid} must be a non-empty list of values in [-1, 1]")
        if self.ablation is not None and self.ablation not in ABLATIONS:
            raise ValueError(f"algorithm.setgrpo.ablation={self.ablation!r}: choose null or one of {ABLATIONS}")
        if (self.ablation == "fixed_threshold") != (self.fixed_tau is not None):
            raise ValueError(
                "algorithm.setgrpo.fixed_tau must be set exactly when algorithm.setgrpo.ablation=fixed_threshold "
                f"(got ablation={self.ablation!r}, fixed_tau={self.fixed_tau!r})"
            )


def _documented_fields(cls: Any) -> list[dataclasses.Field]:
    """The schema fields of a config class (verl's BaseConfig adds undocumented private ones)."""
    return [f for f in dataclasses.fields(cls) if "doc" in f.metadata]


def field_doc(key: str) -> str:
    """The description of a key of ``algorithm.setgrpo`` (dotted, e.g. ``"calibration.num_prompts"``).

    Raises:
        KeyError: no such key.
    """
    cls: Any = SetGRPOConfig
    *parents, name = key.split(".")
    for part in parents:
        cls = {f.name: f for f in dataclasses.fields(cls)}[part].default_factory
    return {f.name: f for f in dataclasses.fields(cls)}[name].metadata["doc"]


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def render_yaml(cls: Any = None, indent: int = 4) -> str:
    """The ``algorithm.setgrpo`` block of ``setgrpo_trainer.yaml``: every key with its default and its doc as a
    comment (the shipped YAML is tested to contain exactly this text)."""
    top = cls is None
    cls = SetGRPOConfig if cls is None else cls
    pad = " " * indent
    lines = []
    if top:  # nested blocks are typed through the parent's field annotations
        lines += [f"{pad}# typed config class; unknown (misspelled) keys fail at composition and at conversion",
                  f"{pad}_target_: {cls.__module__}.{cls.__qualname__}"]
    for f in _documented_fields(cls):
        if lines:
            lines.append("")
        lines.append(f"{pad}# {f.metadata['doc']}")
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            lines.append(f"{pad}{f.name}:")
            lines.append(render_yaml(f.default_factory, indent + 2))
        else:
            lines.append(f"{pad}{f.name}: {_yaml_value(f.default)}")
    return "\n".join(lines)


@dataclass
class SetGRPOAlgoConfig(AlgoConfig):
    """verl's ``AlgoConfig`` plus the ``setgrpo`` block (the ``_target_`` of ``algorithm`` in our YAML)."""

    setgrpo: SetGRPOConfig = field(default_factory=SetGRPOConfig)


def setgrpo_config_from(algorithm_config: Any) -> SetGRPOConfig:
    """Typed, validated :class:`SetGRPOConfig` from ``config.algorithm`` (DictConfig, dict or dataclass).

    Raises:
        ValueError: ``algorithm.setgrpo`` is missing (the run was not composed on ``setgrpo_trainer``),
            or a key is misspelled / out of range.
    """
    from omegaconf import DictConfig, OmegaConf

    from verl.utils.config import omega_conf_to_dataclass

    block = algorithm_config.get("setgrpo", None) if algorithm_config is not None else None
    if block is None:
        raise ValueError(
            "config.algorithm has no `setgrpo` block: compose the run on setgrpo_verl's Hydra config "
            "(--config-name setgrpo_trainer)"
        )
    if isinstance(block, SetGRPOConfig):
        return block
    if isinstance(block, DictConfig):
        block = OmegaConf.to_container(block, resolve=True)
    block = {k: v for k, v in dict(block).items() if k != "_target_"}
    try:
        return omega_conf_to_dataclass(block, dataclass_type=SetGRPOConfig)
    except Exception as exc:  # omegaconf raises ConfigKeyError / ValidationError for unknown keys and bad types
        if isinstance(exc, ValueError) and str(exc).startswith("algorithm.setgrpo"):
            raise
        raise ValueError(f"invalid algorithm.setgrpo block: {exc}") from exc


def run_identity(config: Any, setgrpo: SetGRPOConfig) -> dict[str, Any]:
    """The record fields that identify a run (docs/record.md#fields): loss aggregation, sketch, grader and policy.

    One format for every run: ``grader`` is :func:`setgrpo_verl.integration.reward_manager.grader_identity` for the
    ``setgrpo_dual`` reward manager (``{"name": "reward_manager:<name>"}`` otherwise); ``policy`` is the model path
    and the sampling settings that shape the responses (temperature, top_p, response length).
    """
    from .reward_manager import REWARD_MANAGER_NAME, grader_identity

    name = str(config.reward.reward_manager.name)
    grader = grader_identity(config) if name == REWARD_MANAGER_NAME else {"name": f"reward_manager:{name}"}
    rollout = config.actor_rollout_ref.rollout
    return {
        "loss_agg_mode": str(config.actor_rollout_ref.actor.loss_agg_mode),
        "sketch": dataclasses.asdict(setgrpo.sketch.to_sketch_config()),
        "grader": grader,
        "policy": {
            "model": str(config.actor_rollout_ref.model.path),
            "temperature": float(rollout.temperature),
            "top_p": float(rollout.top_p),
            "response_length": int(config.data.max_response_length),
        },
    }


def check_record(record: Any, config: Any, setgrpo: SetGRPOConfig) -> None:
    """The one compatibility check of a calibration record against a run (docs/record.md#compatibility-with-a-run).

    Args:
        record: a :class:`setgrpo_verl.core.CalibrationRecord`.
        config: the composed verl config of the run.
        setgrpo: its validated ``algorithm.setgrpo`` block.

    Raises:
        ValueError: naming the first field whose value differs: K, coefficient mode, alpha / beta / delta / rho,
            ablation, loss aggregation, or a key of the sketch, grader or policy identity.
    """
    record.check_compatible(
        K=int(config.actor_rollout_ref.rollout.n),
        norm_by_std=bool(config.algorithm.get("norm_adv_by_std_in_grpo", True)),
        alpha=setgrpo.alpha,
        beta=setgrpo.beta,
        delta=setgrpo.delta,
        rho=setgrpo.rho,
        ablation=setgrpo.ablation,
        **run_identity(config, setgrpo),
    )


def check_run_config(config: Any) -> Optional[SetGRPOConfig]:
    """Fail fast on a run config that mixes SetGRPO and verl settings inconsistently.

    Args:
        config: the composed verl config (``main_ppo``'s).

    Returns:
        The validated :class:`SetGRPOConfig` when the run uses SetGRPO, else None.

    Raises:
        ValueError: ``algorithm.adv_estimator=setgrpo`` without ``trainer.v1.trainer_mode=setgrpo`` (the message
            names the missing override) or the reverse, ``actor_rollout_ref.rollout.n < 2``, an invalid
            ``algorithm.setgrpo`` block, or an ``algorithm.setgrpo.record_path`` that is missing, does not validate
            or does not match the run (:func:`check_record`).
    """
    estimator = config.algorithm.adv_estimator
    trainer_mode = config.trainer.v1.trainer_mode
    if estimator == SETGRPO_NAME and trainer_mode != SETGRPO_NAME:
        raise ValueError(
            f"algorithm.adv_estimator={SETGRPO_NAME} needs the per-response gradient sketches that only the SetGRPO "
            f"trainer mode computes, but trainer.v1.trainer_mode={trainer_mode}: add the override "
            f"`{TRAINER_MODE_OVERRIDE}` (or use algorithm.adv_estimator=grpo for plain GRPO)"
        )
    if trainer_mode != SETGRPO_NAME:
        return None
    if estimator != SETGRPO_NAME:
        raise ValueError(
            f"{TRAINER_MODE_OVERRIDE} computes SetGRPO advantages: set algorithm.adv_estimator={SETGRPO_NAME} "
            f"(got {estimator!r})"
        )
    if config.actor_rollout_ref.rollout.n < 2:
        raise ValueError("SetGRPO needs groups: set actor_rollout_ref.rollout.n >= 2 (the paper uses 8)")
    setgrpo = setgrpo_config_from(config.algorithm)
    if setgrpo.record_path:
        from setgrpo_verl.core import CalibrationRecord

        path = os.path.expanduser(setgrpo.record_path)
        if not os.path.isfile(path):
            raise ValueError(f"algorithm.setgrpo.record_path={setgrpo.record_path}: no such file; pass the record a "
                             "calibration run wrote, or null to calibrate first")
        check_record(CalibrationRecord.from_json(path), config, setgrpo)
    check_resume(config, setgrpo)
    return setgrpo


class SetGRPOConfigCheck(Callback):
    """Hydra callback (``hydra.callbacks.setgrpo_check`` in ``setgrpo_trainer.yaml``): runs
    :func:`check_run_config` when ``main_ppo`` starts, before Ray and the workers are launched.

    Raises:
        SystemExit: with the :func:`check_run_config` message (Hydra 1.3 turns ordinary exceptions raised by
            callbacks into warnings, so a plain ValueError would not stop the run).
    """

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        try:
            check_run_config(config)
        except ValueError as exc:
            raise SystemExit(f"setgrpo_verl config error: {exc}") from exc
