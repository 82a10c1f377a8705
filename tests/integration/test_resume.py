"""Resuming a SetGRPO run from a verl checkpoint, at the level of the trainer's start-of-training hook (no workers).

What must hold: a run that saved its checkpoint at step 3 and was interrupted in step 4 resumes with the monitor
counts, group log and metrics history of step 3, so steps 4-6 give exactly the uninterrupted run's monitor
metrics; another record is refused, by the trainer and by the check before Ray, naming both hashes, unless
``algorithm.setgrpo.resume_other_record=true``; a checkpoint without SetGRPO's state is refused. The real
``main_ppo`` runs are in ``tests/verl_cpu/test_stop_and_resume.py``.
"""

from __future__ import annotations

import inspect
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from setgrpo_verl.core import CalibrationSettings, OnlineRiskMonitor, calibrate, setgrpo_coefficients
from setgrpo_verl.integration.config import setgrpo_config_from
from setgrpo_verl.integration.identity import run_identity
from setgrpo_verl.integration.resume import STATE_FILE, check_resume, keep_history, read_state
from setgrpo_verl.integration.trainer import SetGRPOTrainer
from setgrpo_verl.models import embedded_model_dir

from ..core.synthetic import make_groups


def _trainer(tmp_path, global_steps, **setgrpo):
    trainer = SetGRPOTrainer.__new__(SetGRPOTrainer)  # the record / checkpoint logic only: no Ray workers
    trainer.config = OmegaConf.create({
        "algorithm": {"adv_estimator": "setgrpo", "norm_adv_by_std_in_grpo": True,
                      "setgrpo": {"alpha": 0.1, "beta": 0.3, "delta": 0.1, "group_log": str(tmp_path / "groups.jsonl"),
                                  **setgrpo}},
        "actor_rollout_ref": {"rollout": {"n": 4, "temperature": 1.0, "top_p": 1.0},
                              "actor": {"loss_agg_mode": "token-mean"}, "model": {"path": str(embedded_model_dir())}},
        "data": {"max_response_length": 64},
        "reward": {"reward_manager": {"name": "setgrpo_dual"},
                   "reward_kwargs": {"grader": {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "j"}}},
        "trainer": {"default_local_dir": str(tmp_path / "checkpoints"), "resume_mode": "auto", "logger": ["file"],
                    "project_name": "p", "experiment_name": "e"},
    })
    trainer.setgrpo = setgrpo_config_from(trainer.config.algorithm)
    trainer.sketch_config = trainer.setgrpo.sketch.to_sketch_config()
    trainer.global_steps = global_steps
    trainer.logger = None
    return trainer


def _records(tmp_path):
    identity = run_identity(_trainer(tmp_path, 1).config, _trainer(tmp_path, 1).setgrpo)
    point, ref, gram = make_groups(200, k=4, noise=0.05, seed=0)
    paths = []
    for name, split_seed in (("A", 0), ("B", 5)):
        rec = calibrate(point, ref, gram,
                        CalibrationSettings(alpha=0.1, beta=0.3, delta=0.1, on_infeasible="reject_all"),
                        split_seed=split_seed, metadata=identity)
        rec.to_json(tmp_path / f"{name}.json")
        paths.append(str(tmp_path / f"{name}.json"))
    return paths


def _step(trainer, step):
    """One training step's monitor update and group-log rows; steps >= 5 have the reference ranking reversed."""
    point, ref, gram = make_groups(24, k=4, noise=0.05, seed=100 + step)
    if step >= 5:
        ref = 1.0 - ref
    result = setgrpo_coefficients(point, gram, trainer.record)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metrics = trainer.monitor.update(result, ref, gram)
    with open(trainer.setgrpo.group_log, "a") as fh:
        for g in range(24):
            fh.write(json.dumps({"step": step, "group": g, "accepted": bool(result.accepted[g])}) + "\n")
    return metrics


def _interrupted_run(tmp_path, record):
    """Steps 1-3, a checkpoint of step 3 (SetGRPO's part and verl's tracker), then step 4 cut short; metrics
    rows of steps 1-4 in verl's file logger format."""
    trainer = _trainer(tmp_path, 1, record_path=record)
    trainer.on_train_begin()
    metrics = {s: _step(trainer, s) for s in (1, 2, 3)}
    trainer.global_steps = 3
    folder = tmp_path / "checkpoints" / "global_step_3"
    trainer._write_setgrpo_state(str(folder))
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("3")
    _step(trainer, 4)  # trained into the group log and the monitor, but not into a checkpoint
    with open(tmp_path / "metrics.jsonl", "w") as fh:
        for s in (1, 2, 3, 4):
            fh.write(json.dumps({"step": s, "data": {"setgrpo/online_coverage_cum": s}}) + "\n")
    return trainer, metrics


