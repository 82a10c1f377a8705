"""The SetGRPO step on the trainer's path and as verl's registered ``setgrpo`` estimator, against verl's own GRPO
estimator and advantage wrapper."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import uuid

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

import verl  # noqa: F401  (loads the plugin, as in every verl process)
from verl.protocol import DataProto
from verl.trainer.ppo import ray_trainer
from verl.trainer.ppo.core_algos import AdvantageEstimator, compute_grpo_outcome_advantage, get_adv_estimator_fn
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1 import utils as v1_utils

from setgrpo_verl.core import CalibrationSettings, OnlineRiskMonitor, calibrate, setgrpo_coefficients
from setgrpo_verl.integration.batch import reference_scores_from
from setgrpo_verl.integration.calibration import calibration_groups
from setgrpo_verl.integration.config import TRAINER_MODE_OVERRIDE
from setgrpo_verl.integration.estimator import compute_setgrpo_outcome_advantage, setgrpo_step
from setgrpo_verl.integration.groups import complete_group_rows, rows_to_sketch
from setgrpo_verl.integration.trainer import compute_setgrpo_advantage

K = 4
M_SKETCH = 6


def _record(seed: int = 0, norm_by_std: bool = True, metadata: dict | None = None, **settings):
    """A real record from `calibrate` on exchangeable synthetic groups with sketch-like Gram matrices."""
    g = torch.Generator().manual_seed(seed)
    n = 160
    mu = torch.rand(n, K, generator=g, dtype=torch.float64)
    point = mu + 0.1 * torch.randn(n, K, generator=g, dtype=torch.float64)
    ref = mu + 0.1 * torch.randn(n, K, generator=g, dtype=torch.float64)
    s = torch.randn(n, K, M_SKETCH, generator=g, dtype=torch.float64) + 0.7 * torch.randn(n, 1, M_SKETCH, generator=g, dtype=torch.float64)
    return calibrate(point, ref, s @ s.transpose(1, 2), CalibrationSettings(
        alpha=0.1, beta=0.3, delta=0.1, norm_by_std=norm_by_std, on_infeasible="reject_all", **settings),
        metadata=metadata)


def _batch(n_groups: int = 6, seed: int = 1, t_max: int = 7, padding_rows: int = 2):
    """A shuffled verl-style batch: n_groups groups of K responses, uneven lengths, group 0 degenerate, padding rows.

    Returns (token_level_rewards [B,T] f32, response_mask [B,T] i64, uids [B] object, sketches [B,m] f32,
    scores [B] f32, reference [B] f64).
    """
    g = torch.Generator().manual_seed(seed)
    uids = [str(uuid.UUID(int=i + 1)) for i in range(n_groups) for _ in range(K)]
    scores = torch.rand(n_groups * K, generator=g)
    scores[:K] = 0.5  # degenerate group: zero spread
    lengths = torch.randint(1, t_max + 1, (n_groups * K,), generator=g)
    # verl's synthetic padding rows (padding_utils): own uid, empty response mask, zero reward
    uids += ["pad" + uuid.uuid4().hex] * padding_rows
    scores = torch.cat([scores, torch.zeros(padding_rows)])
    lengths = torch.cat([lengths, torch.zeros(padding_rows, dtype=torch.long)])
    b = len(uids)
    mask = (torch.arange(t_max)[None, :] < lengths[:, None]).long()
    rewards = torch.zeros(b, t_max)
    rows = torch.nonzero(lengths > 0).squeeze(1)
    rewards[rows, lengths[rows] - 1] = scores[rows]  # outcome reward on the last response token (verl)
    sketches = torch.randn(b, M_SKETCH, generator=g)
    reference = scores.double() + 0.05 * torch.randn(b, generator=g, dtype=torch.float64)
    perm = torch.randperm(b, generator=g)  # _balance_batch reorders rows: groups are not contiguous
    return (rewards[perm], mask[perm], np.array(uids, dtype=object)[perm.numpy()], sketches[perm], scores[perm],
            reference[perm])


def _core_reference(uids, scores, sketches, mask, record):
    """The core library's coefficients for the same groups, scattered to rows by hand."""
    order = {}
    for i, u in enumerate(uids):
        if mask[i].any() or u in order:
            order.setdefault(u, []).append(i)
    groups = torch.tensor([r for r in order.values()])
    s = sketches.double()[groups]
    result = setgrpo_coefficients(scores.double()[groups], s @ s.transpose(1, 2), record)
    coef = torch.zeros(len(uids), dtype=torch.float64)
    coef[groups.reshape(-1)] = result.coefficients.reshape(-1)
    return coef, result


