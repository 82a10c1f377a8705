"""Typed configuration of the ``algorithm.setgrpo`` block (verl dataclass configs).

``hydra_configs/setgrpo_trainer.yaml`` points ``algorithm._target_`` at :class:`SetGRPOAlgoConfig`, a
subclass of verl's ``AlgoConfig`` with one extra field ``setgrpo``, so that verl's own
``omega_conf_to_dataclass(config.algorithm)`` accepts the extra block and rejects misspelled keys.
Every key's meaning and default is documented in the YAML file; this module only validates the block. The check of
a whole run against it, before Ray, is :mod:`setgrpo_verl.integration.run_check`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from verl.base_config import BaseConfig
from verl.trainer.config.algorithm import AlgoConfig

from setgrpo_verl.core import ABLATIONS, CalibrationSettings
from setgrpo_verl.core.shards import parse_part
from setgrpo_verl.core.srgo import DEFAULT_TAU_GRID
from setgrpo_verl.sketch import SketchConfig

from .reward_config import TRUTH_SCORE_KEY

#: Name under which the estimator, the trainer mode and the worker are registered in verl.
SETGRPO_NAME = "setgrpo"
#: ``algorithm.setgrpo.variant``: the paper's calibrated method, or reliability weighting
#: (docs/algorithm.md#9-reliability-weighting).
PAPER_VARIANT, RELIABILITY_VARIANT = "paper", "reliability"
SETGRPO_VARIANTS = (PAPER_VARIANT, RELIABILITY_VARIANT)

#: The override that switches verl's v1 trainer to the SetGRPO trainer mode.
TRAINER_MODE_OVERRIDE = f"trainer.v1.trainer_mode={SETGRPO_NAME}"

#: The trainer mode of verl's stock sync trainer plus the grading metrics of the ``setgrpo_dual`` reward manager
#: (the command line's GRPO baseline, docs/verl_integration.md#trainer-mode).
GRADED_SYNC_NAME = "graded_sync"

__all__ = [
    "ABLATIONS", "GRADED_SYNC_NAME", "SETGRPO_NAME", "TRAINER_MODE_OVERRIDE", "TRUTH_SCORE_KEY", "SetGRPOAlgoConfig",
    "PAPER_VARIANT", "RELIABILITY_VARIANT", "SETGRPO_VARIANTS", "SetGRPOConfig", "field_doc", "render_yaml",
    "setgrpo_config_from",
]


def _field(default: Any = None, doc: str = "", *, factory: Any = None) -> Any:
    """A config field whose ``doc`` is the one description of the key (YAML comment and CLI ``--help``)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class SetGRPOCalibrationConfig(BaseConfig):
    """``algorithm.setgrpo.calibration``: the calibration phase (docs/algorithm.md#2-jrsc, #4-srgo)."""

    files: Optional[Any] = _field(None, "parquet file(s) of calibration prompts in verl's RL format, disjoint "
                                        "from data.train_files (checked); null = data.train_files, only with only=true")
    num_prompts: int = _field(512, "number of calibration prompts (groups of rollout.n responses), split 50/50 "
                                   "into coverage and risk groups up to coverage_groups coverage groups")
    coverage_groups: Optional[int] = _field(1000, "most coverage groups (the conformal radius needs a few hundred "
                                                  "to about 1,000); every further group goes to the risk tests; null "
                                                  "= 50/50 at any size (docs/algorithm.md#41-defaults)")
    batch_size: Optional[int] = _field(None, "prompts per calibration rollout batch; null = data.train_batch_size")
    split_seed: int = _field(0, "seed of the coverage/risk split, stored in the record")
    on_infeasible: str = _field("error", "when no threshold meets beta: 'error' (stop, report the smallest UCB) "
                                         "or 'reject_all' (a record that accepts no group)")
    only: bool = _field(False, "true: stop after writing the record (a calibration-only run); false: calibrate, "
                               "then train")
    chunk_batches: int = _field(1, "calibration batches rolled out before they are scored, sketched and written as "
                                   "shards (one weight sync per further chunk); 1 = stream batch by batch, so a "
                                   "stop loses at most one batch (docs/record.md#calibration-shards)")
    shard: Optional[str] = _field(None, "I/N: calibrate only the I-th of N parts of the calibration batches (0 <= I "
                                        "< N; every N-th batch from I), writing shards and no record, for N jobs at "
                                        "once; merge them with setgrpo-verl merge-calibration; needs only=true; "
                                        "null = all (docs/record.md#calibration-shards)")
    max_grading_failure_ratio: float = _field(0.02, "largest share of the calibration groups that may be left out "
                                                    "because grading failed (a judge error) before calibration "
                                                    "refuses to finish: such groups are not missing at random "
                                                    "(docs/verl_integration.md#partial-groups)")

    def __post_init__(self):
        ratio = self.max_grading_failure_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) <= 1.0:
            raise ValueError(f"algorithm.setgrpo.calibration.max_grading_failure_ratio={ratio!r} must be a number in "
                             "[0, 1] (0: no group may fail grading; the default 0.02 allows 2 %)")
        if self.num_prompts < 2:
            raise ValueError(
                f"algorithm.setgrpo.calibration.num_prompts={self.num_prompts}: need at least 2 prompts "
                "(one coverage and one risk group); the paper used tens of thousands"
            )
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"algorithm.setgrpo.calibration.batch_size={self.batch_size} must be null or >= 1")
        if self.chunk_batches < 1:
            raise ValueError(f"algorithm.setgrpo.calibration.chunk_batches={self.chunk_batches} must be >= 1")
        if self.shard is not None:
            try:
                _, parts = parse_part(self.shard)
            except ValueError as exc:
                raise ValueError(f"algorithm.setgrpo.calibration.{exc}") from None
            if parts > 1 and not self.only:
                raise ValueError(f"algorithm.setgrpo.calibration.shard={self.shard} calibrates a part of the prompts "
                                 "and writes no record, so nothing can train after it: set calibration.only=true and "
                                 "train with the record that setgrpo-verl merge-calibration builds from all parts")

    def part(self) -> tuple[int, int]:
        """``(I, N)`` of ``shard`` (``(0, 1)`` when null: every batch)."""
        return (0, 1) if self.shard is None else parse_part(self.shard)


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
    warn_on_drift: bool = _field(True, "log a warning when the anytime-valid evidence that accepted updates "
                                       "reverse more often than beta reaches 1/delta (policy drift)")