def _resume(tmp_path, monkeypatch, record, **setgrpo):
    """verl's resume: global_steps from the checkpoint, the history read, then Tracking (which truncates the
    metrics file) and on_train_begin at step 4."""
    from verl.utils.tracking import Tracking

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    trainer = _trainer(tmp_path, 3, record_path=record, **setgrpo)
    trainer._history = keep_history(str(tmp_path / "metrics.jsonl"), 3)
    trainer.logger = Tracking("p", "e", default_backend=["file"])
    trainer.global_steps = 4
    trainer.on_train_begin()
    return trainer


def test_resume_continues_monitor_group_log_and_metrics(tmp_path, monkeypatch):
    rec_a, _ = _records(tmp_path)
    first, before = _interrupted_run(tmp_path, rec_a)
    state = read_state(str(tmp_path / "checkpoints" / "global_step_3"))
    assert state["step"] == 3 and state["record_sha256"] == first.record.to_dict()["content_sha256"]
    straight = OnlineRiskMonitor(first.record)
    for s in (1, 2, 3):
        straight_metrics = _step(SimpleNamespace(record=first.record, monitor=straight,
                                                 setgrpo=SimpleNamespace(group_log=str(tmp_path / "other.jsonl"))), s)
    assert state["monitor"] == straight.state_dict() and state["monitor"]["seen"] > 0
    assert straight_metrics == before[3]

    resumed = _resume(tmp_path, monkeypatch, rec_a)
    assert resumed.monitor.state_dict() == state["monitor"]  # not zero: the counts of steps 1-3
    groups = [json.loads(x) for x in open(tmp_path / "groups.jsonl")]
    assert [g["step"] for g in groups] == [1] * 24 + [2] * 24 + [3] * 24  # step 4's rows are gone: it is redone
    resumed.logger.log({"setgrpo/online_coverage_cum": 4.5}, step=4)
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[3]["data"]["setgrpo/online_coverage_cum"] == 4.5
    # steps 4-6 after the resume give the uninterrupted run's monitor metrics, drift warning state included
    for s in (4, 5, 6):
        ref_metrics = _step(SimpleNamespace(record=first.record, monitor=straight,
                                            setgrpo=SimpleNamespace(group_log=str(tmp_path / "other.jsonl"))), s)
        assert _step(resumed, s) == ref_metrics
    assert resumed.monitor.state_dict() == straight.state_dict()


def test_resume_with_another_record_is_refused_naming_both_hashes(tmp_path, monkeypatch):
    rec_a, rec_b = _records(tmp_path)
    first, _ = _interrupted_run(tmp_path, rec_a)
    hash_a = first.record.to_dict()["content_sha256"]
    hash_b = json.load(open(rec_b))["content_sha256"]
    assert hash_a != hash_b
    with pytest.raises(ValueError) as exc:
        _resume(tmp_path, monkeypatch, rec_b)
    assert hash_a in str(exc.value) and hash_b in str(exc.value) and "resume_other_record" in str(exc.value)
    # the same refusal before Ray (check_run_config calls check_resume)
    other = _trainer(tmp_path, 0, record_path=rec_b)
    with pytest.raises(ValueError, match=hash_b):
        check_resume(other.config, other.setgrpo)
    check_resume(_trainer(tmp_path, 0, record_path=rec_a).config, _trainer(tmp_path, 0, record_path=rec_a).setgrpo)
    # the documented override: resumes with record B, the monitor starting from zero
    resumed = _resume(tmp_path, monkeypatch, rec_b, resume_other_record=True)
    assert resumed.monitor.state_dict()["seen"] == 0


def test_a_checkpoint_without_setgrpo_state_is_refused(tmp_path, monkeypatch):
    rec_a, _ = _records(tmp_path)
    _interrupted_run(tmp_path, rec_a)
    (tmp_path / "checkpoints" / "global_step_3" / STATE_FILE).unlink()
    with pytest.raises(ValueError, match="has no setgrpo_state.json"):
        _resume(tmp_path, monkeypatch, rec_a)
    trainer = _trainer(tmp_path, 0, record_path=rec_a)
    with pytest.raises(ValueError, match="has no setgrpo_state.json"):
        check_resume(trainer.config, trainer.setgrpo)