def _data(rewards, mask, uids):
    return DataProto(
        batch=TensorDict({"token_level_rewards": rewards, "response_mask": mask}, batch_size=[rewards.shape[0]]),
        non_tensor_batch={"uid": uids},
    )


def test_registered_in_verl():
    assert get_adv_estimator_fn("setgrpo") is compute_setgrpo_outcome_advantage


def test_trainer_path_equals_core_library():
    record = _record()
    assert record.tau_sel is not None and record.q_alpha > 0
    rewards, mask, uids, sketches, scores, _ = _batch()
    data = _data(rewards, mask, uids)
    step = compute_setgrpo_advantage(data, sketches, record)
    coef, result = _core_reference(uids, scores, sketches, mask, record)
    expected = coef.float()[:, None] * mask.float()
    torch.testing.assert_close(data.batch["advantages"], expected, rtol=0, atol=1e-6)
    assert data.batch["returns"] is data.batch["advantages"]  # as verl's outcome estimators answer
    # uneven lengths: zero exactly outside each response, padding rows all zero
    assert bool((data.batch["advantages"][mask == 0] == 0).all())
    assert step.result.status == result.status and result.status.count("degenerate") == 1
    # the set-valued rule really changed something relative to GRPO on these noisy groups
    assert not torch.allclose(result.coefficients, result.grpo)


@pytest.mark.parametrize("norm_by_std", [True, False])  # GRPO and Dr. GRPO
def test_radius_zero_equals_verl_grpo(norm_by_std):
    """With q_alpha = 0 the SetGRPO coefficients are GRPO's: the trainer's batch equals what verl's
    compute_advantage writes for adv_estimator=grpo (compute_grpo_outcome_advantage), and the registered estimator
    answers as compute_grpo_outcome_advantage on the same batch."""
    record = dataclasses.replace(_record(norm_by_std=norm_by_std), q_alpha=0.0)
    rewards, mask, uids, sketches, _, _ = _batch(n_groups=8, seed=3)
    ours = _data(rewards, mask, uids)
    compute_setgrpo_advantage(ours, sketches, record)
    grpo = compute_advantage(_data(rewards.clone(), mask, uids), adv_estimator=AdvantageEstimator.GRPO,
                             norm_adv_by_std_in_grpo=norm_by_std)
    for key in ("advantages", "returns"):
        torch.testing.assert_close(ours.batch[key], grpo.batch[key], rtol=1e-5, atol=1e-6)
    assert bool((grpo.batch["advantages"][mask.bool()] != 0).any())  # the comparison is not between zeros

    advantages, returns = get_adv_estimator_fn("setgrpo")(rewards, mask, index=uids, sketches=sketches, record=record)
    expected, _ = compute_grpo_outcome_advantage(rewards.clone(), mask, uids, norm_adv_by_std_in_grpo=norm_by_std)
    torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-6)
    assert returns is advantages


