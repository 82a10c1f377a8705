"""Calibration groups whose grading failed are counted apart from the other groups left out, bounded by
``calibration.max_grading_failure_ratio``, and a batch that failed grading whole stops calibration naming the judge;
the reward manager turns a calibration response's grading failure into a row that says so."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transfer_queue.metadata import KVBatchMeta

from verl.utils import tensordict_utils as tu

from setgrpo_verl.core.shards import CalibrationShard, read_shard, write_shard
from setgrpo_verl.integration.calibration import calibration_groups
from setgrpo_verl.integration.config import SetGRPOCalibrationConfig
from setgrpo_verl.integration.grading_failures import check_grading_failure_share
from setgrpo_verl.integration.reward_config import CALIBRATION_MARK, GRADING_ERROR_KEY
from setgrpo_verl.integration.worker import SKETCH_KEY

from .test_calibration_syncs import K, _calibrate, _Rollout
from .test_plugin import _record_trainer

JUDGE = "judge 'judge' at http://127.0.0.1:9/v1"  # _record_trainer's grader, as messages name it
ERROR = "judge 'judge' at http://127.0.0.1:9/v1 answered HTTP 503 after 4 retries: overloaded"


class _FailingRollout(_Rollout):
    """The calibration stand-ins, where grading failed for one response of each prompt in ``failing`` (its row
    carries the error and no score, as the dual-reward manager writes it) and every other row says ``""``."""

    def __init__(self, failing):
        super().__init__()
        self.failing = set(failing)

    def submit(self, prompts):
        out = super().submit(prompts)
        for key, row in self.store.items():
            info = row["extra_fields"]["reward_extra_info"]
            if GRADING_ERROR_KEY in info:
                continue
            uid, session = key.split("_")[:2]
            if uid in self.failing and session == "1":
                row["extra_fields"] = {"reward_extra_info": {GRADING_ERROR_KEY: ERROR, "unparsed": 0, "judged": 0}}
            else:
                info[GRADING_ERROR_KEY] = ""
        return out


def _rows(uids_failed: dict[str, int], sessions: int = K) -> dict:
    """A batch's TransferQueue fields: ``sessions`` responses per uid, the first ``n`` of each uid failed."""
    rows = []
    for uid, n in uids_failed.items():
        for k in range(sessions):
            info = {GRADING_ERROR_KEY: ERROR} if k < n else {GRADING_ERROR_KEY: "", "reference_score": 0.1 * k}
            rows.append({"uid": uid, "response_mask": torch.ones(3, dtype=torch.int64),
                         "rm_scores": torch.tensor([0.0, 0.0, 0.2 * k]), "extra_fields": {"reward_extra_info": info},
                         SKETCH_KEY: torch.randn(5)})
    return tu.list_of_dict_to_tensordict(rows)


def test_a_group_with_a_failed_grading_is_left_out_whole_and_named():
    data = _rows({"a": 0, "b": 1, "c": K, "d": 0})
    groups = calibration_groups(data, "reference_score", k=K)
    assert groups.uids == ["a", "d"] and groups.incomplete == {}
    assert groups.grading_failed == {"b": ERROR, "c": ERROR}
    np.testing.assert_allclose(groups.reference.numpy(), [[0.0, 0.1, 0.2, 0.3]] * 2)
    np.testing.assert_allclose(groups.point.numpy(), [[0.0, 0.2, 0.4, 0.6]] * 2)


def test_a_row_without_a_score_that_did_not_fail_grading_is_still_refused():
    data = _rows({"a": 0, "b": 0})
    data["extra_fields"][0]["reward_extra_info"].pop("reference_score")
    with pytest.raises(ValueError, match=r"score 'reference_score' of reward_extra_info is missing for 1 of 8"):
        calibration_groups(data, "reference_score", k=K)


