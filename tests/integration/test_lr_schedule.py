"""A training step in which every group is rejected takes no optimizer step, but verl's learning-rate scheduler still
takes its step: warmup and decay follow the step count, as in a run whose every step updates."""

from __future__ import annotations

import inspect
import types
from types import SimpleNamespace

import torch

from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.torch_functional import get_cosine_schedule_with_warmup
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
from verl.workers.engine_workers import TrainingWorker

from setgrpo_verl.integration.worker import SetGRPOActorRolloutRefWorker

from .test_plugin import _record_trainer

WARMUP, TOTAL = 3, 10


def _engine():
    """verl's FSDP engine's scheduler step over a real AdamW and verl's cosine schedule with warmup."""
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    engine = SimpleNamespace(optimizer=optimizer, lr_scheduler=get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=WARMUP, num_training_steps=TOTAL))
    engine.lr_scheduler_step = types.MethodType(FSDPEngine.lr_scheduler_step, engine)
    return engine


def test_verl_steps_the_scheduler_once_per_actor_update():
    """What the skipped update would have done: one scheduler step, after the last mini-batch of update_actor."""
    assert "update_lr_scheduler=batch_idx == total_num_iterations - 1" in inspect.getsource(
        TrainingWorker.train_mini_batch)
    source = inspect.getsource(TrainingWorker.train_batch)
    assert "if update_lr_scheduler:" in source and "self.engine.lr_scheduler_step()" in source


def test_rejected_steps_keep_the_schedule_on_the_step_count(tmp_path, monkeypatch):
    engine, reference = _engine(), _engine()
    worker = SimpleNamespace(actor=SimpleNamespace(engine=engine))
    trainer = _record_trainer(tmp_path)
    trainer.actor_rollout_wg = SimpleNamespace(  # ONE_TO_ALL: one answer per rank
        step_lr_scheduler=lambda: [SetGRPOActorRolloutRefWorker.step_lr_scheduler(worker)] * 2)
    updates = []

    def verl_update(self, batch, metrics):  # verl's update: an optimizer step, then the scheduler's
        updates.append(self.global_steps)
        engine.optimizer.step()
        metrics["actor/lr"] = engine.lr_scheduler_step()
        return batch

    monkeypatch.setattr(PPOTrainerSync, "_update_actor", verl_update)
    accepted = [0, 2, 0, 0, 1, 3]  # groups accepted per step
    for step, groups in enumerate(accepted, start=1):
        trainer.global_steps, trainer._accepted_groups, metrics = step, groups, {}
        assert trainer._update_actor("batch", metrics) == "batch"
        expected = reference.lr_scheduler_step()  # a run that updates at every step
        assert metrics["actor/update_skipped"] == float(groups == 0)
        assert metrics["actor/lr"] == expected, (step, metrics["actor/lr"], expected)
        assert engine.optimizer.param_groups[0]["lr"] == expected
    assert updates == [2, 5, 6]  # no optimizer step on the rejected steps
    assert engine.lr_scheduler.last_epoch == len(accepted)
