"""The transformers rollout's request batching and threads.

What must hold: requests that verl's agent loop submits one by one, with gaps shorter than the server's wait, decode
as one batch; a batch never exceeds ``max_num_seqs`` and a full batch does not wait; requests after a quiet period
start a new batch; a repeated prompt is prefilled once, and its preallocated cache decodes as concatenation does; the
servers on a node share its cores; the actor's weights reach the server as copies in its dtype.
"""

from __future__ import annotations

import asyncio

import pytest

from setgrpo_verl.verl_cpu import rollout
from setgrpo_verl.verl_cpu.rollout import TransformersRolloutServer, server_threads

_PARAMS = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 2, "logprobs": False}


@pytest.fixture(autouse=True)
def _wide_batch_window(monkeypatch):
    """The batching window is wall-clock time: at 5x the product's the tests' gaps keep a margin of 0.4 s against
    the scheduling delays of a machine busy with other processes (a verl run beside this module)."""
    monkeypatch.setattr(rollout, "BATCH_WAIT_S", 1.0)


@pytest.fixture(scope="module")
def server(tiny_model):
    return TransformersRolloutServer(str(tiny_model), response_length=2, max_batch_size=8, seed=0)


def _record_batches(server, monkeypatch) -> list[int]:
    sizes: list[int] = []
    generate = TransformersRolloutServer._generate_batch

    def recording(self, prompts, key, seeds=None):
        sizes.append(len(prompts))
        return generate(self, prompts, key, seeds)

    monkeypatch.setattr(TransformersRolloutServer, "_generate_batch", recording)
    return sizes


async def _trickle(server, count: int, gap_s: float, start: int = 0):
    async def one(i):
        await asyncio.sleep((start + i) * gap_s)
        return await server.generate(prompt_ids=[1, 5 + i % 7], sampling_params=_PARAMS)

    return await asyncio.gather(*[one(i) for i in range(count)])


def test_requests_that_trickle_in_decode_as_one_batch(server, monkeypatch):
    sizes = _record_batches(server, monkeypatch)
    # 6 requests 0.6 x BATCH_WAIT_S apart: the whole run spans 3 x BATCH_WAIT_S, longer than one wait
    outs = asyncio.run(_trickle(server, 6, 0.6 * rollout.BATCH_WAIT_S))
    assert sizes == [6]
    assert all(1 <= len(o.token_ids) <= 2 for o in outs)


def test_a_full_batch_decodes_at_once_and_the_rest_follows(server, monkeypatch):
    sizes = _record_batches(server, monkeypatch)
    asyncio.run(_trickle(server, 11, 0.0))
    assert sizes == [8, 3]


def test_requests_after_a_quiet_period_start_a_new_batch(server, monkeypatch):
    sizes = _record_batches(server, monkeypatch)

    async def two_waves():
        first = asyncio.ensure_future(_trickle(server, 3, 0.0))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(_trickle(server, 2, 0.0))
        await first
        await asyncio.sleep(3 * rollout.BATCH_WAIT_S)
        third = await _trickle(server, 4, 0.0)
        await second
        return third

    asyncio.run(two_waves())
    assert sizes == [5, 4]


@pytest.mark.parametrize(("cpus", "ranks", "per_replica", "threads"),
                         [(2, 1, 1, 2), (2, 2, 1, 1), (16, 4, 2, 8), (16, 8, 8, 16), (3, 4, 1, 1)])
def test_the_servers_on_a_node_share_its_cores(cpus, ranks, per_replica, threads):
    assert server_threads(cpus, ranks, per_replica) == threads


@pytest.fixture
def forwards(server):
    """(batch rows, positions) of every forward the server's model runs, recorded by a forward pre-hook (a
    replaced ``forward`` would change the signature ``generate`` inspects)."""
    shapes: list[tuple[int, int]] = []
    handle = server.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    yield shapes
    handle.remove()