def test_failures_under_the_bound_are_counted_apart_and_the_record_is_written(tmp_path, monkeypatch, caplog):
    logged = []
    fake = _FailingRollout({"p0x3"})  # 1 of 48 groups = 2.1 %, under a bound of 5 %
    monkeypatch.setattr("setgrpo_verl.integration.trainer.SetGRPOTrainer._log_record",
                        lambda self, record, metrics=None, **extra: logged.append(metrics))
    with caplog.at_level(logging.WARNING):
        record, _ = _calibrate(tmp_path, monkeypatch, batches=3, per_batch=16, only=True, fake=fake,
                               max_grading_failure_ratio=0.05)
    assert record.n_cov + record.n_risk == 47
    paired = np.load(tmp_path / "paired_scores.npz")
    assert (int(paired["dropped_grading_failed"]), int(paired["dropped_incomplete"]),
            int(paired["dropped_no_response"])) == (1, 0, 0)
    assert read_shard(tmp_path / "shards" / "batch_000000.npz").dropped == {
        "incomplete": 0, "no_response": 0, "grading_failed": 1}
    assert logged[-1]["setgrpo/calibration/dropped_grading_failed"] == 1.0
    text = caplog.text
    assert f"batch 0: 1 group(s) left out because grading failed ({JUDGE}; first: {ERROR})" in text
    assert "1 of 48 groups left out: 0 lost some of their K responses (a failed rollout session), 0 came back with " \
           "none, 1 because grading failed" in text


def test_failures_above_the_bound_stop_calibration_naming_count_bound_key_and_judge(tmp_path, monkeypatch):
    # 48 groups at the default 0.02 allow 3 (a judge failing on 2 % exceeds 3 with probability 1.6 %); 4 are too many
    fake = _FailingRollout({"p0x3", "p1x2", "p2x0", "p2x5"})
    with pytest.raises(ValueError) as info:
        _calibrate(tmp_path, monkeypatch, batches=3, per_batch=16, only=True, fake=fake)
    message = str(info.value)
    assert "4 of 48 calibration groups (8.3%) were left out because grading failed" in message
    assert "more than the 3 that algorithm.setgrpo.calibration.max_grading_failure_ratio=0.02 allows for 48" in message
    assert f"({JUDGE})" in message and "batch_000000.npz, batch_000001.npz, batch_000002.npz" in message
    assert "not missing at random" in message
    assert not (tmp_path / "setgrpo_calibration.json").exists()  # refused before the record was written


def test_the_first_batch_that_puts_the_bound_out_of_reach_stops_calibration(tmp_path, monkeypatch):
    fake = _FailingRollout({"p0x3", "p0x5", "p0x7", "p0x9"})  # 4 failures in batch 0: more than 48 groups allow
    with pytest.raises(ValueError, match=r"4 of 48 .* in the batches so far, so the calibration cannot finish"):
        _calibrate(tmp_path, monkeypatch, batches=3, per_batch=16, only=True, fake=fake)
    assert fake.events.count("rollout") == 1  # batches 1 and 2 were never rolled out
    assert [p.name for p in (tmp_path / "shards").glob("*.npz")] == ["batch_000000.npz"]  # kept for a resume


def test_three_failures_of_48_groups_are_within_the_bound(tmp_path, monkeypatch):
    fake = _FailingRollout({"p0x3", "p2x0", "p2x5"})  # 6.2 %: a share rule would refuse, the count bound allows 3
    record, _ = _calibrate(tmp_path, monkeypatch, batches=3, per_batch=16, only=True, fake=fake)
    assert record.n_cov + record.n_risk == 45


def test_a_part_of_a_sharded_calibration_checks_its_own_share(tmp_path, monkeypatch):
    fake = _FailingRollout({"p1x0", "p1x1", "p1x2"})  # part 1 of 2 holds batch 1 only: 3 of 16 groups (1 allowed)
    with pytest.raises(ValueError, match=r"3 of 16 calibration groups \(18.8%\)"):
        _calibrate(tmp_path, monkeypatch, batches=2, per_batch=16, only=True, fake=fake, shard="1/2")


