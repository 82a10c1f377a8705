"""Groups that lose responses to failed rollout sessions, through verl 0.9.1's own sync ``ReplayBuffer``.

verl's agent loop marks a prompt ``failure`` when one of its K sessions raises and keeps the other sessions'
trajectories: the replay buffer samples the group with K - 1 responses. A group whose sessions all failed has no
trajectory; with ``trainer.v1.sampler.sync_refill_failed_groups=true`` the buffer evicts it and calls
``refill_fn`` -- the trainer's ``_add_prompts_to_generate``, which draws *training* prompts. Here the real buffer and
the trainer's real ``_add_prompts_to_generate`` run over a TransferQueue stand-in (its ``kv_list`` / ``kv_clear`` /
``kv_batch_get``); the calibration itself is the real one. What must hold: calibration takes no prompt outside its
own set, leaves out the incomplete and the empty groups and says how many of each.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import verl.trainer.ppo.v1.replay_buffer as replay_buffer_module
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.utils import tensordict_utils as tu

import setgrpo_verl.integration.calibration as calibration_module
from setgrpo_verl.core.shards import CalibrationShard
import setgrpo_verl.integration.trainer as trainer_module
from setgrpo_verl.integration.worker import SKETCH_KEY, SKETCH_ROWS_KEY

from .test_plugin import _record_trainer

K = 4  # rollout.n of _record_trainer
PARTIAL, EMPTY = "p0x1", "p1x3"  # one session of PARTIAL fails, every session of EMPTY fails


class _TransferQueue:
    """TransferQueue's key-value calls as verl's replay buffer and the trainer make them, on one process's dict."""

    def __init__(self):
        self.tags: dict[str, dict] = {}  # key -> tag (prompts: is_prompt/status/global_steps)
        self.values: dict[str, dict] = {}
        self.gen = torch.Generator().manual_seed(0)
        self.submitted: list[str] = []

    def kv_list(self):
        return {"train": dict(self.tags)} if self.tags else None

    def kv_clear(self, keys, partition_id):
        for k in keys:
            self.tags.pop(k, None)
            self.values.pop(k, None)

    def kv_batch_get(self, keys, partition_id, select_fields):
        return tu.list_of_dict_to_tensordict([{f: self.values[k][f] for f in select_fields} for k in keys])

    # what the agent loop writes for one prompt (verl's AgentLoopWorker._run_prompt and _agent_loop_postprocess)
    def submit(self, prompts):
        for uid in prompts["uid"]:
            self.submitted.append(uid)
            failed = {PARTIAL: {2}, EMPTY: set(range(K))}.get(uid, set())
            scores = torch.rand(K, generator=self.gen)
            for k in sorted(set(range(K)) - failed):
                rm = torch.zeros(3)
                rm[-1] = scores[k]
                reference = float(scores[k]) + 0.1 * float(torch.randn(1, generator=self.gen))
                self.tags[f"{uid}_{k}_0"] = {"status": "success", "seq_len": 3}
                self.values[f"{uid}_{k}_0"] = {"uid": uid, "response_mask": torch.ones(3, dtype=torch.int64),
                                               "rm_scores": rm,
                                               "extra_fields": {"reward_extra_info": {"reference_score": reference}}}
            status = "failure" if failed else "finished"
            self.tags[uid] = {"is_prompt": True, "status": status, "global_steps": 1}
        return len(prompts)

    def sketch(self, batch, fused=False):
        for key in batch.keys:
            self.values[key][SKETCH_KEY] = torch.randn(5, generator=self.gen)
            self.values[key][SKETCH_ROWS_KEY] = torch.tensor(True)  # the trainer's row mask: every row


def _prompts(uids: list[str]):
    return tu.get_tensordict({"uid": np.array(uids, dtype=object), "index": torch.arange(len(uids))})


def _setup(tmp_path, monkeypatch):
    trainer = _record_trainer(tmp_path, calibration={"only": True, "on_infeasible": "reject_all"})
    fake = _TransferQueue()
    monkeypatch.setattr(trainer_module, "tq", fake)
    monkeypatch.setattr(calibration_module, "tq", fake)
    monkeypatch.setattr(replay_buffer_module, "tq", fake)
    trainer.checkpoint_manager = SimpleNamespace(update_weights=lambda global_steps=None: None,
                                                 sleep_replicas=lambda: None)
    trainer.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=["reward worker"])  # scored in rollout
    trainer.curr_step_profile = False
    trainer.logged = []
    trainer.logger = SimpleNamespace(log=lambda data, step: trainer.logged.append(data))
    trainer._submit_batch_to_rollout = fake.submit
    trainer._compute_sketches = fake.sketch
    trainer._balance_batch = lambda batch, metrics: batch
    training = iter(f"train{i}" for i in range(100))
    trainer._next_train_batch = lambda num_prompts=None: _prompts([next(training) for _ in range(num_prompts)])
    # verl's sync buffer as trainer_base builds it with sync_refill_failed_groups=true: refill_fn is the trainer's
    # _add_prompts_to_generate (verl's own method)
    trainer.replay_buffer = ReplayBuffer(
        trainer_mode="sync", trainer_config={}, max_off_policy_threshold=None, max_off_policy_strategy="drop",
        sampler_kwargs={}, poll_interval=0.0, refill_fn=trainer._add_prompts_to_generate, filter_groups_metric=None,
        train_batch_size=8, gen_batch_size=1, sync_refill_failed_groups=True,
    )
    return trainer, fake


