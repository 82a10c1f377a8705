"""The sketch RPC on a Ray CPU worker group built with verl's single-controller classes."""

from __future__ import annotations

import contextlib
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

from setgrpo_verl.integration.worker import SKETCH_CONFIG_KEY, SKETCH_KEY, SetGRPOActorRolloutRefWorker, _padded_layout
from setgrpo_verl.sketch import SketchConfig, compute_sketches

SKETCH = SketchConfig(rank_out=3, rank_in=2, seed=7)


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


class _CPUEngine:
    """The engine calls the sketch RPC makes (verl's FSDP engines register for cuda/npu only)."""

    def __init__(self, module):
        self.module = module
        self.ulysses_sequence_parallel_size = 1

    def eval_mode(self):
        return contextlib.nullcontext()

    def get_data_parallel_group(self):
        return None

    def is_mp_src_rank_with_outputs(self):
        return True


class TinySketchWorker(SetGRPOActorRolloutRefWorker):
    """Our worker class with a tiny CPU model in place of verl's GPU engine; the RPC itself is untouched."""

    def __init__(self, use_dynamic_bsz: bool):
        Worker.__init__(self)
        self.config = OmegaConf.create({"actor": {"loss_agg_mode": "token-mean"}})
        self.actor = None
        self._use_dynamic_bsz = use_dynamic_bsz

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        engine_config = SimpleNamespace(use_dynamic_bsz=self._use_dynamic_bsz, infer_max_token_len_per_gpu=24,
                                        infer_micro_batch_size_per_gpu=2)
        self.actor = SimpleNamespace(engine=_CPUEngine(_tiny_model()), model_config={"use_remove_padding": True},
                                     engine_config=engine_config)
        self._register_dispatch_collect_info("actor", dp_rank=self.rank, is_collect=True)


def _batch(b: int = 8) -> TensorDict:
    """verl v1 layout: nested prompts / responses / input_ids / response_mask of uneven lengths."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 50, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g) for _ in range(b)]
    responses = [torch.randint(1, 50, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g) for _ in range(b)]
    masks = [torch.ones_like(r) for r in responses]
    masks[1][-1] = 0  # a masked-out (e.g. tool) token inside a response
    nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    td = TensorDict({"prompts": nested(prompts), "responses": nested(responses), "response_mask": nested(masks),
                     "input_ids": nested(ids), "attention_mask": nested([torch.ones_like(i) for i in ids])},
                    batch_size=[b])
    tu.assign_non_tensor(td, **{SKETCH_CONFIG_KEY: dataclasses.asdict(SKETCH)})
    return td


@pytest.fixture(scope="module")
def ray_cluster():
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests package
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_sketch_rpc_on_ray_cpu_worker_group(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(TinySketchWorker), use_dynamic_bsz=True),
                        device_name="cpu")
    wg.init_model()
    # the driver's reference: the same hook on the whole batch, in batch order
    ids, am, rm = _padded_layout(_batch())
    expected = compute_sketches(_tiny_model(), ids, am, rm, SKETCH).sketches
    assert torch.cdist(expected, expected).fill_diagonal_(1.0).min() > 1e-3  # distinct rows: a permutation shows
    fixed = _batch()  # the engine's fixed micro-batch path, chosen per call like verl's infer_batch keys
    tu.assign_non_tensor(fixed, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    for data in (_batch(), fixed):  # dynamic (token-budget, reordered) micro-batches, then fixed ones
        sketches = wg.compute_sketches(data)[SKETCH_KEY]
        assert sketches.dtype == torch.float32 and sketches.shape == expected.shape
        torch.testing.assert_close(sketches, expected, rtol=1e-4, atol=1e-5)
