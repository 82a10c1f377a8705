"""The transformers rollout's request batching and threads.

What must hold: requests that verl's agent loop submits one by one, with gaps shorter than the server's wait, decode
as one batch; a batch never exceeds ``max_num_seqs`` and a full batch does not wait; requests after a quiet period
start a new batch; the servers on a node share its cores.
"""

from __future__ import annotations

import asyncio

import pytest

from setgrpo_verl.verl_cpu import rollout
from setgrpo_verl.verl_cpu.rollout import TransformersRolloutServer, server_threads

_PARAMS = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 2, "logprobs": False}


@pytest.fixture(scope="module")
def server(tiny_model):
    return TransformersRolloutServer(str(tiny_model), response_length=2, max_batch_size=8, seed=0)


def _record_batches(server, monkeypatch) -> list[int]:
    sizes: list[int] = []
    generate = TransformersRolloutServer._generate_batch

    def recording(self, prompts, key):
        sizes.append(len(prompts))
        return generate(self, prompts, key)

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
