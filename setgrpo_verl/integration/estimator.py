"""The SetGRPO training step (docs/algorithm.md#3-ggsr, #6-diagnostics) and verl's ``setgrpo`` advantage estimator.

:func:`setgrpo_step` is the step: scores, uids, response mask and the actor's sketches in, advantages and
diagnostics out. The SetGRPO trainer mode calls it directly. verl's registry also knows the name ``setgrpo``
(:func:`compute_setgrpo_outcome_advantage`), a pure function of its arguments like verl's own estimators; verl's
``compute_advantage`` passes it no sketches and no record, so a run that reaches it there -- e.g. verl's stock
``sync`` trainer with ``algorithm.adv_estimator=setgrpo`` -- gets an error naming the trainer mode. SetGRPO never
falls back to a geometry-free variant.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from verl.trainer.ppo.core_algos import register_adv_est

from setgrpo_verl.core import CalibrationRecord, reliability_coefficients, reliability_weights, setgrpo_coefficients
from setgrpo_verl.core.grpo import degenerate_groups

from .config import SETGRPO_NAME, TRAINER_MODE_OVERRIDE
from .groups import complete_group_rows, group_gram

#: The error of the registered estimator called without the SetGRPO inputs (verl's own trainers).
MISSING_INPUTS = (
    f"algorithm.adv_estimator={SETGRPO_NAME} needs the per-response gradient sketches and the calibration record "
    f"that only the SetGRPO trainer mode passes. Add the override `{TRAINER_MODE_OVERRIDE}` (and compose the run on "
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


def _complete_groups(index: Any, response_mask: torch.Tensor, k: int) -> tuple[torch.Tensor, dict[Any, int]]:
    """:func:`complete_group_rows`, refusing a batch with no complete group (nothing would train)."""
    groups, _, incomplete = complete_group_rows(index, response_mask, k)
    if groups.shape[0] == 0:
        raise ValueError(
            f"every group of the batch holds fewer than the calibration record's K={k} responses "
            f"({sorted(set(incomplete.values()))}): each lost a rollout session, or actor_rollout_ref.rollout.n "
            f"differs from K; set actor_rollout_ref.rollout.n={k} or recalibrate"
        )
    return groups, incomplete


def _read_gram(sketches: torch.Tensor, groups: torch.Tensor, point: torch.Tensor, sketched: Optional[torch.Tensor],
               degenerate_rtol: float) -> torch.Tensor:
    """:func:`group_gram`, refusing a group that can update (not degenerate) but whose rows were not sketched."""
    gram = group_gram(sketches, groups, sketched)
    if sketched is not None:
        unread = ~sketched.cpu()[groups].all(-1) & ~degenerate_groups(point, degenerate_rtol)
        if unread.any():
            raise ValueError(f"{int(unread.sum())} group(s) can update but their rows were not sketched: the rows to "
                             "sketch were chosen on other point scores than token_level_rewards (a reward changed "
                             "after the sketch pass) or with another degeneracy tolerance than the record's")
    return gram


def _step_metrics(result: Any, groups: torch.Tensor, gram: torch.Tensor, incomplete: dict[Any, int], b: int,
                  reference_scores: Optional[torch.Tensor], monitor: Any) -> dict[str, float]:
    """The step's ``setgrpo/*`` diagnostics (docs/algorithm.md#6-diagnostics): the core library's, the incomplete
    groups' share and, with a monitor and reference scores, the online monitor's."""
    metrics = dict(result.metrics(prefix="setgrpo/"))
    # groups that lost a response are rejected (zero coefficient: no update from them), as verl's GRPO carries on
    metrics[INCOMPLETE_RATIO_METRIC] = len(incomplete) / (groups.shape[0] + len(incomplete))
    if monitor is not None and reference_scores is not None:
        ref = torch.as_tensor(reference_scores).detach().to(dtype=torch.float64, device="cpu").reshape(-1)
        if ref.shape[0] != b:
            raise ValueError(f"reference_scores have {ref.shape[0]} entries but the batch has {b} rows")
        metrics.update(monitor.update(result, ref[groups], gram, prefix="setgrpo/"))
    return metrics


def _check_rewards(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> None:
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} must both be [B, T]")


def _row_advantages(group_coefficients: torch.Tensor, groups: torch.Tensor,
                    response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, K]`` coefficients scattered to the B rows (0 on rows of no complete group) and times the response mask:
    float64 ``[B]`` coefficients and float32 ``[B, T]`` advantages."""
    coefficients = torch.zeros(response_mask.shape[0], dtype=torch.float64)
    coefficients[groups.reshape(-1)] = torch.as_tensor(group_coefficients, dtype=torch.float64).reshape(-1)
    mask = response_mask.to(dtype=torch.float32)
    return coefficients, coefficients.to(device=mask.device, dtype=torch.float32).unsqueeze(-1) * mask


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
        sketched: optional bool [B], the rows the actor sketched
            (:func:`~setgrpo_verl.integration.groups.rows_to_sketch`); every other row must belong to a degenerate or
            an incomplete group, whose Gram matrix is then zero and not read.

    A group with fewer than ``record.K`` responses (a failed rollout session, which verl's agent loop keeps) is
    rejected: its rows get coefficient 0 and it is left out of ``groups`` and of the core library's G.

    Returns:
        :class:`SetGRPOStep` over the complete groups. Metrics: ``SetGRPOResult.metrics`` (incl.
        ``setgrpo/timing_s/geometry`` and ``setgrpo/timing_s/recovery``, seconds), ``setgrpo/timing_s/gram``
        (grouping + Gram, seconds), ``setgrpo/incomplete_ratio`` (rejected incomplete groups over all real groups)
        and, with a monitor, the ``setgrpo/online_*`` metrics.

    Raises:
        ValueError: bad shapes, a group larger than the record's K or no complete group at all (see
            :func:`~setgrpo_verl.integration.groups.complete_group_rows`), non-finite sketches, or a group that can
            update whose rows were not sketched.
    """
    b = token_level_rewards.shape[0]
    _check_rewards(token_level_rewards, response_mask)
    if sketches.shape[0] != b:
        raise ValueError(f"sketches have {sketches.shape[0]} rows but the batch has {b}")
    groups, incomplete = _complete_groups(index, response_mask, record.K)

    t0 = time.perf_counter()
    point = token_level_rewards.detach().to(dtype=torch.float64, device="cpu").sum(dim=-1)[groups]
    gram = _read_gram(sketches, groups, point, sketched, record.degenerate_rtol)
    t1 = time.perf_counter()
    result = setgrpo_coefficients(point, gram, record, ablation=ablation, seed=seed)

    coefficients, advantages = _row_advantages(result.coefficients, groups, response_mask)

    metrics = _step_metrics(result, groups, gram, incomplete, b, reference_scores, monitor)
    metrics["setgrpo/timing_s/gram"] = t1 - t0
    return SetGRPOStep(advantages=advantages, coefficients=coefficients, groups=groups, point_scores=point, gram=gram,
                       result=result, metrics=metrics)


@dataclass
class ReliabilityStep:
    """One advantage computation of the ``reliability`` variant (docs/algorithm.md#9-reliability-weighting).

    Attributes:
        advantages: float32 [B, T] response-level coefficient times ``response_mask``.
        coefficients: float64 [B] the coefficient of every row (0 for degenerate groups and incomplete groups).
        groups: int64 [G, K] batch row of response k of complete group g.
        point_scores: float64 [G, K] the training point, the mean of the two scorings.
        weights: float64 [G] the groups' reliability weights in [0, 1].
        metrics: ``setgrpo/*`` diagnostics (floats) for verl's tracker.
    """

    advantages: torch.Tensor
    coefficients: torch.Tensor
    groups: torch.Tensor
    point_scores: torch.Tensor
    weights: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def reliability_step(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any,
                     reference_scores: torch.Tensor, k: int, *, norm_by_std: bool = True,
                     eps: float = 1e-6, noise_scales: Any = None) -> ReliabilityStep:
    """Advantages of the ``reliability`` variant: GRPO on the mean of the two scorings, each group weighted by the
    share of its spread that is signal (docs/algorithm.md#9-reliability-weighting). No record, no sketches.

    Args:
        token_level_rewards: float [B, T] verl's token-level rewards of the first scoring (``rm_scores``).
        response_mask: [B, T] response-token mask.
        index: B uids (``non_tensor_batch["uid"]``).
        reference_scores: float [B] the second, independent scoring of the same responses.
        k: responses per group (``actor_rollout_ref.rollout.n``); a group with fewer is left out (coefficient 0).
        norm_by_std, eps: verl's ``algorithm.norm_adv_by_std_in_grpo`` and GRPO's epsilon.
        noise_scales: [B] each response's rubric noise scale (``reward_extra_info["noise_scale"]``,
            :func:`setgrpo_verl.core.reliability.noise_scale`), or None: one noise variance for the batch.

    Returns:
        :class:`ReliabilityStep`. Metrics: ``setgrpo/accepted_ratio`` (groups with a weight above 0),
        ``setgrpo/reliability/weight_mean`` (over non-degenerate groups), ``setgrpo/reliability/noise_var``
        (reward units squared), ``setgrpo/degenerate_ratio`` and ``setgrpo/incomplete_ratio``.

    Raises:
        ValueError: shapes that disagree, or no complete group (see :func:`setgrpo_step`).
    """
    b = token_level_rewards.shape[0]
    _check_rewards(token_level_rewards, response_mask)
    ref = torch.as_tensor(reference_scores).detach().to(dtype=torch.float64, device="cpu").reshape(-1)
    if ref.shape[0] != b:
        raise ValueError(f"reference_scores have {ref.shape[0]} entries but the batch has {b} rows")
    groups, incomplete = _complete_groups(index, response_mask, k)
    point = token_level_rewards.detach().to(dtype=torch.float64, device="cpu").sum(dim=-1)[groups]
    reference = ref[groups]
    scale = None if noise_scales is None else torch.as_tensor(
        np.asarray(noise_scales, dtype=np.float64)).reshape(-1)[groups[:, 0]]
    weights, noise_var = reliability_weights(point, reference, scale=scale)
    mean = (point + reference) / 2
    live = ~degenerate_groups(mean)
    coefficients, advantages = _row_advantages(reliability_coefficients(point, reference, norm_by_std, eps,
                                                                        scale=scale), groups, response_mask)
    metrics = {
        "setgrpo/accepted_ratio": float((weights > 0).double().mean()),
        "setgrpo/reliability/weight_mean": float(weights[live].mean()) if bool(live.any()) else 0.0,
        "setgrpo/reliability/noise_var": noise_var,
        "setgrpo/degenerate_ratio": float((~live).double().mean()),
        INCOMPLETE_RATIO_METRIC: len(incomplete) / (groups.shape[0] + len(incomplete)),
    }
    return ReliabilityStep(advantages=advantages, coefficients=coefficients, groups=groups, point_scores=mean,
                           weights=weights, metrics=metrics)


@register_adv_est(SETGRPO_NAME)
def compute_setgrpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Optional[np.ndarray] = None,
    config: Any = None,
    *,
    sketches: Optional[torch.Tensor] = None,
    record: Optional[CalibrationRecord] = None,
    sketched: Optional[torch.Tensor] = None,
    ablation: Optional[str] = None,
    seed: int = 0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl advantage estimator ``setgrpo`` (docs/algorithm.md#3-ggsr, docs/verl_integration.md#registries),
    registered with ``register_adv_est``: the coefficients of :func:`setgrpo_step` as verl's estimators answer.

    Args:
        token_level_rewards: float [B, T].
        response_mask: [B, T].
        index: B uids (verl passes ``non_tensor_batch["uid"]``).
        config: verl's algorithm config; unused (the record fixes the normalisation, K and the tolerances).
        sketches: float32 [B, m] per-response gradient sketches, row-aligned with the batch.
        record: the frozen ``CalibrationRecord``.
        sketched, ablation, seed: see :func:`setgrpo_step`.
        **kwargs: further batch fields verl passes its estimators (``reward_baselines``); unused.

    Returns:
        ``(advantages, returns)``, both the same float32 [B, T] tensor (outcome-level estimator, like verl's GRPO).
        The diagnostics and the online monitor need :func:`setgrpo_step`, which the trainer mode calls.

    Raises:
        RuntimeError: no ``sketches`` or no ``record`` -- verl's ``compute_advantage`` passes neither, so the run
            lacks ``trainer.v1.trainer_mode=setgrpo`` (the message names the override).
        ValueError: no ``index``; see :func:`setgrpo_step`.
    """
    if sketches is None or record is None:
        raise RuntimeError(MISSING_INPUTS)
    if index is None:
        raise ValueError("the setgrpo estimator needs the uid of every response (non_tensor_batch['uid'])")
    step = setgrpo_step(token_level_rewards, response_mask, index, sketches, record, ablation=ablation, seed=seed,
                        sketched=sketched)
    return step.advantages, step.advantages
