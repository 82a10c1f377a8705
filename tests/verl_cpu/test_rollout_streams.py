"""Every request of the transformers rollout samples from its own random stream.

What must hold: a request samples the same tokens whatever batch it decodes in (float32); two servers started with
the same seed (two ``--shard`` parts, or a run and its resume) do not share draws across their first batches; the K
requests of one prompt get K streams however they are split into batches; a caller's ``seed`` sampling parameter
(vLLM's per-request seed) picks the stream; in bfloat16 the rollout samples what ``generate``'s own prefill samples.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from setgrpo_verl.verl_cpu.rollout import TransformersRolloutServer, replica_seed
from setgrpo_verl.verl_cpu.streams import occurrence_indices, request_seed

_KEYS = [(1.0, 1.0, -1, 6, True), (0.7, 0.9, 50, 6, True)]
_PROMPTS = [[1, 17, 23, 5, 88, 301], [1, 9], [1, 40, 41], [1, 17, 23, 5, 88, 301], [1, 9], [1, 700, 12, 13]]


@pytest.fixture(scope="module")
def server(tiny_model):
    return TransformersRolloutServer(str(tiny_model), response_length=6, max_batch_size=8, seed=replica_seed(42, 0))


def _near(xs, ys, within: int = 100) -> float:
    """Share of positions where two batches' responses sampled token ids less than ``within`` apart."""
    near = total = 0
    for a, b in zip(xs, ys):
        near += sum(abs(x - y) < within for x, y in zip(a.token_ids, b.token_ids))
        total += min(len(a.token_ids), len(b.token_ids))
    return near / total


def test_request_seeds_differ_by_every_part_of_the_key():
    base = request_seed(7, 0, [1, 2, 3], 0)
    others = [request_seed(8, 0, [1, 2, 3], 0), request_seed(7, 1, [1, 2, 3], 0), request_seed(7, 0, [1, 2, 4], 0),
              request_seed(7, 0, [1, 2, 3], 1), request_seed(7, 0, [1, 2], 0)]
    assert base == request_seed(7, 0, [1, 2, 3], 0)
    assert len({base, *others}) == 6
    assert all(0 <= s < 2**63 for s in [base, *others])
    assert occurrence_indices([[1], [2], [1], [1], [2]]) == [0, 0, 1, 2, 1]


@pytest.mark.parametrize("key", _KEYS)
def test_a_request_samples_the_same_tokens_whatever_batch_it_is_in(server, key):
    seeds = [request_seed(5, 0, p, i) for p, i in zip(_PROMPTS, occurrence_indices(_PROMPTS))]
    together = server._generate_batch(_PROMPTS, key, seeds)
    # each request alone (no padding, no shared prefill), and the batch reversed and split in two
    alone = [server._generate_batch([p], key, [s])[0] for p, s in zip(_PROMPTS, seeds)]
    order = list(reversed(range(len(_PROMPTS))))
    halves = (server._generate_batch([_PROMPTS[i] for i in order[:3]], key, [seeds[i] for i in order[:3]])
              + server._generate_batch([_PROMPTS[i] for i in order[3:]], key, [seeds[i] for i in order[3:]]))
    regrouped = [halves[order.index(i)] for i in range(len(_PROMPTS))]
    for other in (alone, regrouped):
        for a, b in zip(together, other):
            assert a.token_ids == b.token_ids
            assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)
    # the two requests of a repeated prompt sample from two streams
    assert together[0].token_ids != together[3].token_ids or together[1].token_ids != together[4].token_ids


def test_parts_started_with_one_seed_share_no_draws(tiny_model):
    key = (1.0, 1.0, -1, 6, True)
    first = [[1, 100 + i, 200 + i] for i in range(8) for _ in range(2)]
    second = [[1, 300 + i, 400 + i] for i in range(8) for _ in range(2)]

    def part():  # a fresh server, as a --shard part or a resumed run starts one
        return TransformersRolloutServer(str(tiny_model), response_length=6, max_batch_size=16,
                                         seed=replica_seed(42, 0))

    part0, part1 = part()._generate_batch(first, key), part()._generate_batch(second, key)
    # the random model's next-token distributions barely depend on the prompt: shared uniform draws pick tokens a
    # few ids apart (independent draws: 2 x 100 of 49k ids)
    shared = part()._generate_batch(second, key, [request_seed(replica_seed(42, 0), 0, p, i)
                                                  for p, i in zip(first, occurrence_indices(first))])
    assert _near(part0, shared) > 0.8
    assert _near(part0, part1) < 0.1


def test_the_requests_of_one_prompt_get_distinct_streams_across_batches_and_versions(tiny_model, monkeypatch):
    server = TransformersRolloutServer(str(tiny_model), response_length=2, max_batch_size=2, seed=3)
    seen: list[int] = []
    generate = TransformersRolloutServer._generate_batch

    def recording(self, prompts, key, seeds=None):
        seen.extend(seeds)
        return generate(self, prompts, key, seeds)

    monkeypatch.setattr(TransformersRolloutServer, "_generate_batch", recording)
    params = {"temperature": 1.0, "max_tokens": 2}

    async def group(n):
        return await asyncio.gather(*[server.generate(prompt_ids=[1, 5, 6], sampling_params=params) for _ in range(n)])

    asyncio.run(group(4))  # four requests of one prompt in two batches of two
    assert seen == [request_seed(3, 0, [1, 5, 6], i) for i in range(4)]
    server.version = 1  # after a weight sync the sample indices restart under the new version
    seen.clear()
    asyncio.run(group(2))
    assert seen == [request_seed(3, 1, [1, 5, 6], i) for i in range(2)]


def test_a_callers_seed_picks_the_stream(server):
    params = {"temperature": 1.0, "max_tokens": 6, "seed": 1234}

    async def twice():
        return await asyncio.gather(*[server.generate(prompt_ids=[1, 9, 10], sampling_params=params) for _ in range(2)])

    a, b = asyncio.run(twice())
    assert a.token_ids == b.token_ids
    assert a.token_ids == server._generate_batch([[1, 9, 10]], (1.0, 1.0, -1, 6, False), [1234])[0].token_ids


@pytest.mark.parametrize("key", [(0.0, 1.0, -1, 6, True), *_KEYS])
def test_bfloat16_samples_what_generates_own_prefill_samples(tiny_model, key, monkeypatch):
    bf16 = TransformersRolloutServer(str(tiny_model), response_length=6, max_batch_size=8, seed=0,
                                     dtype=torch.bfloat16)
    assert bf16._share_prompts is False
    shapes: list[tuple[int, int]] = []
    bf16.model.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                         with_kwargs=True)
    outs = bf16._generate_batch(_PROMPTS, key)
    assert shapes[0] == (len(_PROMPTS), 6)  # one prefill of every padded prompt: generate's own
    monkeypatch.setattr(bf16, "_shared_prompt_cache", lambda *args: None)
    again = bf16._generate_batch(_PROMPTS, key)
    for a, b in zip(outs, again):
        assert a.token_ids == b.token_ids
        assert a.log_probs == b.log_probs
    assert TransformersRolloutServer(str(tiny_model), response_length=6, max_batch_size=8)._share_prompts is True