def test_registered_estimator_forwards_its_step_arguments():
    record = _record(ablation="random_discard")
    rewards, mask, uids, sketches, _, _ = _batch(n_groups=10, seed=5)
    rows = rows_to_sketch(uids, mask, rewards, K, record.degenerate_rtol)
    skipped = sketches.clone()
    skipped[~rows] = float("nan")  # read without ``sketched``: refused
    advantages, _ = compute_setgrpo_outcome_advantage(rewards, mask, uids, sketches=skipped, record=record,
                                                      sketched=rows, ablation="random_discard", seed=3)
    step = setgrpo_step(rewards, mask, uids, sketches, record, ablation="random_discard", seed=3)
    torch.testing.assert_close(advantages, step.advantages, rtol=0, atol=0)
    assert step.result.status.count("discarded") == 1
    other = setgrpo_step(rewards, mask, uids, sketches, record, seed=4)
    assert not torch.equal(advantages, other.advantages)  # the seed reached the step


def test_without_trainer_mode_names_the_override():
    """verl's own trainers reach the registered estimator through compute_advantage, which passes no sketches and
    no record: the error names the trainer mode."""
    rewards, mask, uids, sketches, _, _ = _batch()
    algorithm = OmegaConf.create({"adv_estimator": "setgrpo", "norm_adv_by_std_in_grpo": True, "gamma": 1.0})
    override = TRAINER_MODE_OVERRIDE.replace(".", r"\.")
    with pytest.raises(RuntimeError, match=override):
        compute_advantage(_data(rewards, mask, uids), adv_estimator="setgrpo", config=algorithm)
    with pytest.raises(RuntimeError, match=override):
        compute_setgrpo_outcome_advantage(rewards, mask, uids, config=algorithm, sketches=sketches)
    with pytest.raises(ValueError, match="uid"):
        compute_setgrpo_outcome_advantage(rewards, mask, None, sketches=sketches, record=_record())


#: sha256 of verl 0.9.1's ``PPOTrainer._compute_advantage`` (v1 trainer_base), which the trainer's
#: ``_compute_advantage`` copies; of ``v1.utils.compute_advantage_for_multi_trajectories``, which hands estimators
#: other than GRPO to ``ray_trainer.compute_advantage``; and of that wrapper, whose handling of a registered estimator
#: ``compute_setgrpo_advantage`` reproduces.
VERL_ADVANTAGE_SHA256 = {
    "_compute_advantage": "2a4a2aa4a475b228d401959818e0b9019276ce27961c133961de217baa387da7",
    "compute_advantage_for_multi_trajectories": "d973cc8aec79bc3d6c5482e3946d158639c27c209fb12b049b71c502d95b0a03",
    "compute_advantage": "314695381c755264971a8f25865625bad4cf46c35d91901ba2a8f5e1ea980a18",
}


def test_the_copied_advantage_step_of_verl_is_unchanged():
    functions = (trainer_base.PPOTrainer._compute_advantage, v1_utils.compute_advantage_for_multi_trajectories,
                 ray_trainer.compute_advantage)
    sources = {f.__name__: inspect.getsource(f) for f in functions}
    assert "if adv_estimator != core_algos.AdvantageEstimator.GRPO:" in sources[functions[1].__name__]
    assert 'data.batch["returns"] = returns' in sources["compute_advantage"]
    found = {name: hashlib.sha256(source.encode()).hexdigest() for name, source in sources.items()}
    assert found == VERL_ADVANTAGE_SHA256, (
        "verl's advantage step changed: re-check setgrpo_verl.integration.trainer.SetGRPOTrainer._compute_advantage "
        "and compute_setgrpo_advantage against it"
    )


