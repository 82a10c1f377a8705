"""The ``setgrpo`` advantage estimator for verl and the trainer's pure per-step glue.

verl calls registered estimators as ``fn(token_level_rewards, response_mask, config, index=uid, ...)``
(``verl.trainer.ppo.ray_trainer.compute_advantage``): no other batch field reaches them. The geometry
(per-response gradient sketches) therefore travels in ``config``: the SetGRPO trainer mode passes a
:class:`SetGRPOStepContext` (which also behaves like verl's algorithm config) instead of the bare
``config.algorithm``. Any other caller -- e.g. verl's stock ``sync`` trainer with
``algorithm.adv_estimator=setgrpo`` -- gets an error naming the missing override; SetGRPO never falls
back to a geometry-free variant.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from verl.trainer.ppo.core_algos import register_adv_est

from setgrpo_verl.core import DEGENERATE_RTOL, CalibrationRecord, degenerate_groups, setgrpo_coefficients

from .config import SETGRPO_NAME, TRAINER_MODE_OVERRIDE

logger = logging.getLogger(__name__)
_MISSING_CONTEXT = (
    f"algorithm.adv_estimator={SETGRPO_NAME} needs the per-response gradient sketches that only the SetGRPO "
    f"trainer mode computes. Add the override `{TRAINER_MODE_OVERRIDE}` (and compose the run on "
    "setgrpo_verl's Hydra config: --config-name setgrpo_trainer), "
    "or use algorithm.adv_estimator=grpo for plain GRPO."
)


@dataclass
class SetGRPOStep:
    """Everything one SetGRPO advantage computation produced (docs/algorithm.md#3-ggsr and #6-diagnostics).

    Attributes:
        advantages: float32 [B, T] response-level coefficient times ``response_mask`` (verl's ``advantages``
            and ``returns``).
        coefficients: float64 [B] the coefficient of every row (0 for rejected, degenerate, padding rows and the rows
            of incomplete groups).
        groups: int64 [G, K] batch row of response k of complete group g (first-appearance order of uid).
        point_scores: float64 [G, K] point scores r (``token_level_rewards.sum(-1)``).
        gram: float64 [G, K, K] ``S_g S_g^T`` of the sketches.
        result: the core library's ``SetGRPOResult`` for the G groups.
        metrics: ``setgrpo/*`` diagnostics (floats) for verl's tracker.
    """

    advantages: torch.Tensor
    coefficients: torch.Tensor
    groups: torch.Tensor
    point_scores: torch.Tensor
    gram: torch.Tensor
    result: Any
    metrics: dict[str, float] = field(default_factory=dict)


#: Metric: the share of a step's groups that lost a response (a failed rollout session) and were rejected.
INCOMPLETE_RATIO_METRIC = "setgrpo/incomplete_ratio"


def complete_group_rows(index: Any, response_mask: torch.Tensor,
                        k: int) -> tuple[torch.Tensor, list[Any], dict[Any, int]]:
    """Group batch rows by ``uid``, setting aside the groups with fewer than ``k`` responses
    (docs/algorithm.md#0-notation, docs/verl_integration.md#partial-groups).

    verl 0.9.1's agent loop keeps a group one of whose sessions failed: it reaches the trainer with fewer than
    ``actor_rollout_ref.rollout.n`` responses (``ReplayBuffer`` marks it ``failure`` and samples it).

    Args:
        index: B group ids (``non_tensor_batch["uid"]``).
        response_mask: [B, T] response-token mask; groups whose rows all have empty masks are verl's synthetic
            padding groups (``trainer/ppo/padding_utils.py``) and are skipped.
        k: the group size K of a complete group.

    Returns:
        ``(groups int64 [G, K], uids list[G], incomplete {uid: responses})``: the complete groups' rows in batch
        order, their uids in order of first appearance, and each incomplete group's response count.

    Raises:
        ValueError: lengths disagree, the batch holds no real group, or a group holds more than ``k`` responses.
    """
    index = list(index)
    if len(index) != response_mask.shape[0]:
        raise ValueError(f"index has {len(index)} entries but response_mask has {response_mask.shape[0]} rows")
    rows: dict[Any, list[int]] = {}
    for i, uid in enumerate(index):
        rows.setdefault(uid, []).append(i)
    nonempty = (response_mask != 0).any(dim=-1).tolist()
    real = {uid: r for uid, r in rows.items() if any(nonempty[i] for i in r)}
    if not real:
        raise ValueError("the batch holds no group with a non-empty response (all rows are padding)")
    larger = {u: len(r) for u, r in real.items() if len(r) > k}
    if larger:
        raise ValueError(f"groups hold more than K={k} responses ({dict(list(larger.items())[:3])}); set "
                         f"actor_rollout_ref.rollout.n={k} (the calibration record's K) or recalibrate")
    uids = [u for u, r in real.items() if len(r) == k]
    groups = torch.tensor([real[u] for u in uids], dtype=torch.int64).reshape(len(uids), k)
    return groups, uids, {u: len(r) for u, r in real.items() if len(r) < k}


def group_gram(sketches: torch.Tensor, groups: torch.Tensor, sketched: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-group Gram matrices ``M_g = S_g S_g^T`` in float64 (docs/sketch.md#mechanics).

    Args:
        sketches: float32/float64 [B, m] sketches of the batch rows.
        groups: int64 [G, K] row indices.
        sketched: optional bool [B], the rows the actor sketched (:func:`rows_to_sketch`); a group none of whose rows
            was sketched gets a zero Gram matrix and its sketch rows are not read (docs/sketch.md#skipped-rows).

    Returns:
        float64 [G, K, K], symmetric positive semi-definite.

    Raises:
        ValueError: ``sketches`` is not 2-D, has the wrong row count or non-finite entries in a row that is read; a
            group with some rows sketched and others not.
    """
    if sketches.dim() != 2:
        raise ValueError(f"sketches must be [B, m], got shape {tuple(sketches.shape)}")
    if int(groups.max()) >= sketches.shape[0]:
        raise ValueError(f"sketches has {sketches.shape[0]} rows but the groups index row {int(groups.max())}")
    read = torch.ones(groups.shape[0], dtype=torch.bool)
    if sketched is not None:
        if tuple(sketched.shape) != (sketches.shape[0],) or sketched.dtype != torch.bool:
            raise ValueError(f"sketched must be bool [B={sketches.shape[0]}], got {sketched.dtype} "
                             f"{tuple(sketched.shape)}")
        in_group = sketched.cpu()[groups]
        mixed = in_group.any(-1) & ~in_group.all(-1)
        if mixed.any():
            raise ValueError(f"group {int(mixed.nonzero()[0])} has some rows sketched and others not: the actor "
                             "sketches whole groups")
        read = in_group.all(-1)
    s = sketches.detach().to(dtype=torch.float64, device="cpu")[groups[read]]  # [G_read, K, m]
    if not torch.isfinite(s).all():
        raise ValueError("sketches contain NaN/inf: the actor's sketch pass diverged (check the model's dtype)")
    gram = torch.zeros(groups.shape[0], groups.shape[1], groups.shape[1], dtype=torch.float64)
    gram[read] = s @ s.transpose(-1, -2)
    return gram


def rows_to_sketch(index: Any, response_mask: torch.Tensor, scores: torch.Tensor, k: int,
                   degenerate_rtol: float = DEGENERATE_RTOL) -> torch.Tensor:
    """The rows whose sketches can be read: those of the complete groups whose point scores are not tied
    (docs/sketch.md#skipped-rows).

    A degenerate group (:func:`setgrpo_verl.core.degenerate_groups` with ``degenerate_rtol``, the test calibration
    and training apply) gets a zero update from GRPO and SetGRPO and is left out of calibration; a group with fewer
    than ``k`` responses is rejected in training and left out of calibration (:func:`complete_group_rows`). Neither
    reads its Gram matrix, so their rows need old log-probs only.

    Args:
        index: B group ids (``uid``).
        response_mask: [B, T] response-token mask.
        scores: [B] point scores or [B, T] token-level scores (summed over T), reward units.
        k: the group size K.
        degenerate_rtol: relative tolerance of the degeneracy test (the record's in training).

    Returns:
        bool [B], True for the rows to sketch.

    Raises:
        ValueError: as :func:`complete_group_rows` and :func:`setgrpo_verl.core.degenerate_groups`.
    """
    groups, _, _ = complete_group_rows(index, response_mask, k)
    point = scores.detach().to(dtype=torch.float64, device="cpu")
    point = point.sum(-1) if point.dim() == 2 else point
    rows = torch.zeros(response_mask.shape[0], dtype=torch.bool)
    if groups.shape[0]:
        live = ~degenerate_groups(point[groups], degenerate_rtol)
        rows[groups[live].reshape(-1)] = True
    return rows


def setgrpo_step(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    sketches: torch.Tensor,
    record: CalibrationRecord,
    *,
    reference_scores: Optional[torch.Tensor] = None,
    monitor: Any = None,
    ablation: Optional[str] = None,
    seed: int = 0,
    sketched: Optional[torch.Tensor] = None,
) -> SetGRPOStep:
    """SetGRPO advantages of one batch: sketches + scores + uids + response mask -> advantages + metrics.

    Implements the per-step path of docs/algorithm.md#3-ggsr and #6-diagnostics: group rows by uid, point scores
    ``r = token_level_rewards.sum(-1)`` (as verl's GRPO), ``M_g = S_g S_g^T``, ``setgrpo_coefficients`` with the
    frozen record, then ``advantages = coefficient * response_mask`` (verl's PPO loss is untouched).

    Args:
        token_level_rewards: float [B, T] verl's token-level rewards (the outcome score sits on one token).
        response_mask: [B, T] response-token mask.
        index: B uids (``non_tensor_batch["uid"]``).
        sketches: float32 [B, m] per-response gradient sketches from the actor workers, row-aligned with the batch.
        record: the frozen calibration record (``CalibrationRecord``).
        reference_scores: optional float [B] reference scores r'; with ``monitor`` it feeds the online
            coverage / reversal monitor.
        monitor: optional ``OnlineRiskMonitor`` for ``record``.
        ablation: None or one ablation name of docs/algorithm.md#6-diagnostics (overrides the record's, if any).
        seed: seed of the ``random_discard`` ablation.
        sketched: optional bool [B], the rows the actor sketched (:func:`rows_to_sketch`); every other row must
            belong to a degenerate or an incomplete group, whose Gram matrix is then zero and not read.

    A group with fewer than ``record.K`` responses (a failed rollout session, which verl's agent loop keeps) is
    rejected: its rows get coefficient 0 and it is left out of ``groups`` and of the core library's G.

    Returns:
        :class:`SetGRPOStep` over the complete groups. Metrics: ``SetGRPOResult.metrics`` (incl.
        ``setgrpo/timing_s/geometry`` and ``setgrpo/timing_s/recovery``, seconds), ``setgrpo/timing_s/gram``
        (grouping + Gram, seconds), ``setgrpo/incomplete_ratio`` (rejected incomplete groups over all real groups)
        and, with a monitor, the ``setgrpo/online_*`` metrics.

    Raises:
        ValueError: bad shapes, a group larger than the record's K or no complete group at all (see
            :func:`complete_group_rows`), non-finite sketches, or a group that can update whose rows were not
            sketched.
    """
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [B, T]"
        )
    if sketches.shape[0] != token_level_rewards.shape[0]:
        raise ValueError(f"sketches have {sketches.shape[0]} rows but the batch has {token_level_rewards.shape[0]}")
    groups, _, incomplete = complete_group_rows(index, response_mask, record.K)
    if groups.shape[0] == 0:
        raise ValueError(
            f"every group of the batch holds fewer than the calibration record's K={record.K} responses "
            f"({sorted(set(incomplete.values()))}): each lost a rollout session, or actor_rollout_ref.rollout.n "
            f"differs from K; set actor_rollout_ref.rollout.n={record.K} or recalibrate"
        )

    t0 = time.perf_counter()
    scores = token_level_rewards.detach().to(dtype=torch.float64, device="cpu").sum(dim=-1)
    point = scores[groups]
    gram = group_gram(sketches, groups, sketched)
    if sketched is not None:
        unread = ~sketched.cpu()[groups].all(-1) & ~degenerate_groups(point, record.degenerate_rtol)
        if unread.any():
            raise ValueError(f"{int(unread.sum())} group(s) can update but their rows were not sketched: the rows to "
                             "sketch were chosen on other point scores than token_level_rewards (a reward changed after the "
                             "sketch pass) or with another degeneracy tolerance than the record's")
    t1 = time.perf_counter()
    result = setgrpo_coefficients(point, gram, record, ablation=ablation, seed=seed)

    coefficients = torch.zeros(token_level_rewards.shape[0], dtype=torch.float64)
    coefficients[groups.reshape(-1)] = torch.as_tensor(result.coefficients, dtype=torch.float64).reshape(-1)
    mask = response_mask.to(dtype=torch.float32)
    advantages = coefficients.to(device=mask.device, dtype=torch.float32).unsqueeze(-1) * mask

    metrics = dict(result.metrics(prefix="setgrpo/"))
    metrics["setgrpo/timing_s/gram"] = t1 - t0
    # groups that lost a response are rejected (zero coefficient: no update from them), as verl's GRPO carries on
    metrics[INCOMPLETE_RATIO_METRIC] = len(incomplete) / (groups.shape[0] + len(incomplete))
    if monitor is not None and reference_scores is not None:
        ref = torch.as_tensor(reference_scores).detach().to(dtype=torch.float64, device="cpu").reshape(-1)
        if ref.shape[0] != token_level_rewards.shape[0]:
            raise ValueError(f"reference_scores have {ref.shape[0]} entries but the batch has {token_level_rewards.shape[0]} rows")
        metrics.update(monitor.update(result, ref[groups], gram, prefix="setgrpo/"))
    return SetGRPOStep(
        advantages=advantages,
        coefficients=coefficients,
        groups=groups,
        point_scores=point,
        gram=gram,
        result=result,
        metrics=metrics,
    )


class SetGRPOStepContext:
    """The ``config`` the SetGRPO trainer hands verl's ``compute_advantage`` for one step.

    Behaves like the algorithm config it wraps (``.get``/attribute/item access are delegated), and carries
    the step's sketches, the frozen record and the optional reference scores / monitor to
    :func:`compute_setgrpo_outcome_advantage`, which stores its :class:`SetGRPOStep` in ``.output``.

    Args:
        algorithm: verl's ``config.algorithm`` (DictConfig or AlgoConfig).
        sketches: float32 [B, m] sketches, row-aligned with the DataProto passed to ``compute_advantage``.
        record: frozen ``CalibrationRecord``.
        reference_scores: optional float [B] reference scores r'.
        monitor: optional ``OnlineRiskMonitor``.
        ablation, seed, sketched: see :func:`setgrpo_step`.
    """

    def __init__(
        self,
        algorithm: Any,
        sketches: torch.Tensor,
        record: CalibrationRecord,
        *,
        reference_scores: Optional[torch.Tensor] = None,
        monitor: Any = None,
        ablation: Optional[str] = None,
        seed: int = 0,
        sketched: Optional[torch.Tensor] = None,
    ):
        self.algorithm = algorithm
        self.sketches = sketches
        self.sketched = sketched
        self.record = record
        self.reference_scores = reference_scores
        self.monitor = monitor
        self.ablation = ablation
        self.seed = seed
        self.output: Optional[SetGRPOStep] = None

    def get(self, key: str, default: Any = None) -> Any:
        return self.algorithm.get(key, default)

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        return getattr(self.__dict__["algorithm"], key)

    def __getitem__(self, key: str) -> Any:
        return self.algorithm[key]

    def __contains__(self, key: str) -> bool:
        return key in self.algorithm


@register_adv_est(SETGRPO_NAME)
def compute_setgrpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Optional[np.ndarray] = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl advantage estimator ``setgrpo`` (docs/algorithm.md); registered with ``register_adv_est``.

    Args:
        token_level_rewards: float [B, T].
        response_mask: [B, T].
        index: B uids (verl passes ``non_tensor_batch["uid"]``).
        config: a :class:`SetGRPOStepContext` built by the SetGRPO trainer mode.

    Returns:
        ``(advantages, returns)``, both float32 [B, T] and equal (outcome-level estimator, like GRPO).

    Raises:
        RuntimeError: ``config`` is not a :class:`SetGRPOStepContext` -- the run lacks
            ``trainer.v1.trainer_mode=setgrpo`` (the message names the override).
        ValueError: see :func:`setgrpo_step`.
    """
    if not isinstance(config, SetGRPOStepContext):
        raise RuntimeError(_MISSING_CONTEXT)
    if index is None:
        raise ValueError("the setgrpo estimator needs the uid of every response (non_tensor_batch['uid'])")
    step = setgrpo_step(
        token_level_rewards,
        response_mask,
        index,
        config.sketches,
        config.record,
        reference_scores=config.reference_scores,
        monitor=config.monitor,
        ablation=config.ablation,
        seed=config.seed,
        sketched=config.sketched,
    )
    config.output = step
    return step.advantages, step.advantages
