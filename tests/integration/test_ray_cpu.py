"""On a local Ray CPU cluster: the sketch RPC on a verl worker group, and the trainer's TransferQueue glue."""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import cloudpickle
import pytest
import ray
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils import tensordict_utils as tu

from setgrpo_verl.core import OnlineRiskMonitor
from setgrpo_verl.integration.config import setgrpo_config_from
from setgrpo_verl.integration.estimator import setgrpo_step
from setgrpo_verl.integration.calibration import calibration_groups
from setgrpo_verl.integration.trainer import SetGRPOTrainer
from setgrpo_verl.integration.worker import SKETCH_CONFIG_KEY, SKETCH_KEY, SetGRPOActorRolloutRefWorker
from setgrpo_verl.sketch import SketchConfig, compute_sketches

from . import _engine
from ._engine import BareEngine, nested_batch, padded_layout
from .test_estimator import K, _record

SKETCH = SketchConfig(rank_out=3, rank_in=2, seed=7)


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


class TinySketchWorker(SetGRPOActorRolloutRefWorker):
    """Our worker class with a tiny CPU model in place of verl's GPU engine; the RPC itself is untouched."""

    def __init__(self, use_dynamic_bsz: bool):
        Worker.__init__(self)
        self.config = OmegaConf.create({"actor": {"loss_agg_mode": "token-mean"}})
        self.actor = None
        self._use_dynamic_bsz = use_dynamic_bsz

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        _engine.use_cpu_platform()  # what VERL_PLATFORM=cpu selects in a CPU run
        engine_config = SimpleNamespace(use_dynamic_bsz=self._use_dynamic_bsz, infer_max_token_len_per_gpu=24,
                                        infer_micro_batch_size_per_gpu=2, use_fused_kernels=False)
        self.actor = SimpleNamespace(engine=BareEngine(_tiny_model()), model_config={"use_remove_padding": True},
                                     engine_config=engine_config)
        self._register_dispatch_collect_info("actor", dp_rank=self.rank, is_collect=True)


