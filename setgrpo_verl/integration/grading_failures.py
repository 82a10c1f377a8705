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
(:func:`all_failed_error`). In training a grading failure fails its session: :func:`step_failures` counts a step's
failed responses and groups (metrics), :func:`check_step_failures` bounds them (``algorithm.setgrpo.
max_failed_group_ratio``), and a step with no graded group stops with :func:`judge_down_error`. A training step
whose every rollout session failed
(grading included: outside calibration a grading failure fails its session) stops with :func:`empty_batch_error`.
"""

from __future__ import annotations

from typing import Any, Sequence

from scipy.stats import binom

__all__ = ["FAILED_GROUPS_METRIC", "FAILED_RESPONSES_METRIC", "FAILURE_TEST_LEVEL", "MAX_FAILED_GROUP_DEFAULT",
           "MAX_FAILED_GROUP_KEY", "MAX_GRADING_FAILURE_KEY", "NO_TRAJECTORIES", "GradingFailureBudget",
           "all_failed_error", "allowed_grading_failures", "check_grading_failure_share", "check_step_failures",
           "empty_batch_error", "judge_down_error", "judge_now", "step_failures"]

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
            ValueError: more failed groups so far than the whole calibration allows
                (:func:`check_grading_failure_share`).
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


#: The config key of the bound on the share of a training step's groups that lost a response to a failed session.
MAX_FAILED_GROUP_KEY = "algorithm.setgrpo.max_failed_group_ratio"
#: Its default (also for a trainer whose config has no ``algorithm.setgrpo`` block, the GRPO baseline).
MAX_FAILED_GROUP_DEFAULT = 0.1
#: The metrics of a training step's failed sessions (docs/cli.md#metrics).
FAILED_RESPONSES_METRIC = "setgrpo/grading/failed_responses"
FAILED_GROUPS_METRIC = "setgrpo/grading/failed_groups"
#: The start of verl 0.9.1's error when no sampled group of a sync step has a response (replay_buffer.py).
NO_TRAJECTORIES = "Sync replay buffer selected terminal groups with no materializable trajectories"


def step_failures(keys: Sequence[str], tags: Sequence[dict], prompts: int, k: int) -> tuple[int, int]:
    """``(failed responses, failed groups)`` of one training step: the ``prompts * k`` responses sampled less the
    ones that came back, and the groups that lost at least one (a session that failed, grading included).

    Args:
        keys: the batch's TransferQueue keys, ``"<uid>_<session>_<trajectory>"`` (verl 0.9.1's agent loop,
            ``agent_loop_tq.py``); a response is one session of a prompt, whatever its trajectories, and the uid is
            what precedes the first ``_``, as verl's replay buffer reads it.
        tags: one tag per key; ``is_padding`` rows (copies verl adds) are not counted.
        prompts: prompts sampled for the step (>= 0).
        k: ``actor_rollout_ref.rollout.n``.
    """
    sessions: dict[str, set] = {}
    for key, tag in zip(keys, tags):
        if not (tag or {}).get("is_padding", False):
            uid, _, rest = str(key).partition("_")
            sessions.setdefault(uid, set()).add(rest.split("_")[0])
    counts = [len(s) for s in sessions.values()]
    complete = sum(n >= k for n in counts)
    return max(0, prompts * k - sum(min(n, k) for n in counts)), max(0, prompts - complete)


def check_step_failures(config: Any, keys: Sequence[str], tags: Sequence[dict], prompts: int) -> dict[str, float]:
    """A training step's failed responses and groups (:func:`step_failures`) as metrics, after checking the groups
    against ``algorithm.setgrpo.max_failed_group_ratio`` (default :data:`MAX_FAILED_GROUP_DEFAULT` where the config
    has no such key, the GRPO baseline's).

    Args:
        config: the run's verl config.
        keys, tags: the step's batch (``KVBatchMeta``).
        prompts: the prompts sampled for the step.

    Returns:
        ``{FAILED_RESPONSES_METRIC: float, FAILED_GROUPS_METRIC: float}``.

    Raises:
        RuntimeError: more failed groups than the bound's share of ``prompts``, naming the count, the bound, its
            key and the judge.
    """
    from omegaconf import OmegaConf

    from .reward_config import grader_in_messages

    responses, groups = step_failures(keys, tags, prompts, int(config.actor_rollout_ref.rollout.n))
    bound = float(OmegaConf.select(config, MAX_FAILED_GROUP_KEY, default=MAX_FAILED_GROUP_DEFAULT))
    if prompts and groups / prompts > bound:
        raise RuntimeError(
            f"SetGRPO training: {groups} of the step's {prompts} groups ({groups / prompts:.1%}) lost a response to "
            f"a failed rollout session ({responses} responses), above {MAX_FAILED_GROUP_KEY}={bound:g}. A session "
            f"fails when grading its response fails ({grader_in_messages(config)}), so the judge is failing on many "
            "responses; such groups are not missing at random (SetGRPO gives them coefficient 0, GRPO trains on the "
            "responses left). Each session's error is in verl's log (main_ppo.log). Fix the judge and resume the "
            f"run, or raise {MAX_FAILED_GROUP_KEY}")
    return {FAILED_RESPONSES_METRIC: float(responses), FAILED_GROUPS_METRIC: float(groups)}


def judge_down_error(judge: str, last_error: str) -> str:
    """The message of a training step none of whose groups has a response (verl: "no materializable
    trajectories"): every session failed, which happens when the judge stopped answering.

    Args:
        judge: the grader as messages name it (the judge's model and URL).
        last_error: what the judge answers now (a probe request's error), or why that is not known.
    """
    return (f"SetGRPO training: no group of this step has a graded response: every rollout session failed, as "
            f"when grading fails for every response ({judge}). The judge now: {last_error}. Each session's error is "
            "in verl's log (main_ppo.log). Fix the judge (its URL, model, key, capacity) and resume the run; verl's "
            "trainer.v1.sampler.sync_refill_failed_groups would only spend more training prompts while the judge "
            "is down")


def judge_now(config: Any) -> str:
    """What the run's HTTP judge answers one probe request now (:func:`~.judge_access.probe_judge`): its error,
    that it answers, or that the run has no HTTP judge; for :func:`judge_down_error`."""
    from .judge_access import probe_judge
    from .reward_config import grader_config

    try:
        grader = grader_config(config)
    except (ValueError, KeyError, AttributeError) as exc:
        return f"not probed ({exc})"
    try:
        probed = probe_judge(grader, fix="fix the judge, then resume the run")
    except ValueError as exc:
        return f"a probe request fails: {exc}"
    except Exception as exc:  # the probe itself could not run here; the sessions' errors remain in the log
        return f"not probed ({type(exc).__name__}: {exc})"
    return ("it answers a probe request again, so it failed for a while" if probed else
            "the grader calls no HTTP judge")


def empty_batch_error(judge: str) -> str:
    """The message of a step (or calibration batch) to which no response came back: every rollout session failed,
    which verl would otherwise report as ``number of items:[0] < k_partitions:[N]``.

    Args:
        judge: the grader as messages name it (:func:`~.judge_access.describe_judge`).
    """
    return ("no response of this batch reached the trainer: every rollout session failed, and verl's log "
            "(main_ppo.log) holds each session's error. A session fails when grading its response fails, so a judge that stopped "
            f"answering fails them all ({judge}): check that it answers, then resume the run")
