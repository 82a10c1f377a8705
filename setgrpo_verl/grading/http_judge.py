"""The HTTP judge: any OpenAI-compatible chat-completions server (vLLM, SGLang, a hosted API).

:class:`OpenAIJudge` is async with a concurrency limit; timeouts, connection errors, 408, 409 and 5xx are retried
``max_retries`` times with the ``openai`` client's backoff schedule (the client itself does not retry). A request
refused with HTTP 429 lowers the requests in flight of its event loop at once (:class:`~.inflight.InFlightLimit`:
each refusal reaches it, none is hidden in the client's own retries) and is sent again, until it has waited
``rate_limit_wait`` seconds in all (docs/grading.md#requests-in-flight). A timeout is reported as a slow judge, naming ``timeout``, never as an
unreachable one; an
HTTP 200 whose body is not a chat completion (an HTML page, an empty body, an ``{"error": ...}`` payload, no choices)
is a transport failure too, retried with the same budget and backoff, never read as an answer. The reply is read by
:func:`~.protocol.read_reply` (every OpenAI-compatible shape; tool calls and refusals are errors) and its verdict by
:func:`~.protocol.parse_verdict`; an unparseable answer is re-asked with the next seed up to ``parse_retries``
times, then it is an ``unparsed`` verdict, which the grader's ``max_unparsed_ratio`` turns into an error by default
(docs/grading.md#unparsed-verdicts). A reply cut off by the token budget (``finish_reason="length"``) gives its
verdict when it clearly gives one before the cut (``Yes, the response``), else it is re-asked the same way; when
every attempt is cut the budget is too small for this judge, an error that names ``max_tokens`` and
``chat_template_kwargs`` (docs/grading.md#reading-a-verdict).

Any other HTTP 4xx (400 Bad Request, 401, 404, ...) is a refusal that repeating the request cannot change: it is
never retried. A request longer than the judge's context (vLLM: HTTP 400 "maximum context length is N tokens") is
a :class:`JudgeContextError` naming the response and the fix: ``max_response_tokens`` cuts every response before it
is sent, as the ``local_hf`` grader's does.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Sequence

from .http_errors import (CONTEXT_TOKENS, RETRIED_STATUSES, JudgeContextError, backoff, completion_choice,
                          is_context_refusal, retry_after, server_message)
from .inflight import InFlightLimit, rate_limited_error, too_slow_error
from .network import transport_hint
from .protocol import (
    SAID_CHARS,
    JudgeRequest,
    gather_or_cancel,
    judge_messages,
    parse_verdict,
    read_reply,
    said,
    strip_reasoning,
    template_hash,
)
from .types import GradingError, Verdict

__all__ = ["JudgeContextError", "OpenAIJudge", "cut_to_tokens"]


def cut_to_tokens(text: str, limit: int | None) -> str:
    """``text`` cut so that it holds at most ``limit`` tokens of any byte-level or SentencePiece tokenizer.

    The judge's tokenizer lives on the server, so tokens are counted from above by UTF-8 bytes (every token of
    such a tokenizer covers at least one byte): the text is cut to its first ``limit`` bytes, at a character
    boundary. English text keeps about ``limit / 4`` tokens of the judge's tokenizer this way.

    Args:
        text: the response.
        limit: the token budget (>= 1), or None for no cut.
    """
    if limit is None:
        return text
    data = text.encode("utf-8")
    return text if len(data) <= limit else data[:limit].decode("utf-8", errors="ignore")


class OpenAIJudge:
    """Judge backed by an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    Args:
        base_url: server URL including ``/v1`` (e.g. ``http://127.0.0.1:8000/v1`` for vLLM / SGLang).
        model: model name sent in each request.
        api_key: API key; ``None`` reads ``$OPENAI_API_KEY`` and falls back to ``"EMPTY"`` (local servers).
        temperature: sampling temperature sent to the server (enters the identity).
        max_tokens: completion token budget per verdict (enters the identity). A verdict is one word; the default
            16 also leaves room for a short sentence, a bold label or a small JSON object around it (a judge that
            answers one word stops after it, so the budget costs nothing then); a reasoning ("thinking") judge needs room for its reasoning too
            (e.g. 2048), or thinking switched off with ``chat_template_kwargs``.
        chat_template_kwargs: sent as the request's ``chat_template_kwargs`` (vLLM / SGLang pass them to the chat
            template), e.g. ``{"enable_thinking": False}`` for Qwen3; ``None`` sends nothing. Enters the identity.
        max_concurrency: at most this many requests in flight per event loop, i.e. per verl reward worker (a run
            sends up to ``reward.num_workers`` times as many); fewer while the judge answers HTTP 429
            (:class:`~.inflight.InFlightLimit`).
        timeout: seconds per request attempt (``openai`` client timeout); a request waits at most about
            ``timeout * (max_retries + 1)`` plus backoff before it fails as too slow.
        max_retries: retries per request on timeouts, connection errors, 408/409/5xx and HTTP 200 bodies that are
            not a chat completion, with the ``openai`` client's backoff schedule (0.5 s doubling, at most 8 s);
            HTTP 429 is apart (``rate_limit_wait``).
        parse_retries: how many times a reply that is cut by the token budget or gives no verdict is re-asked (with
            seed + attempt); after that the verdict is ``unparsed`` (what the grader does with it: its
            ``max_unparsed_ratio``), or an error when every attempt was cut.
        rate_limit_wait: the longest a request keeps being sent again, in seconds from its first HTTP 429 refusal
            that outlasted the client's retries, while its event loop lowers its requests in flight; then it fails,
            naming ``max_concurrency``.
        max_response_tokens: every response is cut to at most this many tokens before it is sent
            (:func:`cut_to_tokens`; enters the identity); None sends responses whole. Set it from the judge's
            context: context minus ``max_tokens`` minus room for the prompt template, the question and the
            criterion (about 1,000 tokens), e.g. 7,000 for an 8,192-token judge.

    Each request carries ``seed`` (the verdict seed from the grader, 31 bits), so a server that honours seeds
    (vLLM, SGLang) makes scoring i reproducible. Transport failures that outlast the retries raise
    :class:`GradingError` naming the URL, the HTTP status and the start of the body; pending sibling requests are
    cancelled.
    """

    name = "openai_chat"

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        temperature: float = 1.0,
        max_tokens: int = 16,
        chat_template_kwargs: dict | None = None,
        max_concurrency: int = 32,
        timeout: float = 60.0,
        max_retries: int = 4,
        parse_retries: int = 2,
        max_response_tokens: int | None = None,
        rate_limit_wait: float = 300.0,
    ):
        if (max_concurrency < 1 or timeout <= 0 or max_retries < 0 or parse_retries < 0 or int(max_tokens) < 1
                or not rate_limit_wait >= 0):
            raise ValueError("need max_tokens >= 1, max_concurrency >= 1, timeout > 0, max_retries >= 0, "
                             "parse_retries >= 0 and rate_limit_wait >= 0")
        if max_response_tokens is not None and (isinstance(max_response_tokens, bool) or int(max_response_tokens) < 1):
            raise ValueError(f"max_response_tokens must be an integer >= 1 or null, got {max_response_tokens!r}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a mapping such as {{'enable_thinking': False}}, got "
                             f"{chat_template_kwargs!r}")
        self.base_url = base_url
        self.model = model
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.temperature = float(temperature)
        self.max_tokens = int(max_tokens)
        self.chat_template_kwargs = dict(chat_template_kwargs) if chat_template_kwargs else None
        self.max_concurrency = int(max_concurrency)
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.parse_retries = int(parse_retries)
        self.max_response_tokens = None if max_response_tokens is None else int(max_response_tokens)
        self.rate_limit_wait = float(rate_limit_wait)
        self.answered = 0  # requests the server answered, for the message of a later timeout
        self._clients: dict[int, tuple[Any, Any, InFlightLimit]] = {}  # id(loop) -> (loop, client, in-flight limit)

    @property
    def identity(self) -> dict:
        """``{name, model, temperature, template_hash}`` (docs/algorithm.md#7-record)."""
        return self.identity_for(model=self.model, temperature=self.temperature, max_tokens=self.max_tokens,
                                 chat_template_kwargs=self.chat_template_kwargs,
                                 max_response_tokens=self.max_response_tokens)

    @classmethod
    def identity_for(cls, *, model: str, temperature: float, max_tokens: int, chat_template_kwargs: dict | None = None,
                     max_response_tokens: int | None = None, **_) -> dict:
        """The identity a judge with these settings reports (no client is created). ``chat_template_kwargs`` and
        ``max_response_tokens`` change what the judge model is asked, so they enter ``template_hash`` (only when
        given: the hash of a judge without them is unchanged)."""
        protocol: dict[str, Any] = {"max_tokens": int(max_tokens)}
        if chat_template_kwargs:
            protocol["chat_template_kwargs"] = dict(chat_template_kwargs)
        if max_response_tokens is not None:
            protocol["max_response_tokens"] = int(max_response_tokens)
        return {"name": cls.name, "model": model, "temperature": float(temperature),
                "template_hash": template_hash(**protocol)}

    def _client(self):
        from openai import AsyncOpenAI

        loop = asyncio.get_running_loop()
        entry = self._clients.get(id(loop))
        if entry is None or entry[0] is not loop:
            # retries are ours (:meth:`_complete`, :meth:`_send`): every HTTP 429 reaches the in-flight limit
            client = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.timeout, max_retries=0)
            entry = (loop, client, InFlightLimit(self.max_concurrency))
            self._clients[id(loop)] = entry
        return entry[1], entry[2]

    async def _complete(self, messages: list[dict], seed: int) -> dict:
        """One chat completion; returns its first choice (a dict with ``message`` and ``finish_reason``).

        HTTP errors are retried by the ``openai`` client; an HTTP 200 whose body is not a chat completion is retried
        here with the same budget and backoff.

        Raises:
            GradingError: the request still fails after ``max_retries`` retries (names the URL, the HTTP status and
                the start of the body).
        """
        import openai

        url, status, body, what = f"{self.base_url.rstrip('/')}/chat/completions", None, "", ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(backoff(attempt))
            last = attempt == self.max_retries
            try:
                raw = await self._send(messages, seed)
            except openai.APIStatusError as exc:
                if exc.status_code in RETRIED_STATUSES or exc.status_code >= 500:
                    if not last:
                        continue
                    raise self._failed(exc, "the server answered with an error: check the model name and the "
                                       "server's log") from exc
                raise GradingError(
                    f"judge {self.model!r} at {self.base_url} answered HTTP {exc.status_code}, a refusal that "
                    f"repeating the request cannot change (not retried): {server_message(exc)}; check the model "
                    "name, the API key and the server's log"
                ) from exc
            except openai.APITimeoutError as exc:
                if not last:
                    continue
                raise too_slow_error(self, type(exc).__name__) from exc
            except openai.APIError as exc:
                if not last:
                    continue
                hint = ("the server cannot be reached: start the OpenAI-compatible server or fix the base URL "
                        "(it ends in /v1)" if isinstance(exc, openai.APIConnectionError) else
                        "the server answered with an error: check the model name and the server's log")
                raise self._failed(exc, hint) from exc
            self.answered += 1
            response = raw.http_response
            url, status, body = str(response.url), response.status_code, response.text
            choice, what = completion_choice(body)
            if choice is not None:
                return choice
        raise GradingError(
            f"judge {self.model!r}: the request to {url} got HTTP {status} with {what} after {self.max_retries} "
            f"retries; the body "
            f"starts {body[:SAID_CHARS]!r}. Check that the URL is the server's OpenAI-compatible /v1 endpoint (no "
            "proxy error page in between) and that the server is healthy"
        )

    async def _send(self, messages: list[dict], seed: int):
        """One request through the ``openai`` client (its retries included) under the event loop's in-flight limit;
        a request the judge still refuses with HTTP 429 lowers the limit and is sent again, up to
        ``rate_limit_wait`` seconds after the first such refusal (docs/grading.md#requests-in-flight).

        Raises:
            GradingError: HTTP 429 beyond ``rate_limit_wait`` (:func:`~.inflight.rate_limited_error`).
            openai.APIError: any other failure of the client, for :meth:`_complete` to name.
        """
        import openai

        client, in_flight = self._client()
        extra = {"chat_template_kwargs": self.chat_template_kwargs} if self.chat_template_kwargs else None
        loop = asyncio.get_running_loop()
        first_refusal, rounds = None, 0
        while True:
            sent_under = await in_flight.acquire()
            outcome = "failed"
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model=self.model, messages=messages, temperature=self.temperature, max_tokens=self.max_tokens,
                    seed=seed, extra_body=extra)
                outcome = "answered"
                return raw
            except openai.RateLimitError as exc:
                outcome, wait = "refused", retry_after(exc, rounds + 1)
                first_refusal = loop.time() if first_refusal is None else first_refusal
                if loop.time() - first_refusal >= self.rate_limit_wait:
                    raise rate_limited_error(self, server_message(exc), loop.time() - first_refusal,
                                             in_flight.limit) from exc
            finally:
                await in_flight.release(sent_under, outcome)
            rounds += 1
            await asyncio.sleep(wait)

    def _failed(self, exc: Exception, hint: str) -> GradingError:
        """The error of a request that failed after the client's retries, naming the judge's model and URL and the
        HTTP status (or that no connection was made)."""
        import openai

        status = getattr(exc, "status_code", None)
        what = (f"answered HTTP {status}" if status is not None else "could not be reached (no HTTP status)"
                if isinstance(exc, openai.APIConnectionError) else "failed")
        return GradingError(
            f"judge {self.model!r} at {self.base_url} {what} after {self.max_retries} retries "
            f"(timeout {self.timeout}s per attempt): {type(exc).__name__}: {exc}{transport_hint(exc, self.base_url)}; "
            f"{hint}"
        )

    def _context_error(self, exc: GradingError, request: JudgeRequest) -> JudgeContextError:
        """The refusal of a request longer than the judge's context, naming the response and the fix."""
        message = server_message(exc.__cause__)
        context = CONTEXT_TOKENS.search(message)
        budget = (f"; for this judge's {context.group(1)}-token context, e.g. max_response_tokens="
                  f"{max(int(context.group(1)) - self.max_tokens - 1000, 1)}" if context else "")
        cut = ("every response is cut to max_response_tokens="
               f"{self.max_response_tokens}, still too long with the question and criterion: lower it"
               if self.max_response_tokens is not None else
               "set the openai grader's max_response_tokens (reward.reward_kwargs.grader.max_response_tokens, "
               "or the CLI's --judge-max-response-tokens) so that responses are cut to fit")
        return JudgeContextError(
            f"judge {self.model!r} at {self.base_url} refused the request for response {said(request.response)} "
            f"and criterion {request.criterion!r} as longer than its context "
            f"(HTTP 400, not retried: {message[:300]}); {cut}{budget}, or serve the judge with a longer context (vLLM --max-model-len)",
            request,
        )

    async def _one(self, request: JudgeRequest, seed: int) -> Verdict:
        """One verdict: asked, read (:func:`~.protocol.read_reply`, :func:`~.protocol.parse_verdict`), and asked
        again with the next seed while the reply is cut by the token budget or gives no verdict, up to
        ``parse_retries`` times (docs/grading.md#reading-a-verdict).

        Returns:
            the :class:`Verdict` with its ``reasks``; after the last re-ask an ``unparsed`` verdict whose ``failure``
            says why (``cut`` or ``unreadable``).

        Raises:
            GradingError: transport failure (:meth:`_complete`), a reply of an unsupported shape (tool call,
                refusal, ...), or every attempt cut by ``max_tokens`` before any verdict (the budget is too small for
                this judge: the message names the fix).
        """
        sent = JudgeRequest(request.question, cut_to_tokens(request.response, self.max_response_tokens),
                            request.criterion)
        messages = judge_messages(sent)
        where = f"judge {self.model!r} at {self.base_url}"
        answer, reply, cuts, cut = None, None, 0, False
        for attempt in range(self.parse_retries + 1):
            try:
                choice = await self._complete(messages, (seed + attempt) % 2**31)
            except GradingError as exc:
                if is_context_refusal(exc.__cause__):
                    raise self._context_error(exc, request) from exc.__cause__
                raise
            reply = read_reply(choice["message"], where=where)
            answer = reply.answer
            cut = choice.get("finish_reason") == "length"
            met = parse_verdict(answer, cut=cut)
            if met is not None:
                return Verdict("met" if met else "unmet", "judge", raw=answer, reasks=attempt)
            cuts += cut
        if cuts == self.parse_retries + 1:
            thinking = reply.shape.startswith("content null") or strip_reasoning(answer) is None
            raise GradingError(
                f"{where} was cut off by its token budget max_tokens={self.max_tokens} (finish_reason='length') "
                f"before giving a verdict{' (it was still reasoning)' if thinking else ''} in all "
                f"{cuts} attempts; it said {said(answer)} ({reply.shape}). A reasoning ('thinking') judge needs a "
                "larger budget (grader max_tokens, e.g. 2048; CLI --judge-max-tokens) or thinking switched off (grader "
                "chat_template_kwargs={'enable_thinking': false}; CLI --judge-chat-template-kwargs "
                "'{\"enable_thinking\": false}')"
            )
        return Verdict("unparsed", "judge", raw=answer, reasks=self.parse_retries,
                       failure="cut" if cut else "unreadable")

    async def ajudge(self, requests: Sequence[JudgeRequest], seeds: Sequence[int]) -> list[Verdict]:
        """Judge every request concurrently (bounded by ``max_concurrency``); verdicts in request order."""
        if len(requests) != len(seeds):
            raise ValueError(f"{len(requests)} requests but {len(seeds)} seeds")
        return list(await gather_or_cancel([self._one(r, int(s)) for r, s in zip(requests, seeds)]))

    async def aclose(self) -> None:
        """Close the HTTP client of the running event loop (its connections are released)."""
        loop = asyncio.get_running_loop()
        entry = self._clients.pop(id(loop), None)
        if entry is not None and entry[0] is loop:
            await entry[1].close()
