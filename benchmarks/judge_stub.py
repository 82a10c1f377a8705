"""A local OpenAI-compatible judge stub for load benchmarks (``bench_judge_load.py``): ``POST /v1/chat/completions``
on the loopback address, answered after a set latency, with a limit on requests in flight (the surplus gets HTTP
429 with ``Retry-After``), occasional HTTP 503 errors, slow replies and replies cut by the token budget.

The verdict is ``Yes`` for an odd request seed and ``No`` for an even one, so a client that re-sends a request with
the same seed gets the same verdict. Counters: ``answered`` (200s), ``refused`` (429s), ``errors`` (503s), ``slow``,
``cut``, ``peak`` (most requests in flight) and ``samples`` ((seconds since start, requests in flight) every
``sample_every`` seconds). It is a plain asyncio HTTP/1.1 server with keep-alive, run in its own thread::

    with JudgeStub(latency=0.02, limit=8) as stub:
        judge = OpenAIJudge(stub.base_url, "stub")
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

__all__ = ["JudgeStub"]

_REASONS = {200: "OK", 429: "Too Many Requests", 503: "Service Unavailable", 404: "Not Found"}


class JudgeStub:
    """The stub server (module docstring).

    Args:
        latency: seconds each answered request takes.
        limit: requests in flight it serves at once; more are refused with HTTP 429.
        error_rate: share of requests answered with HTTP 503 (after ``latency``).
        slow_rate: share of requests that take ``slow_factor`` times the latency.
        slow_factor: how much longer a slow request takes.
        cut_rate: share of replies cut by the token budget before the verdict (``finish_reason="length"``).
        retry_after: the ``Retry-After`` seconds of a 429.
        seed: seed of the fault draws.
        sample_every: seconds between samples of the requests in flight.
    """

    def __init__(self, *, latency: float = 0.02, limit: int = 8, error_rate: float = 0.0, slow_rate: float = 0.0,
                 slow_factor: float = 20.0, cut_rate: float = 0.0, retry_after: float = 0.05, seed: int = 0,
                 sample_every: float = 0.1):
        self.latency, self.limit, self.error_rate, self.slow_rate = float(latency), int(limit), error_rate, slow_rate
        self.slow_factor, self.cut_rate, self.retry_after = float(slow_factor), cut_rate, float(retry_after)
        self.sample_every = float(sample_every)
        self.rng = random.Random(seed)
        self.in_flight = self.peak = self.answered = self.refused = self.errors = self.slow = self.cut = 0
        self.samples: list[tuple[float, int]] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def reset(self) -> None:
        """Zero the counters and samples (between benchmark settings)."""
        self.peak = self.answered = self.refused = self.errors = self.slow = self.cut = 0
        self.samples = []
        self._t0 = time.perf_counter()

    def __enter__(self) -> "JudgeStub":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the judge stub did not start within 10 s")
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0, backlog=1024)
        self.port = server.sockets[0].getsockname()[1]
        self._t0 = time.perf_counter()
        sampler = asyncio.ensure_future(self._sample())
        self._ready.set()
        async with server:
            await self._stop.wait()
        sampler.cancel()

    async def _sample(self) -> None:
        while True:
            self.samples.append((time.perf_counter() - self._t0, self.in_flight))
            await asyncio.sleep(self.sample_every)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                headers = {}
                while True:
                    header = await reader.readline()
                    if header in (b"\r\n", b"\n", b""):
                        break
                    key, _, value = header.decode("latin-1").partition(":")
                    headers[key.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                status, payload, extra = await self._answer(line, body)
                data = json.dumps(payload).encode()
                head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", "content-type: application/json",
                        f"content-length: {len(data)}", "connection: keep-alive"]
                head += [f"{k}: {v}" for k, v in extra.items()]
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _answer(self, line: bytes, body: bytes) -> tuple[int, dict, dict]:
        if b"/chat/completions" not in line:
            return 404, {"error": {"message": "not found"}}, {}
        if self.in_flight >= self.limit:
            self.refused += 1
            return 429, {"error": {"message": f"at most {self.limit} requests in flight", "type": "rate_limit"}}, {
                "retry-after": f"{self.retry_after:g}"}
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            draw = self.rng.random()
            if draw < self.error_rate:
                await asyncio.sleep(self.latency)
                self.errors += 1
                return 503, {"error": {"message": "injected overload", "type": "overloaded"}}, {}
            slow = draw < self.error_rate + self.slow_rate
            self.slow += slow
            await asyncio.sleep(self.latency * (self.slow_factor if slow else 1.0))
            request = json.loads(body or b"{}")
            cut = self.rng.random() < self.cut_rate
            self.cut += cut
            text = "The response" if cut else ("Yes" if int(request.get("seed") or 0) % 2 else "No")
            self.answered += 1
            return 200, {"id": "stub", "object": "chat.completion", "created": 0, "model": request.get("model", "stub"),
                         "choices": [{"index": 0, "finish_reason": "length" if cut else "stop",
                                      "message": {"role": "assistant", "content": text}}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}, {}
        finally:
            self.in_flight -= 1
