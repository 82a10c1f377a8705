"""One calibration batch's inputs by group (docs/algorithm.md#2-jrsc, #4-srgo; docs/verl_integration.md#partial-groups):
the complete groups' point scores, reference scores, Gram matrices and truth, and the groups left out (incomplete,
or with a response whose grading failed); and the sampling context under which verl's replay buffer draws only the
calibration prompts. :mod:`.calibration` runs the phase that uses them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple, Optional

import numpy as np
import torch
from tensordict import TensorDict

from setgrpo_verl.core.grpo import degenerate_groups

from .batch import dense_sketches, grading_errors_from, reference_scores_from, sketched_rows, truth_verdicts_from
from .config import TRUTH_SCORE_KEY
from .groups import complete_group_rows, group_gram
from .reward_config import GRADING_ERROR_KEY
from .reward_manager import TRUTH_VERDICTS_KEY
from .worker import SKETCH_KEY

__all__ = ["CalibrationGroups", "calibration_groups", "calibration_sampling"]

class CalibrationGroups(NamedTuple):
    """Calibration inputs of one batch, grouped by uid: float64 ``point [G, K]``, ``reference [G, K]``,
    ``gram [G, K, K]`` and ``truth [G, K]`` (noise-free scores, docs/validation.md#noisy-grader) or ``None``; the G
    complete groups' ``uids`` and ``incomplete``, each group left out for holding fewer than K responses -> its
    response count; ``truth_verdicts`` int8 ``[G, K, J]`` (1 met, 0 unmet, -1 no verdict or no criterion J of a
    rubric with fewer) and ``criterion_points`` float64 ``[G, J]`` (0 past a rubric's criteria) of the noise-free
    verdicts, J the most criteria of a rubric in the batch, or both ``None``; ``grading_failed``, each group left
    out because grading one of its responses failed -> the first such error's message."""

    point: torch.Tensor
    reference: torch.Tensor
    gram: torch.Tensor
    truth: Optional[torch.Tensor]
    uids: list = []
    incomplete: dict = {}
    truth_verdicts: Optional[np.ndarray] = None
    criterion_points: Optional[np.ndarray] = None
    grading_failed: dict = {}


@contextlib.contextmanager
def calibration_sampling(replay_buffer: Any) -> Iterator[None]:
    """Within the block, verl's sync ``ReplayBuffer`` samples the calibration prompts and nothing else
    (docs/verl_integration.md#partial-groups).

    verl 0.9.1's buffer replaces a wholly failed group (``trainer.v1.sampler.sync_refill_failed_groups=true``) and
    the groups its DAPO filter evicts (``algorithm.filter_groups``) through ``refill_fn``, which draws *training*
    prompts; both are off here, so a failed or filtered calibration group stays in the batch and calibration
    accounts for it. Any other call of ``refill_fn`` raises RuntimeError. Attributes the buffer lacks (a custom
    sampler) are left alone.
    """
    def refuse(count: int) -> int:
        raise RuntimeError(f"verl's replay buffer asked for {count} more prompts during calibration, which would be "
                           "training prompts: calibration samples only its own prompts")

    saved = {}
    for name, value in (("sync_refill_failed_groups", False), ("filter_groups_metric", None), ("refill_fn", refuse)):
        if hasattr(replay_buffer, name):
            saved[name] = getattr(replay_buffer, name)
            setattr(replay_buffer, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(replay_buffer, name, value)


def calibration_groups(data: TensorDict, reference_key: str, truth_key: str = TRUTH_SCORE_KEY, *,
                       k: int, verdicts_key: str = TRUTH_VERDICTS_KEY) -> CalibrationGroups:
    """Calibration inputs of one rolled-out, scored and sketched batch (docs/algorithm.md#2-jrsc, #4-srgo).

    Args:
        data: TransferQueue fields ``uid``, ``response_mask`` and ``rm_scores`` (nested [B, j]), ``setgrpo_sketch``
            ([B, m], dense or nested), the reference scores and, when the grader knows it, the truth (both read
            by :func:`reference_scores_from`).
        reference_key: ``algorithm.setgrpo.reference_score_key``.
        truth_key: key of the noise-free score in ``reward_extra_info``.
        k: ``actor_rollout_ref.rollout.n``; a group with fewer responses (a failed rollout session, which verl's
            agent loop keeps) is left out and counted in ``incomplete``
            (docs/verl_integration.md#partial-groups).
        verdicts_key: key of the noise-free verdicts in ``reward_extra_info`` (:func:`truth_verdicts_from`).

    A group one of whose responses carries a grading error (``reward_extra_info["grading_error"]``, which the
    dual-reward manager writes for a calibration response whose grading failed) is left out whole and counted in
    ``grading_failed``, whether or not it is complete.

    Returns:
        :class:`CalibrationGroups` (float64, complete groups by uid, padding groups skipped; ``truth`` and the
        truth verdicts None when the batch carries none).

    Raises:
        ValueError: no reference scores (the run does not use the dual-reward manager), a group larger than
            ``k``, non-finite sketches, a truth for only some responses or a non-finite one, truth verdicts for
            only some responses or malformed, or responses of one group with different criteria points.
    """
    errors = grading_errors_from(data, GRADING_ERROR_KEY)
    failed_rows = None if errors is None else [bool(e) for e in errors]
    reference = reference_scores_from(data, reference_key, failed_rows)
    response_mask, scores = data["response_mask"], data["rm_scores"]
    if response_mask.is_nested:
        response_mask, scores = response_mask.to_padded_tensor(0), scores.to_padded_tensor(0.0)
    index = list(data["uid"])
    groups, uids, incomplete = complete_group_rows(index, response_mask, k)
    failed = _failed_groups(index, errors, set(uids) | set(incomplete))
    if failed:  # a group with a response whose grading failed is left out whole, complete or not
        keep = [g for g, uid in enumerate(uids) if uid not in failed]
        groups, uids = groups[keep], [uids[g] for g in keep]
        incomplete = {uid: n for uid, n in incomplete.items() if uid not in failed}
    if reference is None and uids:
        raise ValueError(
            f"calibration needs a reference score per response under reward_extra_info[{reference_key!r}]: use "
            "the setgrpo dual-reward manager (reward.reward_manager.name) or set algorithm.setgrpo.reference_score_key"
        )
    point = scores.to(torch.float64).sum(-1)[groups]
    truth = reference_scores_from(data, truth_key, failed_rows)
    sketched = sketched_rows(data)
    gram = group_gram(dense_sketches(data[SKETCH_KEY]), groups, sketched) if uids else torch.zeros(0, k, k, dtype=torch.float64)
    if sketched is not None and uids:
        unread = ~sketched[groups].all(-1) & ~degenerate_groups(point)
        if unread.any():
            raise ValueError(f"{int(unread.sum())} calibration group(s) are not degenerate but were not sketched")
    verdicts, points = _group_verdicts(truth_verdicts_from(data, verdicts_key, failed_rows), groups)
    reference = torch.zeros(0, k, dtype=torch.float64) if reference is None else reference[groups]
    return CalibrationGroups(point, reference, gram, None if truth is None else truth[groups], uids,
                             incomplete, verdicts, points, failed)


def _failed_groups(index: list, errors: Optional[list[str]], real: set) -> dict:
    """Each real group (uid in ``real``) with a row whose grading failed -> the first such row's error message;
    ``errors``: one message per row (``""``: graded), or None when the reward manager wrote none."""
    failed: dict = {}
    for uid, error in zip(index, errors or ()):
        if error and uid in real:
            failed.setdefault(uid, error)
    return failed


def _group_verdicts(rows: Optional[list], groups: torch.Tensor) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """``(int8 [G, K, J], float64 [G, J])``: the rows' truth verdicts (:func:`truth_verdicts_from`) by group, -1 and
    0 points past a rubric's criteria; ``(None, None)`` without rows.

    Raises:
        ValueError: the responses of one group have different criteria points (they answer one rubric).
    """
    if rows is None:
        return None, None
    g, k = groups.shape
    j = max((len(rows[int(r)][0]) for r in groups.reshape(-1)), default=0)
    verdicts = np.full((g, k, j), -1, dtype=np.int8)
    points = np.zeros((g, j), dtype=np.float64)
    for a, members in enumerate(groups.tolist()):
        first = rows[members[0]][1]
        points[a, :len(first)] = first
        for b, r in enumerate(members):
            met, own = rows[r]
            if own != first:
                raise ValueError(f"responses {members[0]} and {r} of one calibration group carry the criteria points "
                                 f"{first} and {own}; the K responses of a prompt answer one rubric")
            verdicts[a, b, :len(met)] = met
    return verdicts, points
