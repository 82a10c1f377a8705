"""verl's sync trainer under a name of its own, and the GRPO baseline's trainer mode (verl 0.9.1's v1 trainer;
docs/verl_integration.md#trainer-mode).

:class:`SyncMode` is what both trainers of this package share: verl's base class sees ``trainer_mode == "sync"``,
the actor workers check their GPU environment, a resumed run keeps its metric rows, and a step whose groups all lost
their responses names the judge. :class:`GradedSyncTrainer` (``trainer.v1.trainer_mode=graded_sync``, the command
line's GRPO baseline) is verl's sync trainer plus the reward manager's grading metrics.
"""

from __future__ import annotations

import ray
import transfer_queue as tq

from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from .config import GRADED_SYNC_NAME
from .grading_failures import NO_TRAJECTORIES, check_step_failures, empty_batch_error, judge_down_error, judge_now
from .resume import keep_history, metrics_file, restore_history
from .reward_config import grader_in_messages
from .reward_manager import GRADING_COUNT_KEYS, grading_metrics
from .worker import CheckedActorRolloutRefWorker

__all__ = ["GradedSyncTrainer", "SyncMode"]

_ACTOR_ROLES = (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef)


class SyncMode:
    """A trainer registered under its own name (``registered_mode``) that verl's base class sees as ``sync``: the base
    class branches on ``trainer_mode == "sync"`` (replay buffer, refill, checkpoint restore), and both trainers here
    are sync trainers. Setting any mode other than ``registered_mode`` raises ValueError. Its actor workers are
    ``actor_worker``, which check their GPU environment before any model loads.

    On a resume it keeps the metrics file's rows up to the checkpoint's step, which verl's file logger truncates
    when it opens the file (:func:`~setgrpo_verl.integration.resume.keep_history`), and writes them back before
    the first validation or step (docs/cli.md#resuming-a-run)."""

    registered_mode: str
    actor_worker: type = CheckedActorRolloutRefWorker
    _history: list = []

    def fit(self, agent_loop_manager):
        if self.global_steps > 0:  # resumed by verl's _load_checkpoint: keep the rows up to that step
            self._history = keep_history(metrics_file(self.config), self.global_steps)
        return super().fit(agent_loop_manager)

    def _restore_history(self) -> None:
        file_logger = getattr(getattr(self, "logger", None), "logger", {}).get("file")
        if file_logger is not None and self._history:
            restore_history(file_logger.fp, metrics_file(self.config), self._history)
            self._history = []

    def on_validate_begin(self):
        self._restore_history()  # a resume that validates first (trainer.val_before_train): the rows come first
        return super().on_validate_begin()

    def on_train_begin(self):
        self._restore_history()
        return super().on_train_begin()

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        for role in _ACTOR_ROLES:
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(self.actor_worker)

    def _step_once(self, metrics, timing_raw, sample_batch_size):
        """verl's training step; one none of whose groups has a response stops with :func:`judge_down_error` (the
        judge, its URL and what it answers now) instead of verl's replay-buffer error."""
        self._step_prompts = int(sample_batch_size)
        try:
            return super()._step_once(metrics, timing_raw, sample_batch_size)
        except RuntimeError as exc:
            if NO_TRAJECTORIES not in str(exc):
                raise
            raise RuntimeError(judge_down_error(grader_in_messages(self.config), judge_now(self.config))) from exc
        finally:
            self._step_prompts = None

    def _balance_batch(self, batch, metrics, *args, **kwargs):
        """verl's balance, after refusing a batch to which no response came back (:func:`empty_batch_error`), which
        verl would report as ``number of items:[0] < k_partitions``; in a training step, its failed responses and
        groups go to ``metrics`` and are bounded (:func:`check_step_failures`,
        docs/verl_integration.md#partial-groups)."""
        if not any(not (tag or {}).get("is_padding", False) for tag in batch.tags):
            raise RuntimeError(empty_batch_error(grader_in_messages(self.config)))
        if getattr(self, "_step_prompts", None):
            metrics.update(check_step_failures(self.config, batch.keys, batch.tags, self._step_prompts))
        return super()._balance_batch(batch, metrics, *args, **kwargs)

    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        if value != self.registered_mode:
            raise ValueError(f"{type(self).__name__} needs trainer.v1.trainer_mode={self.registered_mode}, "
                             f"got {value!r}")


@register_trainer(GRADED_SYNC_NAME)
class GradedSyncTrainer(SyncMode, PPOTrainerSync):
    """verl's sync PPO trainer (``trainer.v1.trainer_mode=graded_sync``) that also logs the grading metrics of the
    ``setgrpo_dual`` reward manager (:func:`~setgrpo_verl.integration.reward_manager.grading_metrics`:
    ``setgrpo/grading/unparsed_ratio``, ``setgrpo/grading/calls_per_step``; docs/cli.md#metrics) at every step.

    verl's trainer keeps the reward manager's ``reward_extra_info`` in the batch but logs none of it during
    training, so the command line's GRPO baseline runs this mode to report what its grader did; everything else is
    the stock sync trainer (verl's base class sees ``trainer_mode == "sync"``). With another reward manager no
    metric is added.

    Raises (at construction):
        ValueError: ``trainer.v1.trainer_mode`` is not ``graded_sync``.
    """

    registered_mode = GRADED_SYNC_NAME

    def _compute_advantage(self, batch, metrics: dict):
        fields = ["extra_fields"] + [k for k in GRADING_COUNT_KEYS if batch.fields and k in batch.fields]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        metrics.update(grading_metrics(data, batch.tags))
        return super()._compute_advantage(batch, metrics)