def _batch(b: int = 8) -> TensorDict:
    """verl v1 layout: nested prompts / responses / input_ids / position_ids / response_mask of uneven lengths."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 50, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g) for _ in range(b)]
    responses = [torch.randint(1, 50, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g) for _ in range(b)]
    masks = [torch.ones_like(r) for r in responses]
    masks[1][-1] = 0  # a masked-out (e.g. tool) token inside a response
    td = nested_batch(prompts, responses, masks)
    tu.assign_non_tensor(td, temperature=1.0)
    tu.assign_non_tensor(td, **{SKETCH_CONFIG_KEY: dataclasses.asdict(SKETCH)})
    return td


@pytest.fixture(scope="module")
def ray_cluster():
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests package
    cloudpickle.register_pickle_by_value(_engine)
    # logical CPUs: the worker group's placement group and TransferQueue's actors each reserve some
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sketch_rpc_on_ray_cpu_worker_group(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(TinySketchWorker), use_dynamic_bsz=True),
                        device_name="cpu")
    wg.init_model()
    # the driver's reference: the same hook on the whole batch, in batch order
    ids, am, rm = padded_layout(_batch())
    reference = compute_sketches(_tiny_model(), ids, am, rm, SKETCH)
    expected = reference.sketches
    assert torch.cdist(expected, expected).fill_diagonal_(1.0).min() > 1e-3  # distinct rows: a permutation shows
    fixed = _batch()  # the engine's fixed micro-batch path, chosen per call like verl's infer_batch keys
    tu.assign_non_tensor(fixed, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    for data in (_batch(), fixed):  # dynamic (token-budget, reordered) micro-batches, then fixed ones
        sketches = wg.compute_sketches(data)[SKETCH_KEY]
        assert sketches.dtype == torch.float32 and sketches.shape == expected.shape
        torch.testing.assert_close(sketches, expected, rtol=1e-4, atol=1e-5)
    # the fused pass: the same sketches plus verl's old_log_probs (nested, one row per response, own length)
    fused = wg.compute_log_prob_and_sketches(_batch())
    torch.testing.assert_close(fused[SKETCH_KEY], expected, rtol=1e-4, atol=1e-5)
    lengths = [int(r.numel()) for r in _batch()["responses"].unbind()]
    for i, row in enumerate(fused["old_log_probs"].unbind()):
        assert row.shape == (lengths[i],)
        torch.testing.assert_close(row, reference.log_probs[i, : lengths[i]], rtol=1e-5, atol=1e-5)


def _put_rollouts(tq, n_groups: int = 6):
    """Rollouts as verl's agent loop and reward loop leave them in TransferQueue (v1 trainer), plus sketches."""
    from transfer_queue import KVBatchMeta

    g = torch.Generator().manual_seed(11)
    fields, keys = [], []
    for grp in range(n_groups):
        uid = f"uid{grp}"
        for k in range(K):
            length = int(torch.randint(1, 7, (1,), generator=g))
            score = 0.5 if grp == 0 else float(torch.rand(1, generator=g))  # group 0 degenerate
            rm_scores = torch.zeros(length)
            rm_scores[-1] = score
            fields.append({"uid": uid, "response_mask": torch.ones(length, dtype=torch.int64), "rm_scores": rm_scores,
                           "extra_fields": {"reward_extra_info": {"reference_score": score + 0.05 * (k - 1.5)}},
                           SKETCH_KEY: torch.randn(5, generator=g)})
            keys.append(f"{uid}_{k}_0")
    perm = torch.randperm(len(keys), generator=g).tolist()  # _balance_batch order
    keys, fields = [keys[i] for i in perm], [fields[i] for i in perm]
    tags = [{"status": "success"} for _ in keys]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=tu.list_of_dict_to_tensordict(fields), tags=tags)
    return KVBatchMeta(partition_id="train", keys=keys, tags=tags), fields


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_advantage_and_calibration_reads_on_transfer_queue(ray_cluster):
    import transfer_queue as tq

    tq.init()
    batch, fields = _put_rollouts(tq)
    record = _record()
    trainer = SetGRPOTrainer.__new__(SetGRPOTrainer)  # only the per-step glue: no GPUs, no rollout servers
    trainer.config = OmegaConf.create({
        "algorithm": {"adv_estimator": "setgrpo", "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False,
                      "gamma": 1.0, "lam": 1.0, "setgrpo": {}},
        "actor_rollout_ref": {"rollout": {"n": K}},
    })
    trainer.setgrpo = setgrpo_config_from(trainer.config.algorithm)
    trainer.record, trainer.monitor, trainer.global_steps = record, OnlineRiskMonitor(record), 1
    metrics = {}
    trainer._compute_advantage(batch, metrics)

    out = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["advantages", "returns"])
    rewards = torch.nested.as_nested_tensor([f["rm_scores"] for f in fields], layout=torch.jagged).to_padded_tensor(0.0)
    mask = torch.nested.as_nested_tensor([f["response_mask"] for f in fields], layout=torch.jagged).to_padded_tensor(0)
    expected = setgrpo_step(rewards, mask, [f["uid"] for f in fields], torch.stack([f[SKETCH_KEY] for f in fields]),
                            record)
    for i, adv in enumerate(out["advantages"].unbind()):  # nested: one row per response, its own length
        assert adv.shape == fields[i]["response_mask"].shape
        torch.testing.assert_close(adv, expected.advantages[i, : adv.numel()], rtol=0, atol=1e-6)
    assert metrics["setgrpo/degenerate_ratio"] == pytest.approx(1 / 6)
    assert metrics["setgrpo/accepted_ratio"] == expected.metrics["setgrpo/accepted_ratio"]
    assert 0.0 <= metrics["setgrpo/online_coverage"] <= 1.0 and trainer.monitor.seen == 5

    data = tq.kv_batch_get(keys=batch.keys, partition_id="train",
                           select_fields=["uid", "response_mask", "rm_scores", "extra_fields", SKETCH_KEY])
    groups = calibration_groups(data, "reference_score", k=K)
    point, reference, gram, truth, incomplete = (groups.point, groups.reference, groups.gram, groups.truth,
                                                 groups.incomplete)
    assert not incomplete
    assert truth is None  # a grader without a known truth
    torch.testing.assert_close(point, expected.point_scores)
    torch.testing.assert_close(gram, expected.gram)
    assert reference.shape == point.shape and not torch.equal(reference, point)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_reliability_variant_reads_the_reference_and_no_sketch(ray_cluster, tmp_path):
    import transfer_queue as tq

    from setgrpo_verl.integration.estimator import reliability_step

    tq.init()
    batch, fields = _put_rollouts(tq)
    trainer = SetGRPOTrainer.__new__(SetGRPOTrainer)  # only the per-step glue: no GPUs, no rollout servers
    trainer.config = OmegaConf.create({
        "algorithm": {"adv_estimator": "setgrpo", "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False,
                      "gamma": 1.0, "lam": 1.0,
                      "setgrpo": {"variant": "reliability", "group_log": str(tmp_path / "groups.jsonl")}},
        "actor_rollout_ref": {"rollout": {"n": K}},
    })
    trainer.setgrpo = setgrpo_config_from(trainer.config.algorithm)
    trainer.record, trainer.monitor, trainer.global_steps = None, None, 1
    metrics = {}
    trainer._compute_advantage(batch, metrics)

    out = tq.kv_batch_get(keys=batch.keys, partition_id="train", select_fields=["advantages"])
    rewards = torch.nested.as_nested_tensor([f["rm_scores"] for f in fields], layout=torch.jagged).to_padded_tensor(0.0)
    mask = torch.nested.as_nested_tensor([f["response_mask"] for f in fields], layout=torch.jagged).to_padded_tensor(0)
    reference = torch.tensor([f["extra_fields"]["reward_extra_info"]["reference_score"] for f in fields])
    expected = reliability_step(rewards, mask, [f["uid"] for f in fields], reference, K)
    for i, adv in enumerate(out["advantages"].unbind()):
        torch.testing.assert_close(adv, expected.advantages[i, : adv.numel()], rtol=0, atol=1e-6)
    assert metrics["setgrpo/reliability/noise_var"] == pytest.approx(expected.metrics["setgrpo/reliability/noise_var"])
    assert trainer._accepted_groups == int((expected.weights > 0).sum()) > 0
    import json

    rows = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert [r["weight"] for r in rows] == pytest.approx(expected.weights.tolist())
    assert {r["status"] for r in rows} <= {"trained", "zero_weight"} and rows[0]["recovery_ratio"] is None