def test_trainer_path_with_monitor():
    record = _record()
    rewards, mask, uids, sketches, scores, reference = _batch(n_groups=10, seed=5)
    monitor = OnlineRiskMonitor(record)
    data = _data(rewards, mask, uids)
    step = compute_setgrpo_advantage(data, sketches, record, reference_scores=reference, monitor=monitor)
    coef, result = _core_reference(uids, scores, sketches, mask, record)
    torch.testing.assert_close(step.coefficients, coef, rtol=0, atol=1e-12)
    torch.testing.assert_close(data.batch["advantages"], coef.float()[:, None] * mask.float(), rtol=0, atol=1e-6)
    # every section-6 diagnostic reaches the tracker as a float
    for name in ("accepted_ratio", "rejected_ratio/infeasible", "rejected_ratio/null_anchor", "degenerate_ratio",
                 "recovery_ratio/mean", "m_full/mean_all", "m_reward/mean_all", "coefficient_norm/mean",
                 "anchor_kkt_residual/max", "timing_s/geometry", "timing_s/recovery", "timing_s/gram",
                 "online_coverage", "online_reversal_ucb"):
        assert isinstance(step.metrics[f"setgrpo/{name}"], float), name
    assert step.metrics["setgrpo/degenerate_ratio"] == pytest.approx(1 / 10)
    assert step.metrics["setgrpo/accepted_ratio"] == pytest.approx(float(result.accepted.double().mean()))
    assert monitor.seen == 9  # the 9 non-degenerate groups were monitored


def test_incomplete_group_is_rejected_as_grpo_carries_on():
    """verl's agent loop keeps a group one of whose sessions failed (K - 1 responses): verl's GRPO trains on it, the
    SetGRPO step rejects it (zero advantages, setgrpo/incomplete_ratio) and computes the other groups exactly as
    without it."""
    rewards, mask, uids, sketches, scores, _ = _batch()
    record = _record()
    lost_uid = str(uuid.UUID(int=2))  # group 1 (group 0 is the degenerate one)
    lost_row = next(i for i, u in enumerate(uids) if u == lost_uid)
    keep = np.array([i for i in range(len(uids)) if i != lost_row])
    out = _data(rewards[keep], mask[keep], uids[keep])
    step = compute_setgrpo_advantage(out, sketches[keep], record)
    rows = uids[keep] == lost_uid
    assert rows.sum() == K - 1 and bool((out.batch["advantages"][torch.from_numpy(rows)] == 0).all())
    assert step.metrics["setgrpo/incomplete_ratio"] == pytest.approx(1 / 6)
    assert step.groups.shape == (5, K) and lost_uid not in {uids[keep][int(r)] for r in step.groups[:, 0]}
    # the complete groups: the core library's coefficients for them alone
    rest = keep[~rows]
    coef, _ = _core_reference(uids[rest], scores[rest], sketches[rest], mask[rest], record)
    torch.testing.assert_close(out.batch["advantages"][torch.from_numpy(~rows)],
                               coef.float()[:, None] * mask[rest].float(), rtol=0, atol=1e-6)
    grpo = compute_advantage(_data(rewards[keep].clone(), mask[keep], uids[keep]),
                             adv_estimator=AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=True)
    assert bool((grpo.batch["advantages"][torch.from_numpy(rows)] != 0).any())  # GRPO uses the K - 1 responses
    # no complete group at all: an error naming K, not a step that silently trains nothing
    only_lost = np.array([i for i in keep if uids[i] == lost_uid])
    with pytest.raises(ValueError, match=f"every group of the batch holds fewer than the calibration record's K={K}"):
        setgrpo_step(rewards[only_lost], mask[only_lost], uids[only_lost], sketches[only_lost], record)


def test_group_size_must_match_record():
    record = dataclasses.replace(_record(), K=3)
    rewards, mask, uids, sketches, _, _ = _batch()
    with pytest.raises(ValueError, match=r"more than K=3 responses.*set actor_rollout_ref.rollout.n=3"):
        setgrpo_step(rewards, mask, uids, sketches, record)


def test_group_rows_order_padding_and_incomplete_groups():
    mask = torch.tensor([[1, 0], [1, 1], [0, 0], [1, 0], [1, 1], [0, 0], [1, 1]])
    groups, uids, incomplete = complete_group_rows(["b", "a", "p", "b", "a", "p", "c"], mask, 2)
    assert uids == ["b", "a"] and incomplete == {"c": 1}
    assert groups.tolist() == [[0, 3], [1, 4]]
    with pytest.raises(ValueError, match="all rows are padding"):
        complete_group_rows(["p", "p"], torch.zeros(2, 2), 2)


