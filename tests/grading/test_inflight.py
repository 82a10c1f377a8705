"""The requests in flight of one event loop follow the judge's rate limiting: halved once per limit on HTTP 429,
raised by one after as many answers in a row, never above max_concurrency nor below 1."""

import asyncio

import pytest

from setgrpo_verl.grading.inflight import InFlightLimit, next_limit


def test_a_refusal_halves_the_limit_once_for_the_requests_sent_under_it():
    assert next_limit(32, 32, 5, sent_under=32, refused=True) == (16, 0)
    # the other requests refused together were sent under 32 too: the limit is already halved for them
    assert next_limit(16, 32, 0, sent_under=32, refused=True) == (16, 0)
    assert next_limit(1, 32, 0, sent_under=1, refused=True) == (1, 0)
    assert next_limit(3, 32, 0, sent_under=3, refused=True) == (1, 0)


def test_answers_in_a_row_raise_the_limit_by_one_up_to_max_concurrency():
    limit, row = 4, 0
    for _ in range(3):
        limit, row = next_limit(limit, 6, row, sent_under=limit, refused=False)
    assert (limit, row) == (4, 3)
    assert next_limit(limit, 6, row, sent_under=4, refused=False) == (5, 0)
    assert next_limit(6, 6, 100, sent_under=6, refused=False) == (6, 101)  # never above the most


def test_in_flight_never_exceeds_the_lowered_limit():
    async def body():
        limit = InFlightLimit(8)
        peak = []

        async def request(refuse: bool):
            sent_under = await limit.acquire()
            peak.append(limit.in_flight)
            await asyncio.sleep(0)
            await limit.release(sent_under, "refused" if refuse else "failed")

        await asyncio.gather(*(request(True) for _ in range(8)))
        after_refusals = limit.limit
        peak.clear()
        await asyncio.gather(*(request(False) for _ in range(20)))
        return after_refusals, max(peak), limit

    after_refusals, peak, limit = asyncio.run(body())
    assert after_refusals == 4  # eight refused together under 8: halved once
    assert peak == 4 and limit.limit == 4 and limit.in_flight == 0  # failures neither raise nor lower it


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        InFlightLimit(0)

    async def body():
        limit = InFlightLimit(2)
        await limit.release(await limit.acquire(), "maybe")

    with pytest.raises(ValueError, match="answered, refused or failed"):
        asyncio.run(body())