def test_verl_internals_the_resume_relies_on():
    """verl 0.9.1: the file logger truncates its file, Tracking keeps it under "file", _load_checkpoint chooses the
    folder as resume_folder does, and the sync trainer saves the checkpoint after the step's advantages."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.utils.tracking import FileLogger, Tracking

    assert 'open(self.filepath, "wb"' in inspect.getsource(FileLogger.__init__)
    assert 'self.logger["file"] = FileLogger(' in inspect.getsource(Tracking.__init__)
    load = inspect.getsource(PPOTrainer._load_checkpoint)
    for text in ('resume_mode == "auto"', "find_latest_ckpt_path(checkpoint_folder)", 'resume_mode == "resume_path"',
                 'self.global_steps = int(global_step_folder.split("global_step_")[-1])'):
        assert text in load, text
    fit = inspect.getsource(PPOTrainer.fit)
    assert fit.index("self.step(metrics, self.timing_raw)") < fit.index("self._save_checkpoint()")
    assert fit.index("self.logger = Tracking(") < fit.index("self.on_train_begin()")


def test_a_fresh_start_is_not_checked_and_prints_nothing(tmp_path, capsys):
    rec_a, rec_b = _records(tmp_path)
    for record in (rec_a, rec_b):
        trainer = _trainer(tmp_path, 0, record_path=record)
        check_resume(trainer.config, trainer.setgrpo)
    assert capsys.readouterr().out == ""


def test_resume_from_a_path_outside_the_run_restores_that_checkpoint(tmp_path):
    """trainer.resume_mode=resume_path: the check before Ray and the restore read the same folder, the one verl
    loads (trainer.resume_from_path), not <default_local_dir>/global_step_N."""
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    rec_a, _ = _records(old)
    first, _ = _interrupted_run(old, rec_a)
    state = json.loads((old / "checkpoints" / "global_step_3" / STATE_FILE).read_text())
    trainer = _trainer(new, 3, record_path=rec_a)
    trainer.config.trainer.resume_mode = "resume_path"
    trainer.config.trainer.resume_from_path = str(old / "checkpoints" / "global_step_3")
    check_resume(trainer.config, trainer.setgrpo)
    trainer.global_steps = 4  # verl's _load_checkpoint loaded step 3, fit() added 1
    trainer.on_train_begin()
    assert trainer.monitor.state_dict() == state["monitor"] and state["monitor"]["seen"] > 0


def test_a_record_of_the_previous_schema_answers_to_the_hash_its_checkpoints_name(tmp_path):
    """A checkpoint trained with a schema-4 record names that file's hash; the migrated record still matches it."""
    from setgrpo_verl.integration.resume import check_state, record_sha256

    path = Path(__file__).parents[1] / "core" / "data" / "record_schema4.json"
    stored = json.loads(path.read_text())["content_sha256"]
    assert record_sha256(str(path)) == stored
    state = {"version": 1, "step": 3, "record_sha256": stored, "monitor": None}
    assert check_state(str(tmp_path), state, str(path), record_sha256(str(path)), allow_other=False)


def test_the_grpo_stages_trainer_keeps_its_metric_rows_across_a_resume_that_dies(tmp_path, monkeypatch):
    """verl's file logger truncates the metrics file when it opens it. The GRPO stage's trainer (compare's grpo and
    grpo_mean2 arms, the main job's baseline) keeps the rows up to its checkpoint itself, as the SetGRPO trainer
    does: a resume killed right after the logger opened the file loses none of them (they wait in
    ``<file>.kept``), and the next resume writes them back before its first validation (review D4)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.utils.tracking import Tracking

    from setgrpo_verl.integration.sync_mode import GradedSyncTrainer

    metrics = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(metrics))
    before = [json.dumps({"step": s, "data": {"x": float(s)}}) + "\n" for s in range(11)]
    metrics.write_text("".join(before) + json.dumps({"step": 11, "data": {"x": 11.0}}) + "\n")  # 11: trained again
    killed = {"now": True}

    def fit(self, agent_loop_manager):  # verl 0.9.1 fit: the logger, a validation first, then the steps
        self.logger = Tracking("p", "e", default_backend=["file"])
        if killed["now"]:
            raise SystemExit(-9)  # the process dies before anything else
        self.on_validate_begin()
        self.logger.log({"val": 1.0}, step=self.global_steps)
        self.global_steps += 1
        self.on_train_begin()
        self.logger.log({"x": 11.5}, step=self.global_steps)
        self.logger.logger["file"].fp.close()

    monkeypatch.setattr(PPOTrainerSync, "fit", fit)
    monkeypatch.setattr(PPOTrainerSync, "on_validate_begin", lambda self: None)
    monkeypatch.setattr(PPOTrainerSync, "on_train_begin", lambda self: None)
    config = OmegaConf.create({"trainer": {"logger": ["file"], "project_name": "p", "experiment_name": "e"}})

    def resume():
        trainer = GradedSyncTrainer.__new__(GradedSyncTrainer)
        trainer.config, trainer.global_steps = config, 10  # verl's _load_checkpoint: step 10
        trainer.fit(None)

    with pytest.raises(SystemExit):
        resume()
    assert metrics.read_text() == ""  # truncated by verl's file logger
    assert (tmp_path / "metrics.jsonl.kept").read_text() == "".join(before[:11])
    killed["now"] = False
    resume()
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(11)) + [10, 11]
    assert rows[11]["data"] == {"val": 1.0} and rows[12]["data"] == {"x": 11.5}
    assert not (tmp_path / "metrics.jsonl.kept").exists()