# three distinct prompts of different lengths, two of them sent K = 3 times (a group's responses)
_GROUPED = [[1, 17, 23, 5], [1, 9], [1, 17, 23, 5], [1, 40, 41], [1, 9], [1, 17, 23, 5], [1, 9]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_repeated_prompt_is_prefilled_once_and_decodes_as_if_prefilled_per_request(server, forwards, temperature,
                                                                                      monkeypatch):
    import torch

    key = (temperature, 1.0, -1, 5, True)
    shapes = forwards
    monkeypatch.setattr(server, "_share_prompts", False)
    torch.manual_seed(11)
    alone = server._generate_batch(_GROUPED, key)
    per_request = list(shapes)
    shapes.clear()
    monkeypatch.setattr(server, "_share_prompts", True)
    torch.manual_seed(11)
    shared = server._generate_batch(_GROUPED, key)

    # per request: generate's prefill runs all 7 padded prompts of width 4; shared: the 3 distinct prompts' first
    # 3 positions once, then generate runs the last prompt position of the 7 requests
    assert per_request[0] == (7, 4)
    assert shapes[:2] == [(3, 3), (7, 1)]
    assert len(shapes) == len(per_request) + 1
    for a, b in zip(alone, shared):
        assert a.token_ids == b.token_ids
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_preallocated_cache_decodes_the_same_tokens_and_log_probs_as_concatenation(server, temperature,
                                                                                        monkeypatch):
    import torch

    from setgrpo_verl.verl_cpu.kv_cache import PreallocatedLayer

    key = (temperature, 1.0, -1, 5, True)
    caches = []
    generate = server.model.generate
    monkeypatch.setattr(server.model, "generate",
                        lambda **kw: caches.append(kw.get("past_key_values")) or generate(**kw))
    outs = {}
    for preallocate in (False, True):
        monkeypatch.setattr(server, "_preallocate", preallocate)
        torch.manual_seed(5)
        outs[preallocate] = server._generate_batch(_GROUPED, key)
    assert {type(layer) for layer in caches[0].layers} != {PreallocatedLayer}
    assert {type(layer) for layer in caches[1].layers} == {PreallocatedLayer}
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sdpa_and_eager_attention_decode_the_same_tokens_and_log_probs(server, tiny_model, temperature):
    import torch

    assert server.model.config._attn_implementation == "sdpa"  # the server's default
    eager = TransformersRolloutServer(str(tiny_model), response_length=5, max_batch_size=8, seed=0,
                                      attn_implementation="eager")
    assert eager.model.config._attn_implementation == "eager"
    key = (temperature, 1.0, -1, 5, True)
    # left-padded prompts of three lengths, two sent three times: the padding mask and the shared prefill
    outs = []
    for srv in (server, eager):
        torch.manual_seed(7)
        outs.append(srv._generate_batch(_GROUPED, key))
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)


def test_a_batch_of_distinct_prompts_is_prefilled_by_generate(server, forwards):
    shapes = forwards
    assert server._share_prompts is True  # a Llama's cache is a plain attention cache
    server._generate_batch([[1, 17, 23, 5], [1, 9], [1, 40, 41]], (0.0, 1.0, -1, 3, False))
    assert shapes[0] == (3, 4)


def test_a_hybrid_linear_attention_model_decodes_with_generates_own_prefill(tmp_path):
    from tests.sketch._tiny import tiny_qwen35_text

    model = tiny_qwen35_text(seed=0, vocab=96)
    model.config.eos_token_id = 95
    model.generation_config.eos_token_id = 95
    model.save_pretrained(tmp_path)
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(96)},
                                                                              unk_token="t0")),
                                  eos_token="t95", pad_token="t0")
    tok.save_pretrained(tmp_path)
    hybrid = TransformersRolloutServer(str(tmp_path), response_length=3, max_batch_size=8, seed=0)
    key = (0.0, 1.0, -1, 3, True)
    prompts = [[1, 17, 23], [1, 17, 23], [2, 5, 7]]
    assert hybrid._share_prompts is False  # its cache is not a plain attention cache: no shared prefill
    first = hybrid._generate_batch(prompts, key)
    again = hybrid._generate_batch(prompts, key)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert first[0].token_ids == first[1].token_ids  # greedy: one prompt, one response


def test_weights_reach_the_server_as_fresh_copies_in_its_dtype(tmp_path):
    import torch

    from setgrpo_verl.verl_cpu.weight_buffer import Layout, WeightBuffer

    actor = {"a.weight": torch.tensor([[1.5, -2.25]]), "b.bias": torch.tensor([3.0])}

    def synced(dtype):  # what the adapter writes and the server reads: the shared buffer's views
        layout = Layout.of([(n, tuple(t.shape)) for n, t in actor.items()], dtype)
        buffer = WeightBuffer.create(layout, tmp_path)
        buffer.write_all(actor.items())
        return buffer.views

    state = synced(torch.bfloat16)
    assert list(state) == ["a.weight", "b.bias"]
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in state.values())
    assert state["a.weight"].tolist() == [[1.5, -2.25]]
    actor["a.weight"].add_(1.0)  # the next update changes the actor's parameters in place
    assert state["a.weight"].tolist() == [[1.5, -2.25]]
    same = synced(torch.float32)
    assert same["b.bias"].data_ptr() != actor["b.bias"].data_ptr()