def test_non_finite_sketch_is_an_error():
    rewards, mask, uids, sketches, _, _ = _batch()
    sketches[3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        setgrpo_step(rewards, mask, uids, sketches, _record())


def test_reference_scores_from_reward_extra_info():
    extra = np.array([{"reward_extra_info": {"reference_score": 0.25 * i}} for i in range(4)], dtype=object)
    torch.testing.assert_close(reference_scores_from({"extra_fields": extra}, "reference_score"),
                               torch.tensor([0.0, 0.25, 0.5, 0.75], dtype=torch.float64))
    assert reference_scores_from({"extra_fields": np.array([{}, {}], dtype=object)}, "reference_score") is None
    extra[2] = {"reward_extra_info": {}}
    with pytest.raises(ValueError, match="missing for 1 of 4"):
        reference_scores_from({"extra_fields": extra}, "reference_score")


def test_calibration_groups_carry_the_truth_when_the_grader_has_one():
    """``truth_score`` of the noisy grader (docs/validation.md#noisy-grader) is grouped like the reference scores."""
    from setgrpo_verl.integration.worker import SKETCH_KEY

    uids = ["b", "a", "b", "a"]  # two groups of two, interleaved
    extra = np.array([{"reward_extra_info": {"reference_score": 0.1 * i, "truth_score": float(i % 2)}}
                      for i in range(4)], dtype=object)
    data = {"uid": uids, "response_mask": torch.ones(4, 3, dtype=torch.long),
            "rm_scores": torch.tensor([[0, 0, 1.0], [0, 0, 0.0], [0, 0, 0.5], [0, 0, 0.25]]),
            "extra_fields": extra, SKETCH_KEY: torch.arange(8, dtype=torch.float32).reshape(4, 2)}
    out = calibration_groups(data, "reference_score", k=2)
    torch.testing.assert_close(out.point, torch.tensor([[1.0, 0.5], [0.0, 0.25]], dtype=torch.float64))
    torch.testing.assert_close(out.reference, torch.tensor([[0.0, 0.2], [0.1, 0.3]], dtype=torch.float64))
    torch.testing.assert_close(out.truth, torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64))
    assert out.gram.shape == (2, 2, 2)
    for e in extra:
        del e["reward_extra_info"]["truth_score"]
    assert calibration_groups(data, "reference_score", k=2).truth is None
    extra[1]["reward_extra_info"]["truth_score"] = 1.0
    with pytest.raises(ValueError, match="'truth_score' of reward_extra_info is missing for 3 of 4"):
        calibration_groups(data, "reference_score", k=2)


def test_calibration_groups_carry_the_truth_verdicts_by_group():
    """``truth_verdicts`` of the dual-reward manager become int8 [G, K, J] (-1 past a rubric's criteria) and the
    criteria points float64 [G, J], grouped like the scores (docs/record.md#calibration-shards)."""
    import json

    from setgrpo_verl.integration.worker import SKETCH_KEY

    uids = ["b", "a", "b", "a"]
    rows = [{"met": [1, 0], "points": [2.0, -1.0]}, {"met": [0], "points": [3.0]},
            {"met": [0, 1], "points": [2.0, -1.0]}, {"met": [1], "points": [3.0]}]
    extra = np.array([{"reward_extra_info": {"reference_score": 0.0, "truth_score": 0.0,
                                             "truth_verdicts": json.dumps(r)}} for r in rows], dtype=object)
    data = {"uid": uids, "response_mask": torch.ones(4, 3, dtype=torch.long), "rm_scores": torch.zeros(4, 3),
            "extra_fields": extra, SKETCH_KEY: torch.arange(8, dtype=torch.float32).reshape(4, 2)}
    out = calibration_groups(data, "reference_score", k=2)
    assert out.truth_verdicts.dtype == np.int8 and out.criterion_points.dtype == np.float64
    np.testing.assert_array_equal(out.truth_verdicts, [[[1, 0], [0, 1]], [[0, -1], [1, -1]]])
    np.testing.assert_array_equal(out.criterion_points, [[2.0, -1.0], [3.0, 0.0]])
    extra[2]["reward_extra_info"]["truth_verdicts"] = json.dumps({"met": [0, 1], "points": [2.0, 1.0]})
    with pytest.raises(ValueError, match="responses 0 and 2 of one calibration group carry the criteria points"):
        calibration_groups(data, "reference_score", k=2)
    extra[2]["reward_extra_info"]["truth_verdicts"] = json.dumps({"met": [2, 1], "points": [2.0, -1.0]})
    with pytest.raises(ValueError, match="of response 2 is"):
        calibration_groups(data, "reference_score", k=2)
    for e in extra:
        del e["reward_extra_info"]["truth_verdicts"]
    out = calibration_groups(data, "reference_score", k=2)
    assert out.truth_verdicts is None and out.criterion_points is None


