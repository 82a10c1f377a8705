"""Calibration groups left out because grading failed (docs/verl_integration.md#partial-groups).

A group whose grading failed is not missing at random: a judge that times out on long responses, or refuses some
inputs, drops exactly those groups, so a record calibrated without them describes another population. Calibration
therefore counts them apart from the other groups it leaves out and bounds their count
(docs/record.md#grading-failures): with ``rho = algorithm.setgrpo.calibration.max_grading_failure_ratio`` and N
calibration groups, at most :func:`allowed_grading_failures` ``(N, rho)`` may fail, the largest count that a judge
failing on a share ``rho`` of the groups exceeds with probability at most :data:`FAILURE_TEST_LEVEL` (a one-sided
binomial test: more failures show at that level that the judge fails on more than ``rho``). The bound holds for small
and large calibrations alike (32 groups allow 2 failures at ``rho = 0.02``, 4,096 groups allow 97). It is checked
as each batch comes in against the groups the calibration will hold (:class:`GradingFailureBudget`), so the first
batch that makes it unreachable stops calibration; a batch whose every group failed stops it at once
(:func:`all_failed_error`). A training step whose every rollout session failed
(grading included: outside calibration a grading failure fails its session) stops with :func:`empty_batch_error`.
"""

from __future__ import annotations

from typing import Sequence

from scipy.stats import binom

__all__ = ["FAILURE_TEST_LEVEL", "MAX_GRADING_FAILURE_KEY", "GradingFailureBudget", "all_failed_error",
           "allowed_grading_failures", "check_grading_failure_share", "empty_batch_error"]

#: The config key of the bound on the share of calibration groups whose grading failed.
MAX_GRADING_FAILURE_KEY = "algorithm.setgrpo.calibration.max_grading_failure_ratio"
#: The level of the grading-failure bound's test: a judge that fails on at most ``rho`` of the groups stops a
#: calibration with probability at most this.
FAILURE_TEST_LEVEL = 0.05


def allowed_grading_failures(groups: int, ratio: float, level: float = FAILURE_TEST_LEVEL) -> int:
    """The most groups of a calibration of ``groups`` groups that may be left out because grading failed
    (docs/record.md#grading-failures): the smallest ``d`` with ``P(Binomial(groups, ratio) > d) <= level``.

    Args:
        groups: the calibration's groups (>= 0).
        ratio: ``max_grading_failure_ratio`` in [0, 1]; 0 allows none, 1 allows all.
        level: the test's level in (0, 1).

    Returns:
        int in ``[0, groups]``.
    """
    if groups <= 0 or ratio <= 0.0:
        return 0
    if ratio >= 1.0:
        return int(groups)
    return int(min(groups, binom.isf(level, int(groups), float(ratio))))


class GradingFailureBudget:
    """The grading-failure bound checked as the batches of a calibration come in.

    Args:
        planned: every group the calibration (or the part of it) will hold, failed ones included.
        ratio: ``max_grading_failure_ratio``.
        judge: the grader as messages name it.
        failed: groups that failed in shards written before (a resumed calibration).
        shards: those shards' file names.
    """

    def __init__(self, planned: int, ratio: float, judge: str, failed: int = 0, shards: Sequence[str] = ()):
        self.planned, self.ratio, self.judge = int(planned), float(ratio), judge
        self.failed, self.seen, self.shards = int(failed), 0, list(shards)
        self.allowed = allowed_grading_failures(self.planned, self.ratio)

    def add(self, failed: int, shard: str) -> None:
        """Count the failed groups of one more batch (written to ``shard``).

        Raises:
            ValueError: more failed groups so far than the whole calibration allows (:func:`check_grading_failure_share`).
        """
        self.failed += int(failed)
        if failed:
            self.shards.append(shard)
        check_grading_failure_share(self.failed, self.planned, self.ratio, self.judge, self.shards, so_far=True)


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
                                shards: Sequence[str] = (), *, so_far: bool = False) -> None:
    """Refuse a calibration with more groups left out because grading failed than
    :func:`allowed_grading_failures` ``(groups, bound)`` (docs/record.md#grading-failures).

    Args:
        failed: groups left out because grading failed (>= 0).
        groups: every calibration group of the record (or of the part) checked, failed ones included (>= 0); while
            batches still come in, every group the calibration will hold.
        bound: ``algorithm.setgrpo.calibration.max_grading_failure_ratio`` in [0, 1].
        judge: the grader as messages name it (:func:`~.judge_access.describe_judge`).
        shards: the shard files that hold failed groups, named in the message.
        so_far: the count is of the batches so far (the message says the bound is already out of reach).

    Raises:
        ValueError: ``failed`` above the allowed count, naming the count, the bound, its key, the judge and the fixes.
    """
    allowed = allowed_grading_failures(groups, bound)
    if failed <= allowed:
        return
    where = (f"; the shards with such groups: {', '.join(shards[:5])}{' ...' if len(shards) > 5 else ''}"
             if shards else "")
    when = " in the batches so far, so the calibration cannot finish within its bound" if so_far else ""
    raise ValueError(
        f"SetGRPO calibration: {failed} of {groups} calibration groups ({failed / groups:.1%}) were left out because "
        f"grading failed ({judge}){when}, more than the {allowed} that {MAX_GRADING_FAILURE_KEY}={bound:g} allows "
        f"for {groups} groups (a judge failing on at most {bound:g} of the groups exceeds that count with probability "
        f"at most {FAILURE_TEST_LEVEL:g}; docs/record.md#grading-failures): such groups are not missing at random "
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