def test_a_batch_that_failed_grading_whole_stops_at_once_naming_the_judge_and_the_error(tmp_path, monkeypatch):
    fake = _FailingRollout({f"p0x{i}" for i in range(16)})
    with pytest.raises(RuntimeError) as info:
        _calibrate(tmp_path, monkeypatch, batches=3, per_batch=16, only=True, fake=fake)
    message = str(info.value)
    assert "grading failed for every one of the 16 groups of calibration batch 0" in message
    assert JUDGE in message and ERROR in message and "k_partitions" not in message
    assert fake.events.count("rollout") == 1  # stopped after the first batch
    assert not (tmp_path / "shards").exists() or not list((tmp_path / "shards").glob("*.npz"))


def test_the_allowed_count_is_a_binomial_test_meaningful_for_small_and_large_calibrations():
    from scipy.stats import binom

    from setgrpo_verl.integration.grading_failures import FAILURE_TEST_LEVEL, allowed_grading_failures

    assert [allowed_grading_failures(n, 0.02) for n in (32, 48, 100, 512, 4096)] == [2, 3, 5, 16, 97]
    assert allowed_grading_failures(32, 0.0) == 0 and allowed_grading_failures(32, 1.0) == 32
    for n in (32, 512, 4096):  # a judge failing on exactly 2 % is refused with probability at most the level
        d = allowed_grading_failures(n, 0.02)
        assert binom.sf(d, n, 0.02) <= FAILURE_TEST_LEVEL < binom.sf(d - 1, n, 0.02)
    # the smoke recipe (32 groups): a judge whose replies are cut 1 % of the time, re-asked twice, fails a group of
    # 4 responses x 2 scorings x 8 criteria with probability ~64e-6; 3 such groups of 32 almost never happen
    p_group = 1 - (1 - 0.01 ** 3) ** 64
    assert binom.sf(allowed_grading_failures(32, 0.02), 32, p_group) < 1e-8


def test_the_share_check_itself():
    check_grading_failure_share(5, 100, 0.02, JUDGE)  # at the bound: allowed
    check_grading_failure_share(0, 0, 0.0, JUDGE)
    with pytest.raises(ValueError, match=r"6 of 100 calibration groups \(6.0%\).*max_grading_failure_ratio=0.02"):
        check_grading_failure_share(6, 100, 0.02, JUDGE)
    with pytest.raises(ValueError, match="max_grading_failure_ratio=0 allows "):
        check_grading_failure_share(1, 1000, 0.0, JUDGE)


@pytest.mark.parametrize("value", [-0.1, 1.5, True, "0.1"])
def test_the_bound_is_a_share(value):
    with pytest.raises(ValueError, match=r"algorithm.setgrpo.calibration.max_grading_failure_ratio=.* must be a number"):
        SetGRPOCalibrationConfig(max_grading_failure_ratio=value)
    assert SetGRPOCalibrationConfig().max_grading_failure_ratio == 0.02


def test_shards_written_before_the_count_read_it_as_zero(tmp_path):
    shard = CalibrationShard(index=0, prompts=({"id": "a"},), point=np.zeros((1, 2)), reference=np.zeros((1, 2)),
                             gram=np.zeros((1, 2, 2)), truth=None, prompt_index=np.zeros(1, dtype=np.int64),
                             identity={"settings": {}, "K": 2}, dropped={"incomplete": 1, "no_response": 2})
    assert read_shard(write_shard(tmp_path, shard)).dropped == {"incomplete": 1, "no_response": 2, "grading_failed": 0}


def test_a_training_batch_to_which_no_response_came_back_names_the_judge(tmp_path):
    trainer = _record_trainer(tmp_path)
    with pytest.raises(RuntimeError, match=rf"every rollout session failed.*\({JUDGE}\)"):
        trainer._balance_batch(KVBatchMeta(partition_id="train", keys=[], tags=[]), {})


# --- the reward manager


def _failing_worker(tmp_path):
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    from ..grading.test_reward_manager import _config

    fn = tmp_path / "fn.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs):\n"
                  "    if 'fail' in solution_str:\n"
                  "        raise ConnectionError('judge down')\n"
                  "    return 0.5\n")
    return RewardLoopWorker(_config({"type": "function", "path": str(fn), "name": "compute_score", "seed": 0}))


