"""How many judge requests one event loop keeps in flight: at most ``max_concurrency``, fewer while the judge
answers HTTP 429 (docs/grading.md#requests-in-flight).

A judge that allows fewer requests in flight than we send answers the surplus with 429 (too many requests).
:class:`InFlightLimit` halves its limit when a request is refused that way, at most once per limit (the requests
refused together were all sent under the same limit, and one halving answers them all), and raises it by one
again after as many answered requests in a row as the limit, up to ``max_concurrency``: the additive-increase,
multiplicative-decrease rule of TCP congestion control, so that a worker settles just under the judge's limit and
recovers when the judge frees up. :func:`rate_limited_error` and :func:`too_slow_error` are the errors of a judge
that keeps refusing and of one that does not answer in time, naming the knobs that set each.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .types import GradingError

__all__ = ["InFlightLimit", "next_limit", "rate_limited_error", "too_slow_error"]

#: Where a user sets the openai grader's transport knobs (Hydra; the command line's flag where there is one).
KNOBS = {
    "timeout": "reward.reward_kwargs.grader.timeout",
    "max_concurrency": "reward.reward_kwargs.grader.max_concurrency, CLI --judge-max-concurrency",
    "rate_limit_wait": "reward.reward_kwargs.grader.rate_limit_wait",
}


class InFlightLimit:
    """An asyncio semaphore whose size follows the judge's rate limiting (module docstring).

    Args:
        most: the largest number of requests in flight (the grader's ``max_concurrency``, >= 1).

    Use ``limit = await acquire()`` before a request and ``release(limit, outcome)`` after it. Bound to the event
    loop it is first used in.
    """

    def __init__(self, most: int):
        if int(most) < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {most!r}")
        self.most = int(most)
        self.limit = self.most
        self.in_flight = 0
        self._answered_in_a_row = 0
        self._changed = asyncio.Condition()

    async def acquire(self) -> int:
        """Wait for room under the current limit and take it; returns the limit the request is sent under."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.in_flight < self.limit)
            self.in_flight += 1
            return self.limit

    async def release(self, sent_under: int, outcome: str) -> None:
        """Give the room back after a request sent under the limit ``sent_under``.

        Args:
            sent_under: what :meth:`acquire` returned.
            outcome: ``"answered"`` (counts toward raising the limit by one), ``"refused"`` (HTTP 429: halves the
                limit, at least 1, if it is still ``sent_under``) or ``"failed"`` (any other end: the limit stays).

        Raises:
            ValueError: another ``outcome``.
        """
        if outcome not in ("answered", "refused", "failed"):
            raise ValueError(f"outcome must be answered, refused or failed, got {outcome!r}")
        async with self._changed:
            self.in_flight -= 1
            if outcome != "failed":
                self.limit, self._answered_in_a_row = next_limit(
                    self.limit, self.most, self._answered_in_a_row, sent_under=sent_under,
                    refused=outcome == "refused")
            self._changed.notify_all()


def next_limit(limit: int, most: int, answered_in_a_row: int, *, sent_under: int, refused: bool) -> tuple[int, int]:
    """``(limit, answered in a row)`` after one request sent under ``sent_under`` ends (module docstring).

    Args:
        limit: the current limit (1..most).
        most: the largest limit (``max_concurrency``).
        answered_in_a_row: requests answered since the limit last changed.
        sent_under: the limit when the request was sent.
        refused: the judge answered HTTP 429.
    """
    if refused:
        if sent_under == limit and limit > 1:
            return max(1, limit // 2), 0
        return limit, 0
    answered_in_a_row += 1
    if answered_in_a_row >= limit and limit < most:
        return limit + 1, 0
    return limit, answered_in_a_row


def rate_limited_error(judge: Any, server_said: str, waited: float, limit: int) -> GradingError:
    """The error of a request the judge kept refusing with HTTP 429 for ``waited`` seconds although the limit came
    down to ``limit``; ``judge`` is the :class:`~.http_judge.OpenAIJudge` (its URL, model and knobs are named)."""
    return GradingError(
        f"judge {judge.model!r} at {judge.base_url} kept refusing requests with HTTP 429 (too many requests: "
        f"{server_said}) for {waited:.0f} s, after the client's {judge.max_retries} retries each, although this "
        f"reward worker lowered its requests in flight from max_concurrency={judge.max_concurrency} to {limit}: the "
        "judge allows fewer requests than the run sends. Lower max_concurrency, the requests in flight per reward "
        f"worker ({KNOBS['max_concurrency']}; the run sends up to reward.num_workers times as many), raise the "
        f"judge's limit, or wait longer (rate_limit_wait={judge.rate_limit_wait:g} s: {KNOBS['rate_limit_wait']}; "
        "docs/grading.md#requests-in-flight)"
    )


def too_slow_error(judge: Any, what: str) -> GradingError:
    """The error of a request whose every attempt outlasted the judge's ``timeout`` (``what``: the client's
    exception name); it counts the requests ``judge`` answered before, to tell a slow judge from a dead one."""
    return GradingError(
        f"judge {judge.model!r} at {judge.base_url} did not answer within timeout={judge.timeout:g} s, in "
        f"{judge.max_retries + 1} attempts ({what}); it answered {judge.answered} requests before, so it is slow or "
        f"overloaded rather than unreachable. Raise the timeout, in seconds per attempt ({KNOBS['timeout']}), lower "
        f"the requests in flight per reward worker so that fewer wait at the judge ({KNOBS['max_concurrency']}, now "
        f"{judge.max_concurrency}), or give the judge more capacity (docs/grading.md#requests-in-flight)"
    )