def test_degenerate_groups_are_not_sketched_and_their_sketch_rows_are_never_read():
    """rows_to_sketch marks the rows of complete, non-degenerate groups only; with NaN sketch rows elsewhere, the
    step equals the one with every row sketched (the monitor too), and a group that can update but was not
    sketched is refused."""
    record = _record()
    rewards, mask, uids, sketches, scores, reference = _batch(n_groups=10, seed=5)
    rows = rows_to_sketch(uids, mask, rewards, K, record.degenerate_rtol)
    degenerate_uid = str(uuid.UUID(int=1))
    assert rows.tolist() == [u != degenerate_uid and bool(m.any()) for u, m in zip(uids, mask)]
    skipped = sketches.clone()
    skipped[~rows] = float("nan")
    monitors = OnlineRiskMonitor(record), OnlineRiskMonitor(record)
    full = setgrpo_step(rewards, mask, uids, sketches, record, reference_scores=reference, monitor=monitors[0])
    part = setgrpo_step(rewards, mask, uids, skipped, record, reference_scores=reference, monitor=monitors[1],
                        sketched=rows)
    torch.testing.assert_close(part.coefficients, full.coefficients, rtol=0, atol=0)
    assert part.metrics == {**full.metrics, **{k: part.metrics[k] for k in part.metrics if "timing_s" in k}}
    live = [s != "degenerate" for s in part.result.status]
    torch.testing.assert_close(part.gram[live], full.gram[live], rtol=0, atol=0)
    assert not part.gram[[not x for x in live]].any()
    with pytest.raises(ValueError, match="NaN"):  # without the mask the NaN rows are read and refused
        setgrpo_step(rewards, mask, uids, skipped, record)
    lost = rows.clone()
    lost[rows.nonzero()[:K].squeeze(1)] = False  # the rows of live groups: refused whole or in part
    with pytest.raises(ValueError, match="sketched"):
        setgrpo_step(rewards, mask, uids, skipped, record, sketched=lost)