@dataclass
class SetGRPOConfig(BaseConfig):
    """The ``algorithm.setgrpo`` block: the one configuration schema of SetGRPO (docs/algorithm.md).

    Every field's ``doc`` metadata is its only description: the YAML comments (:func:`render_yaml`) and the
    command line's ``--help`` are generated from it.

    Raises:
        ValueError: a value outside its admissible range, naming the key and the range.
    """

    variant: str = _field("paper", "paper: JRSC + GGSR + SRGO, a calibrated record and gradient sketches (the paper's "
                                   "method); reliability: GRPO on the mean of the two scorings, each group weighted by "
                                   "the share of its spread that is signal, with no calibration, record or sketches "
                                   "(docs/algorithm.md#9-reliability-weighting)")
    alpha: float = _field(0.05, "miscoverage of the joint coefficient set: P(T(r') in C) >= 1 - alpha (docs/algorithm.md#2-jrsc)")
    beta: float = _field(0.08, "bound on the conditional reversal risk of accepted updates (docs/algorithm.md#4-srgo)")
    delta: float = _field(0.05, "failure probability of the risk bound (Clopper-Pearson; Bonferroni over "
                                "tau_grid or the fixed sequence, see srgo_procedure; docs/algorithm.md#4-srgo)")
    tau_grid: Optional[list[float]] = _field(None, "candidate full-geometry thresholds tau; null = 0.00, 0.05, "
                                                   "..., 0.95 (docs/algorithm.md#4-srgo)")
    srgo_procedure: str = _field("bonferroni", "SRGO's test over tau_grid: bonferroni (the paper's, each threshold "
                                               "at delta/m) or fixed_sequence (Learn then Test from tau_start down, "
                                               "each at delta; about half the groups) (docs/algorithm.md#4-srgo)")
    tau_start: Optional[float] = _field(None, "fixed_sequence only: the first threshold tested, one of tau_grid, "
                                              "chosen without the calibration prompts (e.g. a pilot record's "
                                              "tau_sel); null for bonferroni")
    tau_start_pilot: Optional[str] = _field(None, "fixed_sequence only: a pilot record (JSON) calibrated on other "
                                                  "prompts whose tau_sel is tau_start; the record names it as the "
                                                  "start's source (checked: same start, disjoint prompts); null = "
                                                  "tau_start set by the user")
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
        if self.variant not in SETGRPO_VARIANTS:
            raise ValueError(f"algorithm.setgrpo.variant={self.variant!r}: choose one of {SETGRPO_VARIANTS}")
        if self.variant == RELIABILITY_VARIANT:
            # the keys of the calibrated method: with reliability weighting nothing would read them
            paper_only = {"record_path": self.record_path, "ablation": self.ablation, "fixed_tau": self.fixed_tau,
                          "tau_start": self.tau_start, "tau_start_pilot": self.tau_start_pilot}
            cal = self.calibration
            only = cal.get("only", False) if isinstance(cal, Mapping) else cal.only
            paper_only["calibration.only"] = only or None
            set_keys = [f"algorithm.setgrpo.{k}={v}" for k, v in paper_only.items() if v is not None]
            if set_keys:
                raise ValueError(f"{', '.join(set_keys)}: the reliability variant has no calibration, record or "
                                 "threshold; remove the key(s), or set algorithm.setgrpo.variant=paper")
        # the settings' one validation (core's CalibrationSettings), so that a bad block fails at composition; rho = 0
        # is refused again by check_run_config for the GRPO map (it needs algorithm.norm_adv_by_std_in_grpo)
        self.calibration_settings(norm_by_std=False)

    def calibration_settings(self, norm_by_std: bool = True) -> CalibrationSettings:
        """The :class:`setgrpo_verl.core.CalibrationSettings` of this block: what ``calibrate`` receives and the record
        stores; the one place a run's settings are built from its configuration.

        Args:
            norm_by_std: verl's ``algorithm.norm_adv_by_std_in_grpo`` (True: GRPO, False: Dr.GRPO).

        Raises:
            ValueError: ``algorithm.setgrpo.<key>=<value>`` and the admissible range (docs/algorithm.md#41-defaults).
        """
        cal = self.calibration  # a plain mapping while verl's instantiation builds the nested blocks
        on_infeasible = cal.get("on_infeasible", "error") if isinstance(cal, Mapping) else cal.on_infeasible
        coverage_groups = cal.get("coverage_groups", 1000) if isinstance(cal, Mapping) else cal.coverage_groups
        try:
            return CalibrationSettings(
                alpha=self.alpha, beta=self.beta, delta=self.delta,
                tau_grid=DEFAULT_TAU_GRID if self.tau_grid is None else tuple(self.tau_grid), rho=self.rho,
                grid_size=self.recovery_grid, ablation=self.ablation, fixed_tau=self.fixed_tau,
                norm_by_std=bool(norm_by_std), on_infeasible=on_infeasible,
                coverage_groups=None if coverage_groups is None else int(coverage_groups),
                srgo_procedure=self.srgo_procedure, tau_start=self.tau_start,
            )
        except ValueError as exc:
            field, sep, rest = str(exc).partition("=")
            raise ValueError(f"algorithm.setgrpo.{_SETTINGS_KEYS.get(field, field)}{sep}{rest}") from None


#: The ``algorithm.setgrpo`` key of each :class:`setgrpo_verl.core.CalibrationSettings` field whose name differs.
_SETTINGS_KEYS = {"grid_size": "recovery_grid", "on_infeasible": "calibration.on_infeasible",
                 "coverage_groups": "calibration.coverage_groups"}


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