def _score(worker, texts, calibration):
    from ..grading.test_reward_manager import _batch

    rows = [{"question": f"Q{i}", "id": f"r{i}", "rubrics": [{"criterion": "It answers", "points": 1}]}
            for i in range(len(texts))]
    data = _batch(worker.input_tokenizer, rows, texts)
    if calibration:
        data.non_tensor_batch[CALIBRATION_MARK] = np.array([True] * len(texts))
    return worker.loop.run_until_complete(worker.compute_score_batch(data))


def test_the_reward_manager_reports_a_calibration_grading_failure_as_a_row(tmp_path):
    from setgrpo_verl.grading import GradingError

    worker = _failing_worker(tmp_path)
    out = _score(worker, ["fine", "fail here"], calibration=True)
    assert out[0]["reward_extra_info"][GRADING_ERROR_KEY] == "" and out[0]["reward_extra_info"]["reference_score"] == 0.5
    failed = out[1]["reward_extra_info"]
    assert "ConnectionError: judge down" in failed[GRADING_ERROR_KEY] and "'r1'" in failed[GRADING_ERROR_KEY]
    assert failed["reference_score"] is None and failed["score"] is None and out[1]["reward_score"] == 0.0
    with pytest.raises(GradingError, match="judge down"):  # outside calibration the session fails, as before
        _score(worker, ["fine", "fail here"], calibration=False)


def test_a_failed_group_is_left_out_of_the_truth_as_well():
    """The noisy rules grader writes the truth beside the reference; a failed row carries neither, and the groups
    kept have the truth of exactly their rows."""
    from setgrpo_verl.integration.config import TRUTH_SCORE_KEY

    data = _rows({"a": 0, "b": 2, "c": 0})
    for row, info in enumerate(r["reward_extra_info"] for r in data["extra_fields"]):
        if not info[GRADING_ERROR_KEY]:
            info[TRUTH_SCORE_KEY] = 0.01 * row
    groups = calibration_groups(data, "reference_score", k=K)
    assert groups.uids == ["a", "c"] and groups.grading_failed == {"b": ERROR}
    np.testing.assert_allclose(groups.truth.numpy(), [[0.00, 0.01, 0.02, 0.03], [0.08, 0.09, 0.10, 0.11]])