def test_calibration_reads_no_sketch_of_a_degenerate_group():
    """With the row mask, a degenerate calibration group's NaN sketch rows are not read (zero Gram matrix) and the
    other group's Gram matrix is unchanged; an unsketched group that is not degenerate is refused."""
    from setgrpo_verl.integration.worker import SKETCH_KEY, SKETCH_ROWS_KEY

    uids = ["b", "a", "b", "a"]
    extra = np.array([{"reward_extra_info": {"reference_score": 0.1 * i}} for i in range(4)], dtype=object)
    scores = torch.tensor([[0, 0, 1.0], [0, 0, 0.5], [0, 0, 0.25], [0, 0, 0.5]])  # group "a" is tied
    sketches = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    data = {"uid": uids, "response_mask": torch.ones(4, 3, dtype=torch.long), "rm_scores": scores,
            "extra_fields": extra, SKETCH_KEY: sketches}
    full = calibration_groups(data, "reference_score", k=2)
    rows = rows_to_sketch(uids, data["response_mask"], scores, 2)
    assert rows.tolist() == [True, False, True, False]
    skipped = sketches.clone()
    skipped[~rows] = float("nan")
    part = calibration_groups({**data, SKETCH_KEY: skipped, SKETCH_ROWS_KEY: rows}, "reference_score", k=2)
    torch.testing.assert_close(part.gram[0], full.gram[0], rtol=0, atol=0)
    assert not part.gram[1].any()
    with pytest.raises(ValueError, match="not degenerate but were not sketched"):
        calibration_groups({**data, SKETCH_KEY: skipped, SKETCH_ROWS_KEY: torch.zeros(4, dtype=torch.bool)},
                           "reference_score", k=2)


@pytest.mark.parametrize("use_kl_in_reward", [False, True])
def test_the_sketch_pass_skips_tied_groups_unless_the_reward_takes_a_kl_penalty(monkeypatch, use_kl_in_reward):
    """The trainer's row mask: a group tied on rm_scores is not sketched, except with algorithm.use_kl_in_reward,
    where the step's point scores (rm_scores minus the KL penalty) are not known at the sketch pass and every row
    is sketched."""
    from types import SimpleNamespace

    from setgrpo_verl.integration import trainer as trainer_module
    from setgrpo_verl.integration.trainer import SetGRPOTrainer
    from setgrpo_verl.integration.worker import SKETCH_ROWS_KEY
    from setgrpo_verl.sketch import SketchConfig

    scores = torch.tensor([[0, 1.0], [0, 0.5], [0, 0.5], [0, 0.5]])  # group "b" (rows 1 and 3) is tied
    stored = {"uid": ["a", "b", "a", "b"], "response_mask": torch.ones(4, 2, dtype=torch.long), "rm_scores": scores}
    put = {}
    monkeypatch.setattr(trainer_module.tq, "kv_batch_get", lambda **kw: {k: stored[k] for k in kw["select_fields"]})
    monkeypatch.setattr(trainer_module.tq, "kv_batch_put", lambda **kw: put.update(kw["fields"].items()))
    config = OmegaConf.create({"algorithm": {"use_kl_in_reward": use_kl_in_reward},
                               "actor_rollout_ref": {"rollout": {"n": 2, "temperature": 1.0}}})

    class Batch(SimpleNamespace):  # a KVBatchMeta of 4 rows
        def __len__(self):
            return 4

    batch = Batch(keys=list(range(4)), partition_id="train", fields=["rm_scores"], extra_info={})
    workers = SimpleNamespace(compute_sketches=lambda b: [None] * 4)
    fake = SimpleNamespace(config=config, record=_record(), sketch_config=SketchConfig(), actor_rollout_wg=workers,
                           setgrpo=SimpleNamespace(sketch=SimpleNamespace(max_token_len_per_gpu=None,
                                                                          micro_batch_size_per_gpu=None)))
    SetGRPOTrainer._compute_sketches(fake, batch)
    expected = [True] * 4 if use_kl_in_reward else [True, False, True, False]
    assert put[SKETCH_ROWS_KEY].tolist() == expected
    assert SKETCH_ROWS_KEY in batch.fields and batch.extra_info == {}
    # fields None selects every field (the streaming reward loop's batches): it stays None, so that the workers
    # still read input_ids and the rest, the mask included
    every = Batch(keys=list(range(4)), partition_id="train", fields=None, extra_info={})
    SetGRPOTrainer._compute_sketches(fake, every)
    assert every.fields is None