def test_verls_buffer_refills_a_failed_group_with_a_training_prompt(tmp_path, monkeypatch):
    """What calibration met: verl keeps the K - 1 group and replaces the empty one with a training prompt."""
    trainer, fake = _setup(tmp_path, monkeypatch)
    fake.submit(_prompts([PARTIAL, EMPTY, "p2x0", "p2x1"]))
    batch, metrics = trainer.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=4)
    uids = [k.split("_")[0] for k in batch.keys]
    assert uids.count(PARTIAL) == K - 1 and EMPTY not in uids
    assert uids.count("train0") == K  # a training prompt in what was asked for as four calibration prompts
    assert metrics["training/rollout_failure/evicted_samples"] == 1


def test_calibration_takes_only_its_prompts_and_counts_what_it_left_out(tmp_path, monkeypatch):
    trainer, fake = _setup(tmp_path, monkeypatch)
    trainer._calibration_batches = lambda: iter([_prompts([f"p{b}x{i}" for i in range(8)]) for b in range(3)])
    record = trainer._calibrate()
    assert not any(u.startswith("train") for u in fake.submitted)  # refill_fn was never called
    paired = np.load(tmp_path / "paired_scores.npz")
    assert paired["point"].shape == (22, K) and record.K == K  # 24 prompts, PARTIAL and EMPTY left out
    assert (int(paired["dropped_incomplete"]), int(paired["dropped_no_response"])) == (1, 1)
    (summary,) = trainer.logged
    assert summary["setgrpo/calibration/dropped_incomplete"] == 1.0
    assert summary["setgrpo/calibration/dropped_no_response"] == 1.0
    # the buffer's own settings are back for training
    buffer = trainer.replay_buffer
    assert buffer.sync_refill_failed_groups and buffer.refill_fn == trainer._add_prompts_to_generate


def test_a_group_from_outside_the_calibration_set_is_an_error(tmp_path, monkeypatch):
    trainer, fake = _setup(tmp_path, monkeypatch)
    fake.submit(_prompts(["stray"]))  # e.g. a prompt left in TransferQueue's train partition
    fake.tags["stray"]["global_steps"] = 0  # from an earlier step: verl's buffer samples the oldest prompts first
    trainer._calibration_batches = lambda: iter([_prompts([f"p9x{i}" for i in range(8)])])
    with pytest.raises(RuntimeError, match="outside the batch it rolled out"):
        trainer._calibrate()


@pytest.mark.parametrize("change", [{"package_versions": {"setgrpo-verl": "0.0.1", "verl": "0.9.1"}},
                                    {"tau_start_source": {"kind": "pilot", "record_sha256": "ab" * 32}}])
def test_a_resume_refuses_shards_the_record_would_refuse_before_any_rollout(tmp_path, monkeypatch, change):
    """Shards of another setgrpo-verl major.minor, or started from another tau_start source, would make the record
    fail once every batch is rolled out: the resume refuses them first, naming the file."""
    from setgrpo_verl.core.shards import read_shard, write_shard

    batches = [[f"p{b}x{i}" for i in range(8)] for b in range(3)]
    trainer, fake = _setup(tmp_path, monkeypatch)
    trainer._calibration_batches = lambda: iter([_prompts(b) for b in batches])
    trainer._calibrate()
    for name in ("setgrpo_calibration.json", "paired_scores.npz"):  # the record of a run without record_out
        (tmp_path / name).unlink()
    shards = tmp_path / "shards"
    (shards / "batch_000002.npz").unlink()  # a stopped calibration: one batch still to roll out
    first = read_shard(shards / "batch_000000.npz")
    write_shard(shards, CalibrationShard(**{**first.__dict__, **change}))
    trainer, fake = _setup(tmp_path, monkeypatch)
    trainer._calibration_batches = lambda: iter([_prompts(b) for b in batches])
    with pytest.raises(ValueError, match=r"batch_000000.npz (was written with setgrpo-verl 0.0.1|names the tau_start "
                                         r"source .*pilot.*, this calibration \{.*\}; .*: set "
                                         r"algorithm.setgrpo.tau_start_pilot)"):
        trainer._calibrate()
    assert fake.submitted == []
