"""Calibration groups left out because grading failed (docs/verl_integration.md#partial-groups).

A group whose grading failed is not missing at random: a judge that times out on long responses, or refuses some
inputs, drops exactly those groups, so a record calibrated without them describes another population. Calibration
therefore counts them apart from the other groups it leaves out and refuses to finish when their share is above
``algorithm.setgrpo.calibration.max_grading_failure_ratio`` (:func:`check_grading_failure_share`); a batch whose
every group failed stops it at once (:func:`all_failed_error`). A training step whose every rollout session failed
(grading included: outside calibration a grading failure fails its session) stops with :func:`empty_batch_error`.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["MAX_GRADING_FAILURE_KEY", "all_failed_error", "check_grading_failure_share", "empty_batch_error"]

#: The config key of the bound on the share of calibration groups whose grading failed.
MAX_GRADING_FAILURE_KEY = "algorithm.setgrpo.calibration.max_grading_failure_ratio"


def all_failed_error(batch: int, groups: int, judge: str, first_error: str) -> str:
    """The message of a calibration batch whose every group failed grading.

    Args:
        batch: the calibration batch's index.
        groups: its groups (all failed).
        judge: the grader as messages name it (:func:`~.judge_access.describe_judge`).
        first_error: the first grading error's message (it names the URL and the HTTP status for an HTTP judge).
    """
    return (f"SetGRPO calibration: grading failed for every one of the {groups} groups of calibration batch {batch}, "
            f"so nothing of it can be calibrated ({judge}); the first error: {first_error}. Fix the judge (its URL, "
            "model, key, capacity: the error above says which) and run again: calibration continues from the shards "
            "written so far")


def check_grading_failure_share(failed: int, groups: int, bound: float, judge: str,
                                shards: Sequence[str] = ()) -> None:
    """Refuse a calibration whose groups left out because grading failed are more than ``bound`` of its groups.

    Args:
        failed: groups left out because grading failed (>= 0).
        groups: every calibration group of the record (or of the part) checked, failed ones included (>= 0).
        bound: ``algorithm.setgrpo.calibration.max_grading_failure_ratio`` in [0, 1].
        judge: the grader as messages name it (:func:`~.judge_access.describe_judge`).
        shards: the shard files that hold failed groups, named in the message.

    Raises:
        ValueError: ``failed / groups > bound``, naming the share, the bound, its key, the judge and the fixes.
    """
    if not groups or failed / groups <= bound:
        return
    where = (f"; the shards with such groups: {', '.join(shards[:5])}{' ...' if len(shards) > 5 else ''}"
             if shards else "")
    raise ValueError(
        f"SetGRPO calibration: {failed} of {groups} calibration groups ({failed / groups:.1%}) were left out because "
        f"grading failed ({judge}), above {MAX_GRADING_FAILURE_KEY}={bound:g}: such groups are not missing at random "
        "(a judge that times out or refuses drops particular responses), so a record calibrated without them would "
        f"describe another population. The grading errors are in the log (\"left out because grading failed\"){where}. "
        "Fix the judge, delete those shards and run again (only their batches are calibrated again), or raise "
        f"{MAX_GRADING_FAILURE_KEY} if the failures are known to be unrelated to the responses")


def empty_batch_error(judge: str) -> str:
    """The message of a step (or calibration batch) to which no response came back: every rollout session failed,
    which verl would otherwise report as ``number of items:[0] < k_partitions:[N]``.

    Args:
        judge: the grader as messages name it (:func:`~.judge_access.describe_judge`).
    """
    return ("no response of this batch reached the trainer: every rollout session failed, and verl's log "
            "(main_ppo.log) holds each session's error. A session fails when grading its response fails, so a judge that stopped "
            f"answering fails them all ({judge}): check that it answers, then resume the run")