def test_graded_sync_trainer_logs_the_grading_metrics_then_runs_verls_advantage_step(monkeypatch):
    """The GRPO baseline's trainer mode: verl's sync trainer, registered under graded_sync, whose advantage step
    first logs the batch's grader calls (responses x scorings, padding left out) and unparsed ratio."""
    from types import SimpleNamespace

    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls

    from setgrpo_verl.integration import trainer as trainer_module
    from setgrpo_verl.integration.reward_manager import CALLS_METRIC, UNPARSED_RATIO_METRIC
    from setgrpo_verl.integration.sync_mode import GradedSyncTrainer

    assert get_trainer_cls("graded_sync") is GradedSyncTrainer and issubclass(GradedSyncTrainer, PPOTrainerSync)
    info = {"unparsed": 0, "judged": 2, "scorings": 1}
    stored = {"extra_fields": [{"reward_extra_info": info}] * 5}
    monkeypatch.setattr(trainer_module.tq, "kv_batch_get", lambda **kw: {k: stored[k] for k in kw["select_fields"]})
    verl_steps = []
    monkeypatch.setattr(PPOTrainerSync, "_compute_advantage", lambda self, batch, metrics: verl_steps.append(batch)
                        or batch)
    batch = SimpleNamespace(keys=list(range(5)), partition_id="train", fields=None,
                            tags=[{}] * 4 + [{"is_padding": True}])
    trainer = GradedSyncTrainer.__new__(GradedSyncTrainer)
    trainer.trainer_mode = "graded_sync"
    metrics = {}
    assert trainer._compute_advantage(batch, metrics) is batch and verl_steps == [batch]
    assert metrics == {CALLS_METRIC: 4.0, UNPARSED_RATIO_METRIC: 0.0}
    assert trainer.trainer_mode == "sync"  # what verl's base class branches on
    with pytest.raises(ValueError, match="GradedSyncTrainer needs trainer.v1.trainer_mode=graded_sync, got 'sync'"):
        trainer.trainer_mode = "sync"


def test_reliability_step_is_the_core_weighting_of_the_mean_scattered_to_rows():
    """The reliability variant on the trainer's path: the core library's coefficients on the grouped rows, zero on
    padding rows and outside each response; with the reference equal to the point, verl's GRPO."""
    from setgrpo_verl.core import reliability_coefficients
    from setgrpo_verl.integration.estimator import reliability_step

    rewards, mask, uids, _, scores, reference = _batch()
    step = reliability_step(rewards, mask, uids, reference, K)
    groups, _, _ = complete_group_rows(uids, mask, K)
    expected = torch.zeros(len(uids), dtype=torch.float64)
    expected[groups.reshape(-1)] = reliability_coefficients(scores.double()[groups], reference[groups]).reshape(-1)
    torch.testing.assert_close(step.advantages, expected.float()[:, None] * mask.float(), rtol=0, atol=1e-6)
    # degeneracy is judged on the mean of the scorings: group 0's point is constant, its reference is not
    assert step.metrics["setgrpo/degenerate_ratio"] == 0
    assert 0 < step.metrics["setgrpo/reliability/noise_var"] < 0.01  # reference noise sd 0.05: 0.05^2 / 2
    assert 0 < step.metrics["setgrpo/reliability/weight_mean"] <= 1
    # a grader without noise: verl's GRPO on the point scores, every non-degenerate group trained
    same = reliability_step(rewards, mask, uids, scores.double(), K)
    grpo = compute_advantage(_data(rewards.clone(), mask, uids), adv_estimator=AdvantageEstimator.GRPO,
                             norm_adv_by_std_in_grpo=True)
    real = torch.from_numpy(np.array([not u.startswith("pad") for u in uids]))
    torch.testing.assert_close(same.advantages[real], grpo.batch["advantages"][real], rtol=1e-5, atol=1e-5)
    assert same.metrics["setgrpo/accepted_ratio"] == pytest.approx(5 / 6)
    assert same.metrics["setgrpo/degenerate_ratio"] == pytest.approx(1 / 6)
    with pytest.raises(ValueError, match="reference_scores have 3 entries"):
        reliability_step(rewards, mask, uids, reference[:3], K)
