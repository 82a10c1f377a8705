"""The calibration phase syncs the rollout's weights once, not once per batch (the policy does not change).

The trainer's calibration phase runs against recording stand-ins for verl's checkpoint manager (weight syncs,
sleeps), rollout, replay buffer, sketch RPC and TransferQueue; the calibration itself (``calibrate`` and the
record) is the real one. What must hold: every calibration batch is rolled out while the rollout is awake, every
sketch pass runs while it sleeps (the memory verl frees before its actor passes), and the weights are synced
once per chunk after the first (none within a chunk), plus once to wake the rollout when training follows.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transfer_queue.metadata import KVBatchMeta

from verl.utils import tensordict_utils as tu

import setgrpo_verl.integration.calibration as calibration_module
import setgrpo_verl.integration.trainer as trainer_module
from setgrpo_verl.core.record import prompt_fingerprint
from setgrpo_verl.integration.calibration import calibration_chunk_prompts
from setgrpo_verl.integration.worker import SKETCH_KEY, SKETCH_ROWS_KEY

from .test_plugin import _record_trainer

K = 4  # rollout.n of _record_trainer


class _Rollout:
    """Stand-ins for the checkpoint manager, the rollout + replay buffer, the sketch RPC and TransferQueue."""

    def __init__(self):
        self.events: list[str] = []
        self.awake = True  # verl's on_init_end synced the initial weights and left the rollout awake
        self.store: dict[str, dict] = {}
        self.ready: list[str] = []
        self.gen = torch.Generator().manual_seed(0)

    # checkpoint manager
    def update_weights(self, global_steps=None):
        self.events.append("sync")
        self.awake = True

    def sleep_replicas(self):
        self.events.append("sleep")
        self.awake = False

    # rollout and replay buffer
    def submit(self, prompts):
        assert self.awake, "a calibration batch was rolled out while the rollout slept"
        self.events.append("rollout")
        for uid in prompts["uid"]:
            scores = torch.rand(K, generator=self.gen)
            for k in range(K):
                rm = torch.zeros(3)
                rm[-1] = scores[k]
                noise = 0.1 * float(torch.randn(1, generator=self.gen))
                self.store[f"{uid}_{k}_0"] = {"uid": uid, "response_mask": torch.ones(3, dtype=torch.int64),
                                              "rm_scores": rm,
                                              "extra_fields": {"reward_extra_info": {"reference_score":
                                                                                     float(scores[k]) + noise}}}
            self.ready.append(uid)
        return len(prompts)

    def sample(self, global_steps, partition_id, batch_size):
        uids, self.ready = self.ready[:batch_size], self.ready[batch_size:]
        keys = [k for k in self.store if k.split("_")[0] in uids]
        return KVBatchMeta(partition_id=partition_id, keys=keys, tags=[{"status": "success"} for _ in keys]), {}

    def sketch(self, batch, fused=False):
        assert not self.awake, "a sketch pass ran while the rollout held its memory"
        self.events.append("sketch")
        for key in batch.keys:
            self.store[key][SKETCH_KEY] = torch.randn(5, generator=self.gen)
            self.store[key][SKETCH_ROWS_KEY] = torch.tensor(True)  # the trainer's row mask: every row

    # TransferQueue
    def kv_batch_get(self, keys, partition_id, select_fields):
        return tu.list_of_dict_to_tensordict([{f: self.store[k][f] for f in select_fields} for k in keys])

    def kv_clear(self, keys, partition_id):
        for k in keys:
            del self.store[k]


def _calibrate(tmp_path, monkeypatch, batches: int, per_batch: int, *, only: bool, storage: int | None = None,
               chunk_batches: int = 1, fake: "_Rollout | None" = None, setgrpo: dict | None = None,
               resume_mode: str = "auto", **calibration):
    trainer = _record_trainer(tmp_path, calibration={"only": only, "on_infeasible": "reject_all",
                                                     "chunk_batches": chunk_batches, **calibration}, **(setgrpo or {}))
    trainer.config.trainer.resume_mode = resume_mode
    if storage is not None:
        trainer.config.transfer_queue = {"backend": {"storage_backend": "SimpleStorage",
                                                     "SimpleStorage": {"total_storage_size": storage}}}
    fake = fake or _Rollout()
    monkeypatch.setattr(trainer_module, "tq", fake)
    monkeypatch.setattr(calibration_module, "tq", fake)
    trainer.checkpoint_manager = fake
    trainer.replay_buffer = SimpleNamespace(sample=fake.sample)
    trainer.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=["reward worker"])  # scored in rollout
    trainer.curr_step_profile = False
    trainer.logger = SimpleNamespace(log=lambda data, step: None)
    trainer._submit_batch_to_rollout = fake.submit
    trainer._compute_sketches = fake.sketch
    trainer._balance_batch = lambda batch, metrics: batch

    def calibration_batches():
        for b in range(batches):
            uids = [f"p{b}x{i}" for i in range(per_batch)]
            trainer._calibration_prompts += [prompt_fingerprint(u, f"question {u}", []) for u in uids]
            yield tu.get_tensordict({"uid": np.array(uids, dtype=object)})

    trainer._calibration_batches = calibration_batches
    record = trainer._calibrate()
    assert not fake.store  # every calibration rollout was cleared from TransferQueue
    return record, fake.events


@pytest.mark.parametrize("only", [True, False])
def test_one_chunk_rolls_out_every_batch_then_sleeps_once_without_a_sync(tmp_path, monkeypatch, only):
    record, events = _calibrate(tmp_path, monkeypatch, batches=3, per_batch=8, only=only, chunk_batches=3)
    assert events == ["rollout"] * 3 + ["sleep"] + ["sketch"] * 3 + ([] if only else ["sync"])
    paired = np.load(tmp_path / "paired_scores.npz")
    assert paired["point"].shape == (24, K) and paired["gram"].shape == (24, K, K)
    assert record.K == K


def test_streaming_writes_a_shard_per_batch_with_one_sync_per_further_batch(tmp_path, monkeypatch):
    record, events = _calibrate(tmp_path, monkeypatch, batches=3, per_batch=8, only=False)
    assert events == ["rollout", "sleep", "sketch", "sync"] * 3
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [f"batch_{b:06d}.npz" for b in range(3)]
    assert len(record.calibration_prompts) == 24


def test_a_set_larger_than_transfer_queue_holds_is_chunked_with_one_sync_per_further_chunk(tmp_path, monkeypatch):
    # room for 2 * K * 8 responses: chunks of at most 8 prompts, i.e. two batches of 4
    _, events = _calibrate(tmp_path, monkeypatch, batches=5, per_batch=4, only=True, storage=2 * K * 8,
                           chunk_batches=5)
    chunk = ["rollout", "rollout", "sleep", "sketch", "sketch"]
    assert events == chunk + ["sync"] + chunk + ["sync", "rollout", "sleep", "sketch"]
    assert events.count("sync") == 2  # against 4 when every batch after the first syncs


def test_chunk_size_from_transfer_queue_capacity():
    def config(backend):
        return OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": 8}}, "transfer_queue": {"backend": backend}})

    assert calibration_chunk_prompts(config({"storage_backend": "SimpleStorage",
                                             "SimpleStorage": {"total_storage_size": 100000}})) == 6250
    assert calibration_chunk_prompts(config({"storage_backend": "SimpleStorage",
                                             "SimpleStorage": {"total_storage_size": None}})) is None
    assert calibration_chunk_prompts(config({"storage_backend": "MooncakeStore"})) is None
    assert calibration_chunk_prompts(config({"storage_backend": "SimpleStorage",
                                             "SimpleStorage": {"total_storage_size": 4}})) == 1


def test_a_reward_computed_in_the_trainer_process_brings_its_extra_keys(monkeypatch):
    """Reward model without its own pool: verl's _compute_reward_colocate writes rm_scores and the reward's extra
    keys to TransferQueue; the batch the SetGRPO trainer reads next names them, so the reference score is read."""
    import verl.trainer.ppo.v1.trainer_base as base
    from verl import DataProto

    store = {"prompts": torch.nested.as_nested_tensor([torch.tensor([1, 2]), torch.tensor([3])], layout=torch.jagged),
             "responses": torch.nested.as_nested_tensor([torch.tensor([4]), torch.tensor([5, 6])], layout=torch.jagged),
             "raw_prompt": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]}
    fake = SimpleNamespace(kv_batch_get=lambda keys, partition_id, select_fields: {k: store[k] for k in select_fields},
                           kv_batch_put=lambda keys, partition_id, fields: store.update(dict(fields.items())))
    monkeypatch.setattr(base, "tq", fake)

    class Manager:
        def compute_rm_score(self, rm_input):
            out = DataProto.from_dict(tensors={"rm_scores": torch.tensor([[0.5, 0.0], [0.25, 0.0]])},
                                      non_tensors={"setgrpo_reference_score": np.array([0.4, 0.3], dtype=object)})
            out.meta_info["reward_extra_keys"] = ["setgrpo_reference_score"]
            return out

    trainer = trainer_module.SetGRPOTrainer.__new__(trainer_module.SetGRPOTrainer)
    trainer.reward_loop_manager, trainer.tokenizer = Manager(), SimpleNamespace(pad_token_id=0)
    batch = KVBatchMeta(keys=["a", "b"], tags=[{}, {}], partition_id="train", fields=["prompts", "responses"])
    batch = trainer._compute_reward_colocate(batch, metrics={})
    assert batch.fields == ["prompts", "responses", "rm_scores", "setgrpo_reference_score"]
    assert "setgrpo_reference_score" in store and "rm_scores" in store
    assert "compute_rm_score" not in vars(trainer.reward_loop_manager)
    # verl's fields=None means every field: the next RPCs (old log-prob, sketches) still read input_ids and the rest
    store.pop("rm_scores"), store.pop("setgrpo_reference_score")
    batch = KVBatchMeta(keys=["a", "b"], tags=[{}, {}], partition_id="train", fields=None)
    batch = trainer._compute_reward_colocate(batch, metrics={})
    assert batch.fields is None
    assert "setgrpo_reference_score" in store and "rm_scores" in store


class _Stop(Exception):
    """A stop (SIGTERM, a lost node) in the middle of the calibration."""


def _stopping(after: int) -> _Rollout:
    fake = _Rollout()
    sketch, calls = fake.sketch, []

    def stop_after(batch, fused=False):
        if len(calls) == after:
            raise _Stop
        calls.append(1)
        sketch(batch, fused)

    fake.sketch = stop_after
    return fake


def test_a_stopped_calibration_resumes_from_its_shards_without_rolling_them_out_again(tmp_path, monkeypatch):
    with pytest.raises(_Stop):
        _calibrate(tmp_path, monkeypatch, batches=3, per_batch=8, only=True, fake=_stopping(after=1))
    first = (tmp_path / "shards" / "batch_000000.npz").read_bytes()
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["batch_000000.npz"]
    record, events = _calibrate(tmp_path, monkeypatch, batches=3, per_batch=8, only=True)
    assert events.count("rollout") == 2  # batch 0 was not rolled out again
    assert (tmp_path / "shards" / "batch_000000.npz").read_bytes() == first
    paired = np.load(tmp_path / "paired_scores.npz")
    with np.load(tmp_path / "shards" / "batch_000000.npz") as shard:
        np.testing.assert_array_equal(paired["point"][:8], shard["point"])
    ids = [p["id"] for p in record.calibration_prompts]
    assert sorted(ids) == sorted(f"p{b}x{i}" for b in range(3) for i in range(8)) and len(set(ids)) == 24
    # the record is the shard set's: building it again from the shards gives the same bytes
    from setgrpo_verl.core.shards import load_shards, record_from_shards

    shards, _ = load_shards(tmp_path / "shards")
    again, _ = record_from_shards([(tmp_path / "shards" / f"batch_{b:06d}.npz", s) for b, s in shards.items()])
    again.to_json(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "setgrpo_calibration.json").read_bytes()


def test_a_torn_shard_is_refused_on_resume_and_calibrated_again(tmp_path, monkeypatch):
    with pytest.raises(_Stop):
        _calibrate(tmp_path, monkeypatch, batches=3, per_batch=8, only=True, fake=_stopping(after=2))
    torn = tmp_path / "shards" / "batch_000001.npz"
    cut = torn.read_bytes()[:300]
    torn.write_bytes(cut)  # cut off mid-file
    shards = tmp_path / "shards"
    (shards / ".batch_000002.npz.5d41402abc4b2a76.tmp").write_bytes(b"half")  # a write that did not reach its rename
    (shards / ".batch_000002.npz.tmp").write_bytes(b"half")  # ... as an earlier version named it
    (tmp_path / "shards" / "batch_000001.npz.torn").write_bytes(b"set aside by an earlier resume")
    _, events = _calibrate(tmp_path, monkeypatch, batches=3, per_batch=8, only=True)
    assert events.count("rollout") == 2  # batches 1 (torn) and 2
    assert (tmp_path / "shards" / "batch_000001.npz.torn").read_bytes() == b"set aside by an earlier resume"
    assert (tmp_path / "shards" / "batch_000001.npz.torn.1").read_bytes() == cut
    assert sorted(p.name for p in (tmp_path / "shards").glob("*.npz")) == [f"batch_{b:06d}.npz" for b in range(3)]
    assert not list((tmp_path / "shards").glob(".*.tmp"))


def test_a_shard_the_file_system_fails_to_read_stops_the_resume_and_is_kept(tmp_path, monkeypatch):
    import errno
    import zipfile

    with pytest.raises(_Stop):
        _calibrate(tmp_path, monkeypatch, batches=3, per_batch=8, only=True, fake=_stopping(after=2))
    before = {p.name: p.read_bytes() for p in (tmp_path / "shards").iterdir()}

    def eio(self, *args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with monkeypatch.context() as m:
        m.setattr(zipfile.ZipExtFile, "read", eio)
        with pytest.raises(OSError, match=r"batch_000000.npz could not be read \(Input/output error\)"):
            _calibrate(tmp_path, monkeypatch, batches=3, per_batch=8, only=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "shards").iterdir()} == before  # nothing set aside
    _, events = _calibrate(tmp_path, monkeypatch, batches=3, per_batch=8, only=True)
    assert events.count("rollout") == 1  # once the storage answers, only the batch without a shard


def test_a_part_leaves_the_temporary_files_of_another_parts_batches_alone(tmp_path, monkeypatch):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "batch_000000.npz").write_bytes(b"")  # not read: only its name makes the folder a resume
    own, other = (tmp_path / "shards" / ".batch_000001.npz.5d41402abc4b2a76.tmp",
                  tmp_path / "shards" / ".batch_000002.npz.7d793037a0760186.tmp")
    own.write_bytes(b"this part's write, cut off")
    other.write_bytes(b"part 0/2 writing now")
    record, events = _calibrate(tmp_path, monkeypatch, batches=4, per_batch=4, only=True, shard="1/2")
    assert record is None and events.count("rollout") == 2 and not own.exists()
    assert other.read_bytes() == b"part 0/2 writing now"


def test_shards_of_another_run_or_without_resume_are_refused(tmp_path, monkeypatch):
    with pytest.raises(_Stop):
        _calibrate(tmp_path, monkeypatch, batches=3, per_batch=8, only=True, fake=_stopping(after=1))
    with pytest.raises(ValueError, match=r"batch_000000.npz mismatch in settings.alpha: shard has 0.1, this run has "
                                         r"0.2"):
        _calibrate(tmp_path, monkeypatch, batches=3, per_batch=8, only=True, setgrpo={"alpha": 0.2})
    with pytest.raises(ValueError, match="trainer.resume_mode=disable"):
        _calibrate(tmp_path, monkeypatch, batches=3, per_batch=8, only=True, resume_mode="disable")


def test_a_part_of_a_sharded_calibration_writes_its_shards_and_no_record(tmp_path, monkeypatch):
    record, events = _calibrate(tmp_path, monkeypatch, batches=5, per_batch=4, only=True, shard="1/2")
    assert record is None and events.count("rollout") == 2
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["batch_000001.npz", "batch_000003.npz"]
    assert not (tmp_path / "setgrpo_calibration.json").exists()


def test_a_part_without_calibration_only_or_a_bad_part_is_refused_in_the_config():
    from setgrpo_verl.integration.config import SetGRPOCalibrationConfig

    assert SetGRPOCalibrationConfig(shard="1/4", only=True).part() == (1, 4)
    assert SetGRPOCalibrationConfig().part() == (0, 1)
    with pytest.raises(ValueError, match=r"calibration.shard=1/4 .* set calibration.only=true"):
        SetGRPOCalibrationConfig(shard="1/4")
    with pytest.raises(ValueError, match=r"algorithm.setgrpo.calibration.shard '4/4': give I/N"):
        SetGRPOCalibrationConfig(shard="4/4", only=True)
    with pytest.raises(ValueError, match=r"chunk_batches=0 must be >= 1"):
        SetGRPOCalibrationConfig(chunk_batches=0)