def test_a_reward_without_a_grader_passes_the_share_check_when_nothing_failed():
    """Calibration with another reward manager (no ``reward.reward_kwargs.grader``) must not need a judge's name."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from setgrpo_verl.integration.calibration import CalibrationPhase

    phase = SimpleNamespace(config=OmegaConf.create({"reward": {"reward_manager": {"name": "naive"}}}),
                            setgrpo=SimpleNamespace(calibration=SimpleNamespace(max_grading_failure_ratio=0.02)))
    shards = {0: SimpleNamespace(dropped={"incomplete": 1, "grading_failed": 0}, prompts=["a", "b"])}
    CalibrationPhase._check_grading_share(phase, shards)  # no ValueError about a missing grader
    shards[0].dropped["grading_failed"] = 1
    with pytest.raises(ValueError, match=r"left out because grading failed \(the reward\), more than the 0"):
        CalibrationPhase._check_grading_share(phase, shards)  # a failure is refused, naming what graded


def test_messages_name_the_graders_judge_through_its_noise_or_the_reward_without_the_dual_manager():
    from omegaconf import OmegaConf

    from setgrpo_verl.integration.reward_config import grader_in_messages

    judge = {"type": "openai", "base_url": "http://judge:8000/v1", "model": "qwen"}
    dual = OmegaConf.create({"reward": {"reward_manager": {"name": "setgrpo_dual"},
                                        "reward_kwargs": {"grader": {"type": "noisy", "base": judge}}}})
    assert grader_in_messages(dual) == "judge 'qwen' at http://judge:8000/v1"
    rules = OmegaConf.create({"reward": {"reward_manager": {"name": "setgrpo_dual"},
                                         "reward_kwargs": {"grader": {"type": "rules"}}}})
    assert grader_in_messages(rules) == "the 'rules' grader"
    naive = OmegaConf.create({"reward": {"reward_manager": {"name": "naive"}}})
    assert grader_in_messages(naive) == "the reward"


def test_a_part_of_a_sharded_calibration_with_no_batch_is_refused_at_run_time():
    """The calibration files may hold fewer rows than calibration.num_prompts (which the pre-Ray check counts):
    a part that then holds no batch stops, naming the key and how many parts the batches allow."""
    from types import SimpleNamespace

    from setgrpo_verl.integration.calibration import CalibrationPhase

    phase = SimpleNamespace(setgrpo=SimpleNamespace(calibration=SetGRPOCalibrationConfig(shard="3/4", only=True)))
    assert CalibrationPhase._calibration_part(phase, 4) == (3, 4)
    with pytest.raises(ValueError, match=r"calibration.shard=3/4: part 3 holds no batch, since the calibration "
                                         r"prompts make 3 batch\(es\): split it into at most 3 parts"):
        CalibrationPhase._calibration_part(phase, 3)



# ------------------------------------------------------------------ training: failed sessions per step
URL = "http://127.0.0.1:9/v1"  # nothing listens on the discard port: every request is refused at once


def _train_config(**setgrpo):
    from omegaconf import OmegaConf

    grader = {"type": "openai", "base_url": URL, "model": "judge", "max_retries": 0}
    return OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": 4}},
                             "reward": {"reward_manager": {"name": "setgrpo_dual"},
                                        "reward_kwargs": {"grader": grader}},
                             "algorithm": {"setgrpo": setgrpo} if setgrpo else {}})


def test_a_steps_failed_responses_and_groups_are_counted_and_bounded():
    from setgrpo_verl.integration.grading_failures import (FAILED_GROUPS_METRIC, FAILED_RESPONSES_METRIC,
                                                           check_step_failures, step_failures)

    # 10 prompts x K=4, keys as verl's agent loop writes them ("<uid>_<session>_<trajectory>"): a lost one
    # response, b two, u0..u4 came back whole, 3 groups sent nothing back
    keys = ["a_0_0", "a_1_0", "a_2_0", "b_0_0", "b_1_0"] + [f"u{g}_{i}_0" for g in range(5) for i in range(4)]
    tags = [{}] * len(keys)
    assert step_failures(keys + ["u0_0_0"], tags + [{"is_padding": True}], 10, 4) == (15, 5)
    # a session of several trajectories (a multi-turn agent loop) is one response
    assert step_failures([f"u_{i}_{t}" for i in range(4) for t in range(3)], [{}] * 12, 1, 4) == (0, 0)
    assert check_step_failures(_train_config(max_failed_group_ratio=0.5), keys, tags, 10) == {
        FAILED_RESPONSES_METRIC: 15.0, FAILED_GROUPS_METRIC: 5.0}
    with pytest.raises(RuntimeError) as info:  # the default 0.1 (also without an algorithm.setgrpo block)
        check_step_failures(_train_config(), keys, tags, 10)
    message = str(info.value)
    assert "5 of the step's 10 groups (50.0%) lost a response" in message and "(15 responses)" in message
    assert f"judge 'judge' at {URL}" in message and "algorithm.setgrpo.max_failed_group_ratio=0.1" in message


def test_a_step_with_no_graded_group_stops_naming_the_judge_its_url_and_its_error():
    from setgrpo_verl.integration.grading_failures import NO_TRAJECTORIES
    from setgrpo_verl.integration.sync_mode import SyncMode

    class Verl:
        def _step_once(self, metrics, timing_raw, sample_batch_size):  # verl 0.9.1's replay buffer, all failed
            raise RuntimeError(f"{NO_TRAJECTORIES}. Enable trainer.v1.sampler.sync_refill_failed_groups to replace "
                               "failed groups.")

    class Trainer(SyncMode, Verl):
        registered_mode = "setgrpo"

    trainer = object.__new__(Trainer)
    trainer.config = _train_config()
    with pytest.raises(RuntimeError) as info:
        trainer._step_once({}, {}, 8)
    message = str(info.value)
    assert "no group of this step has a graded response" in message and f"judge 'judge' at {URL}" in message
    assert "a probe request fails" in message and "could not be reached" in message
    assert "sync_refill_failed_groups would only spend more training prompts" in message
    assert trainer._step_prompts is None
