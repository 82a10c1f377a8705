"""Typed configuration of the ``algorithm.setgrpo`` block (verl dataclass configs).

``hydra_configs/setgrpo_trainer.yaml`` points ``algorithm._target_`` at :class:`SetGRPOAlgoConfig`, a
subclass of verl's ``AlgoConfig`` with one extra field ``setgrpo``, so that verl's own
``omega_conf_to_dataclass(config.algorithm)`` accepts the extra block and rejects misspelled keys.
Every key's meaning and default is documented in the YAML file; this module only validates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.experimental.callback import Callback

from verl.base_config import BaseConfig
from verl.trainer.config.algorithm import AlgoConfig

#: Name under which the estimator, the trainer mode and the worker are registered in verl.
SETGRPO_NAME = "setgrpo"

#: The override that switches verl's v1 trainer to the SetGRPO trainer mode.
TRAINER_MODE_OVERRIDE = f"trainer.v1.trainer_mode={SETGRPO_NAME}"

#: Ablations of docs/algorithm.md#6-diagnostics (``None`` is the full method).
ABLATIONS = ("spherical_set", "identity_geometry", "safe_anchor_only", "fixed_threshold", "random_discard")


@dataclass
class SetGRPOCalibrationConfig(BaseConfig):
    """Calibration phase (docs/algorithm.md#2-jrsc and #4-srgo). See ``algorithm.setgrpo.calibration`` in the YAML."""

    files: Optional[Any] = None
    num_prompts: int = 512
    split_seed: int = 0
    on_infeasible: str = "error"
    only: bool = False

    def __post_init__(self):
        if self.num_prompts < 2:
            raise ValueError(
                f"algorithm.setgrpo.calibration.num_prompts={self.num_prompts}: need at least 2 prompts "
                "(one coverage and one risk group); the paper used tens of thousands"
            )
        if self.on_infeasible not in ("error", "reject_all"):
            raise ValueError(
                f"algorithm.setgrpo.calibration.on_infeasible={self.on_infeasible!r}: use 'error' or 'reject_all'"
            )


@dataclass
class SetGRPOSketchConfig(BaseConfig):
    """Worker-side gradient sketches (docs/algorithm.md#5-sketches). See ``algorithm.setgrpo.sketch`` in the YAML."""

    rank_out: int = 8
    rank_in: int = 8
    seed: int = 0
    include_embeddings: bool = False
    max_token_len_per_gpu: Optional[int] = None
    micro_batch_size_per_gpu: Optional[int] = None
    fuse_old_log_prob: bool = False

    def __post_init__(self):
        if self.rank_out < 1 or self.rank_in < 1:
            raise ValueError(
                f"algorithm.setgrpo.sketch.rank_out={self.rank_out}, rank_in={self.rank_in}: both must be >= 1"
            )
        for key in ("max_token_len_per_gpu", "micro_batch_size_per_gpu"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"algorithm.setgrpo.sketch.{key}={value} must be null or >= 1")
        if self.max_token_len_per_gpu is not None and self.micro_batch_size_per_gpu is not None:
            raise ValueError(
                "set at most one of algorithm.setgrpo.sketch.max_token_len_per_gpu (dynamic micro-batches) and "
                "micro_batch_size_per_gpu (fixed micro-batches)"
            )


@dataclass
class SetGRPOMonitorConfig(BaseConfig):
    """Online coverage / reversal monitor (docs/algorithm.md#6-diagnostics). See ``algorithm.setgrpo.monitor``."""

    enable: bool = True
    warn_on_drift: bool = True


@dataclass
class SetGRPOConfig(BaseConfig):
    """The ``algorithm.setgrpo`` block (docs/algorithm.md).

    Raises:
        ValueError: a value outside its admissible range, naming the key and the range.
    """

    alpha: float = 0.05
    beta: float = 0.08
    delta: float = 0.05
    tau_grid: Optional[list[float]] = None
    rho: float = 0.1
    recovery_grid: int = 100
    record_path: Optional[str] = None
    record_out: Optional[str] = None
    ablation: Optional[str] = None
    fixed_tau: Optional[float] = None
    seed: int = 0
    reference_score_key: str = "reference_score"
    calibration: SetGRPOCalibrationConfig = field(default_factory=SetGRPOCalibrationConfig)
    sketch: SetGRPOSketchConfig = field(default_factory=SetGRPOSketchConfig)
    monitor: SetGRPOMonitorConfig = field(default_factory=SetGRPOMonitorConfig)

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
            "(--config-path <setgrpo_verl>/hydra_configs --config-name setgrpo_trainer)"
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


def check_run_config(config: Any) -> Optional[SetGRPOConfig]:
    """Fail fast on a run config that mixes SetGRPO and verl settings inconsistently.

    Args:
        config: the composed verl config (``main_ppo``'s).

    Returns:
        The validated :class:`SetGRPOConfig` when the run uses SetGRPO, else None.

    Raises:
        ValueError: ``algorithm.adv_estimator=setgrpo`` without ``trainer.v1.trainer_mode=setgrpo`` (the message
            names the missing override) or the reverse, ``actor_rollout_ref.rollout.n < 2``, or an invalid
            ``algorithm.setgrpo`` block.
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
    return setgrpo_config_from(config.algorithm)


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
