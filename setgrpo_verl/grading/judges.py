"""Rubric judges: decide one criterion for one response (yes/no), seeded.

Two judges share one versioned prompt protocol (:data:`JUDGE_TEMPLATE_VERSION`):

* :class:`OpenAIJudge` -- any OpenAI-compatible chat-completions server (vLLM, SGLang, a hosted API). Async with a
  concurrency limit; timeout and retries with exponential backoff on 408/409/429/5xx and connection errors are
  the ``openai`` client's own (``max_retries``, honours ``Retry-After``); an HTTP 200 whose body is not a chat
  completion (an HTML page, an empty body, an ``{"error": ...}`` payload, no choices) is a transport failure too,
  retried with the same budget and backoff, never read as an answer. Strict verdict parsing (after any
  ``<think>...</think>`` block, the answer must be exactly ``yes`` or ``no``, case-insensitive, optional final
  period); an unparseable answer is re-asked with the next seed up to ``parse_retries`` times, then it is an error
  (``on_unparsed="error"``) or an explicit ``unparsed`` verdict (``on_unparsed="unparsed"``, the default), never a
  silent 0. A reply cut off by the token budget (``finish_reason="length"``) before any verdict is an error that
  names ``max_tokens`` and ``chat_template_kwargs``: re-asking with the same budget would keep only the replies
  whose reasoning happened to be short.
* :class:`LocalHFJudge` -- a local Hugging Face causal LM (default: the embedded SmolLM2-135M-Instruct) for
  machines without a server. One forward pass gives the next-token distribution after the assistant header;
  ``P(yes) = sigmoid(LSE(l_yes / T) - LSE(l_no / T))`` over the single-token spellings of yes / no, and the
  verdict is drawn from Bernoulli(P(yes)) with a uniform from the request's seed (``T = 0``: argmax). Requests are
  batched (also across concurrent callers, e.g. verl's per-sample reward coroutines), the shared prefix
  (system + question + response) is run once per distinct response and its KV cache reused for every criterion,
  and P(yes) is cached by content so the second scoring of a response costs no forward pass (the sampling, not
  the network, is what differs between scorings -- exactly as for a sampled server judge).

Every judge exposes ``identity`` = ``{name, model, temperature, template_hash}`` for the calibration record
(docs/algorithm.md#7-record) and ``async ajudge(requests, seeds) -> list[Verdict]``; ``aclose()`` releases resources.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from .rubric import GradingError, Verdict

__all__ = [
    "JUDGE_SYSTEM_PROMPT",
    "JUDGE_TEMPLATE_VERSION",
    "JUDGE_USER_TEMPLATE",
    "JudgeRequest",
    "LocalHFJudge",
    "OpenAIJudge",
    "judge_messages",
    "parse_verdict",
    "strip_reasoning",
    "template_hash",
]

logger = logging.getLogger(__name__)

#: Version of the judge prompt protocol; bump when any text below changes (it enters ``template_hash``).
JUDGE_TEMPLATE_VERSION = "setgrpo-judge-v1"
JUDGE_SYSTEM_PROMPT = (
    "You are a strict grader. You decide whether a response meets one rubric criterion. "
    "Reply with exactly one word: yes or no."
)
# The criterion comes last so that everything before it is shared by all criteria of a response (local judge:
# computed once per response; HTTP servers with prefix caching profit the same way).
JUDGE_USER_TEMPLATE = (
    "Question:\n{question}\n\nResponse:\n{response}\n\n"
    "Does the response meet this criterion? Answer yes or no.\nCriterion: {criterion}"
)
_RESPONSE_SPLIT = "\n\nResponse:\n"
_CRITERION_SPLIT = "\nCriterion: "

_VERDICT_RE = re.compile(r"^\s*(yes|no)\s*\.?\s*$", re.IGNORECASE)
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
#: How many characters of a judge's reply error messages quote.
SAID_CHARS = 200


@dataclass(frozen=True)
class JudgeRequest:
    """One judge question: does ``response`` (to ``question``) meet ``criterion``?"""

    question: str
    response: str
    criterion: str


def template_hash(**protocol: Any) -> str:
    """sha256 (16 hex digits) of the judge protocol: template version, system and user templates, plus any
    protocol settings given as keyword arguments (e.g. truncation limits)."""
    payload = json.dumps(
        {"version": JUDGE_TEMPLATE_VERSION, "system": JUDGE_SYSTEM_PROMPT, "user": JUDGE_USER_TEMPLATE, **protocol},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def judge_messages(request: JudgeRequest) -> list[dict[str, str]]:
    """The chat messages (system + user) of the versioned judge prompt for one request."""
    user = JUDGE_USER_TEMPLATE.format(question=request.question, response=request.response, criterion=request.criterion)
    return [{"role": "system", "content": JUDGE_SYSTEM_PROMPT}, {"role": "user", "content": user}]


def strip_reasoning(text: str | None) -> str | None:
    """The answer part of a judge reply: the text after the last ``</think>``, or the whole text when there is no
    thinking block; ``None`` when a ``<think>`` block is never closed (the reply stopped while reasoning).

    A closing tag without an opening one is handled too: some chat templates put ``<think>`` into the prompt, so the
    reply starts inside the reasoning."""
    if text is None:
        return None
    low = text.lower()
    close = low.rfind(_THINK_CLOSE)
    if close >= 0:
        return text[close + len(_THINK_CLOSE):]
    if _THINK_OPEN in low:
        return None
    return text


def parse_verdict(text: str | None) -> bool | None:
    """Strict verdict parsing: ``True`` for ``yes``, ``False`` for ``no`` (case-insensitive, surrounding whitespace
    and one final period allowed), ``None`` for anything else. A reasoning block ``<think>...</think>`` before the
    answer is skipped (:func:`strip_reasoning`); an unclosed one gives ``None``."""
    answer = strip_reasoning(text)
    if answer is None:
        return None
    m = _VERDICT_RE.match(answer)
    return None if m is None else m.group(1).lower() == "yes"


def _said(text: str | None) -> str:
    """The start of what a judge said, for error messages."""
    if text is None:
        return "nothing (no content)"
    return repr(text[:SAID_CHARS]) + (f" ... ({len(text)} characters)" if len(text) > SAID_CHARS else "")


def _completion_choice(body: str) -> tuple[dict | None, str]:
    """The first choice of a chat-completion JSON body, or ``(None, what the body is instead)``."""
    if not body.strip():
        return None, "an empty body"
    try:
        data = json.loads(body)
    except ValueError:
        return None, "a body that is not JSON"
    if not isinstance(data, dict):
        return None, f"a JSON {type(data).__name__} instead of a chat completion"
    if data.get("error") is not None:
        err = data["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        return None, f"an error payload instead of a chat completion (server message: {msg!r})"
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None, "a JSON object without choices"
    if not isinstance(choices[0].get("message"), dict):
        return None, "a choice without a message"
    return choices[0], ""


def _reply_text(message: dict) -> str | None:
    """The judge's reply as one text: a reasoning field that a server-side reasoning parser split off
    (``reasoning_content`` / ``reasoning``) is put back in front inside ``<think>`` tags, closed only when the
    server went on to an answer, so that :func:`parse_verdict` reads both server flavours alike."""
    content = message.get("content")
    content = content if isinstance(content, str) else None
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if not isinstance(reasoning, str) or not reasoning:
        return content
    return f"{_THINK_OPEN}{reasoning}" + (f"{_THINK_CLOSE}{content}" if content else "")


async def _gather_or_cancel(coros):
    """asyncio.gather that cancels (and awaits) the remaining tasks when one fails: nothing is left in flight."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


# --------------------------------------------------------------------------------------------------- HTTP judge
class OpenAIJudge:
    """Judge backed by an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    Args:
        base_url: server URL including ``/v1`` (e.g. ``http://127.0.0.1:8000/v1`` for vLLM / SGLang).
        model: model name sent in each request.
        api_key: API key; ``None`` reads ``$OPENAI_API_KEY`` and falls back to ``"EMPTY"`` (local servers).
        temperature: sampling temperature sent to the server (enters the identity).
        max_tokens: completion token budget per verdict (enters the identity). A verdict is one word, so the
            default 4 suits instruction judges; a reasoning ("thinking") judge needs room for its reasoning too
            (e.g. 2048), or thinking switched off with ``chat_template_kwargs``.
        chat_template_kwargs: sent as the request's ``chat_template_kwargs`` (vLLM / SGLang pass them to the chat
            template), e.g. ``{"enable_thinking": False}`` for Qwen3; ``None`` sends nothing. Enters the identity.
        max_concurrency: at most this many requests in flight (per event loop).
        timeout: seconds per request attempt (``openai`` client timeout).
        max_retries: retries per request on timeouts, connection errors, 408/409/429/5xx, with the client's
            exponential backoff (0.5 s doubling, at most 8 s, ``Retry-After`` honoured); separately, as many
            retries (same backoff) for HTTP 200 bodies that are not a chat completion.
        parse_retries: how many times an unparseable answer is re-asked (with seed + attempt).
        on_unparsed: ``"unparsed"`` (explicit ``unparsed`` verdict, excluded from the score and counted in the
            metrics) or ``"error"`` (raise :class:`GradingError`).

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
        max_tokens: int = 4,
        chat_template_kwargs: dict | None = None,
        max_concurrency: int = 32,
        timeout: float = 60.0,
        max_retries: int = 4,
        parse_retries: int = 2,
        on_unparsed: str = "unparsed",
    ):
        if on_unparsed not in ("unparsed", "error"):
            raise ValueError(f"on_unparsed must be 'unparsed' or 'error', got {on_unparsed!r}")
        if max_concurrency < 1 or timeout <= 0 or max_retries < 0 or parse_retries < 0 or int(max_tokens) < 1:
            raise ValueError("need max_tokens >= 1, max_concurrency >= 1, timeout > 0, max_retries >= 0 and "
                             "parse_retries >= 0")
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
        self.on_unparsed = on_unparsed
        self._clients: dict[int, tuple[Any, Any, asyncio.Semaphore]] = {}  # id(loop) -> (loop, client, semaphore)

    @property
    def identity(self) -> dict:
        """``{name, model, temperature, template_hash}`` (docs/algorithm.md#7-record)."""
        return self.identity_for(model=self.model, temperature=self.temperature, max_tokens=self.max_tokens,
                                 chat_template_kwargs=self.chat_template_kwargs)

    @classmethod
    def identity_for(cls, *, model: str, temperature: float, max_tokens: int, chat_template_kwargs: dict | None = None,
                     **_) -> dict:
        """The identity a judge with these settings reports (no client is created). ``chat_template_kwargs``
        changes what the judge model is asked, so it enters ``template_hash`` (only when given: the hash of a
        judge without it is unchanged)."""
        protocol: dict[str, Any] = {"max_tokens": int(max_tokens)}
        if chat_template_kwargs:
            protocol["chat_template_kwargs"] = dict(chat_template_kwargs)
        return {"name": cls.name, "model": model, "temperature": float(temperature),
                "template_hash": template_hash(**protocol)}

    def _client(self):
        from openai import AsyncOpenAI

        loop = asyncio.get_running_loop()
        entry = self._clients.get(id(loop))
        if entry is None or entry[0] is not loop:
            client = AsyncOpenAI(
                base_url=self.base_url, api_key=self.api_key, timeout=self.timeout, max_retries=self.max_retries
            )
            entry = (loop, client, asyncio.Semaphore(self.max_concurrency))
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

        client, semaphore = self._client()
        extra = {"chat_template_kwargs": self.chat_template_kwargs} if self.chat_template_kwargs else None
        url, status, body, what = f"{self.base_url.rstrip('/')}/chat/completions", None, "", ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            try:
                async with semaphore:
                    raw = await client.chat.completions.with_raw_response.create(
                        model=self.model,
                        messages=messages,
                        temperature=self.temperature,
                        max_tokens=self.max_tokens,
                        seed=seed,
                        extra_body=extra,
                    )
            except openai.APIError as exc:
                hint = ("the server cannot be reached: start the OpenAI-compatible server or fix the base URL "
                        "(it ends in /v1)" if isinstance(exc, openai.APIConnectionError) else
                        "the server answered with an error: check the model name and the server's log")
                raise GradingError(
                    f"judge request to {self.base_url} failed after {self.max_retries} retries "
                    f"(timeout {self.timeout}s per attempt): {type(exc).__name__}: {exc}; {hint}"
                ) from exc
            response = raw.http_response
            url, status, body = str(response.url), response.status_code, response.text
            choice, what = _completion_choice(body)
            if choice is not None:
                return choice
        raise GradingError(
            f"judge request to {url} got HTTP {status} with {what} after {self.max_retries} retries; the body "
            f"starts {body[:SAID_CHARS]!r}. Check that the URL is the server's OpenAI-compatible /v1 endpoint (no "
            "proxy error page in between) and that the server is healthy"
        )

    async def _one(self, request: JudgeRequest, seed: int) -> Verdict:
        messages = judge_messages(request)
        text = None
        for attempt in range(self.parse_retries + 1):
            choice = await self._complete(messages, (seed + attempt) % 2**31)
            text = _reply_text(choice["message"])
            met = parse_verdict(text)
            if met is not None:
                return Verdict("met" if met else "unmet", "judge", raw=text)
            if choice.get("finish_reason") == "length":
                thinking = strip_reasoning(text) is None
                raise GradingError(
                    f"judge {self.model!r} at {self.base_url} was cut off by its token budget max_tokens="
                    f"{self.max_tokens} (finish_reason='length') before giving a verdict"
                    f"{' (it was still reasoning)' if thinking else ''}; it said {_said(text)}. A reasoning "
                    "('thinking') judge needs a larger budget (grader max_tokens, e.g. 2048; CLI --judge-max-tokens) "
                    "or thinking switched off (grader chat_template_kwargs={'enable_thinking': false}; CLI "
                    "--judge-chat-template-kwargs '{\"enable_thinking\": false}')"
                )
        if self.on_unparsed == "error":
            raise GradingError(
                f"judge {self.model!r} at {self.base_url} gave an unparseable verdict after {self.parse_retries} re-asks "
                f"(expected 'yes' or 'no' after any <think> block); it said {_said(text)}. Use "
                "on_unparsed='unparsed' to record such answers"
            )
        return Verdict("unparsed", "judge", raw=text)

    async def ajudge(self, requests: Sequence[JudgeRequest], seeds: Sequence[int]) -> list[Verdict]:
        """Judge every request concurrently (bounded by ``max_concurrency``); verdicts in request order."""
        if len(requests) != len(seeds):
            raise ValueError(f"{len(requests)} requests but {len(seeds)} seeds")
        return list(await _gather_or_cancel([self._one(r, int(s)) for r, s in zip(requests, seeds)]))

    async def aclose(self) -> None:
        """Close the HTTP client of the running event loop (its connections are released)."""
        loop = asyncio.get_running_loop()
        entry = self._clients.pop(id(loop), None)
        if entry is not None and entry[0] is loop:
            await entry[1].close()


# --------------------------------------------------------------------------------------------------- local judge
_YES = ("yes", "Yes", "YES", " yes", " Yes", " YES")
_NO = ("no", "No", "NO", " no", " No", " NO")


class LocalHFJudge:
    """Judge backed by a local Hugging Face causal LM; verdicts sampled from its yes/no next-token probabilities.

    Args:
        model_path: local HF model directory, or ``None`` for the embedded SmolLM2-135M-Instruct
            (:func:`setgrpo_verl.models.load_causal_lm`).
        temperature: ``T`` in ``P(yes) = sigmoid(LSE(l_yes/T) - LSE(l_no/T))``; ``0`` = deterministic argmax.
        batch_size: distinct questions / responses per forward pass; criteria run in batches of
            ``4 * batch_size`` against the cached prefix.
        max_question_tokens / max_response_tokens: the question and the response are cut to this many tokens
            (head kept) before rendering -- part of the protocol, so they enter ``template_hash``.
        dtype: model dtype (float32 default).
        cache_size: number of P(yes) values kept (content-keyed LRU).
        max_wait_s: how long the async batcher waits to collect requests from concurrent callers.

    Shapes: the prompt is cut into three token segments, (system + question) ``[Bq, Lq]``, response ``[Br, Lr]`` and
    criterion ``[Bc, Lc]`` (each right-padded); each level runs once per distinct prefix against the KV cache of its
    parent rows (padding holes masked, positions continuing from the real length); only the last real position of
    the criterion segment goes through the LM head.
    """

    name = "local_hf"

    def __init__(
        self,
        model_path: str | None = None,
        *,
        temperature: float = 1.0,
        batch_size: int = 16,
        max_question_tokens: int = 256,
        max_response_tokens: int = 384,
        dtype: torch.dtype = torch.float32,
        cache_size: int = 65536,
        max_wait_s: float = 0.02,
    ):
        from ..models import EMBEDDED_MODEL_NAME, load_causal_lm

        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if batch_size < 1 or max_question_tokens < 1 or max_response_tokens < 1:
            raise ValueError("batch_size, max_question_tokens and max_response_tokens must be >= 1")
        self.model_path = model_path
        self.model_name = EMBEDDED_MODEL_NAME if model_path is None else os.path.abspath(str(model_path))
        self.temperature = float(temperature)
        self.batch_size = int(batch_size)
        self.max_question_tokens = int(max_question_tokens)
        self.max_response_tokens = int(max_response_tokens)
        self.model, self.tokenizer = load_causal_lm(model_path, dtype=dtype)
        self._yes_ids = self._single_token_ids(_YES)
        self._no_ids = self._single_token_ids(_NO)
        if not self._yes_ids or not self._no_ids:
            raise ValueError(f"{self.model_name}: no single-token spelling of yes/no in its vocabulary")
        self._cache: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._cache_size = int(cache_size)
        self._lock = threading.Lock()  # one forward at a time (the model is shared; torch uses all cores anyway)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="setgrpo-judge")
        self._max_wait_s = float(max_wait_s)
        # id(loop) -> (loop, pending [(requests, future)], [drainer task]): one batcher per event loop
        self._batchers: dict[int, tuple[asyncio.AbstractEventLoop, list, list]] = {}

    def _single_token_ids(self, words) -> list[int]:
        ids = set()
        for w in words:
            toks = self.tokenizer.encode(w, add_special_tokens=False)
            if len(toks) == 1:
                ids.add(toks[0])
        return sorted(ids)

    @property
    def identity(self) -> dict:
        """``{name, model, temperature, template_hash}`` (docs/algorithm.md#7-record)."""
        return self.identity_for(model_path=self.model_path, temperature=self.temperature,
                                 max_question_tokens=self.max_question_tokens,
                                 max_response_tokens=self.max_response_tokens)

    @classmethod
    def identity_for(cls, *, model_path: str | None, temperature: float, max_question_tokens: int,
                     max_response_tokens: int, **_) -> dict:
        """The identity a judge with these settings reports (the model is not loaded)."""
        from ..models import EMBEDDED_MODEL_NAME

        return {
            "name": cls.name,
            "model": EMBEDDED_MODEL_NAME if model_path is None else os.path.abspath(str(model_path)),
            "temperature": float(temperature),
            "template_hash": template_hash(max_question_tokens=int(max_question_tokens),
                                           max_response_tokens=int(max_response_tokens)),
        }

    # ---------------------------------------------------------------- probabilities
    @staticmethod
    def _key(r: JudgeRequest) -> str:
        return hashlib.sha256(json.dumps([r.question, r.response, r.criterion]).encode()).hexdigest()

    def _truncate(self, text: str, limit: int) -> str:
        """``text`` cut to its first ``limit`` tokens (unchanged if shorter)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= limit else self.tokenizer.decode(ids[:limit])

    def _segments(self, r: JudgeRequest) -> tuple[str, str, str]:
        """The chat-templated judge prompt cut into (system + question, response, criterion + generation header):
        the first segment is shared by all responses to a question, the first two by all criteria of a response."""
        sent_r, sent_c = "\u241fSETGRPO_RESPONSE\u241f", "\u241fSETGRPO_CRITERION\u241f"
        req = JudgeRequest(self._truncate(r.question, self.max_question_tokens), sent_r, sent_c)
        text = self.tokenizer.apply_chat_template(judge_messages(req), tokenize=False, add_generation_prompt=True)
        cut_r = text.rfind(_RESPONSE_SPLIT + sent_r)
        cut_c = text.rfind(_CRITERION_SPLIT + sent_c)
        if cut_r < 0 or cut_c < cut_r:  # pragma: no cover - a chat template that rewrites the user message
            raise GradingError(f"{self.model_name}: the chat template altered the judge prompt; cannot split it")
        response = self._truncate(r.response, self.max_response_tokens)
        return (
            text[:cut_r],
            text[cut_r:cut_c].replace(sent_r, response),
            text[cut_c:].replace(sent_c, r.criterion),
        )

    def p_yes(self, requests: Sequence[JudgeRequest]) -> np.ndarray:
        """P(yes) at the judge temperature for each request (float64 ``[len(requests)]``), batched and cached.

        ``T = 0`` returns 1.0 / 0.0 / 0.5 (argmax; ties 0.5)."""
        keys = [self._key(r) for r in requests]
        with self._lock:
            todo: dict[str, JudgeRequest] = {}
            for k, r in zip(keys, requests):
                if k not in self._cache and k not in todo:
                    todo[k] = r
            if todo:
                margins = self._margins(list(todo.values()))
                for k, m in zip(todo, margins):
                    self._cache[k] = float(m)
            out = np.empty(len(keys), dtype=np.float64)
            for i, k in enumerate(keys):
                self._cache.move_to_end(k)
                out[i] = self._cache[k]
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        # cached values are the log-odds margins at the judge temperature (T = 0: at T = 1, thresholded)
        if self.temperature == 0:
            return np.where(out > 0, 1.0, np.where(out < 0, 0.0, 0.5))
        return 1.0 / (1.0 + np.exp(-out))

    def _extend(self, parent, rows: list[int], segments: list[list[int]]):
        """Run token ``segments`` (right-padded ``[n, L]``) after the cached rows ``rows`` of ``parent``.

        ``parent`` is ``None`` or ``(layers, mask [Bp, Lp], lengths [Bp])``; padding holes stay masked and positions
        continue from each parent's real length. Returns ``((layers, mask, lengths), last_hidden [n, L, H], seg_len)``.
        """
        from transformers import DynamicCache

        n, width = len(segments), max(len(t) for t in segments)
        ids = torch.full((n, width), self.tokenizer.pad_token_id, dtype=torch.long)
        seg_mask = torch.zeros((n, width), dtype=torch.long)
        seg_len = torch.tensor([len(t) for t in segments])
        for i, toks in enumerate(segments):
            ids[i, : len(toks)] = torch.tensor(toks)
            seg_mask[i, : len(toks)] = 1
        if parent is None:
            cache, mask, base = None, seg_mask, torch.zeros(n, dtype=torch.long)
        else:
            layers, parent_mask, parent_len = parent
            idx = torch.tensor(rows)
            cache = DynamicCache(ddp_cache_data=[(k.index_select(0, idx), v.index_select(0, idx)) for k, v in layers])
            mask = torch.cat([parent_mask.index_select(0, idx), seg_mask], dim=1)
            base = parent_len.index_select(0, idx)
        out = self.model.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=base.unsqueeze(1) + torch.arange(width).unsqueeze(0),
            past_key_values=cache,
            use_cache=True,
        )
        layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return (layers, mask, base + seg_len), out.last_hidden_state, seg_len

    @torch.inference_mode()
    def _margins(self, requests: list[JudgeRequest]) -> list[float]:
        """``LSE(l_yes / T) - LSE(l_no / T)`` per request (log-odds of yes at the judge temperature; T = 0 uses 1).

        Three-level prefix sharing: (system + question) once per distinct question, the response once per distinct
        (question, response), then every criterion against that cache; only the last position hits the LM head."""
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        tree: dict[str, dict[str, list[tuple[int, str]]]] = {}
        for i, r in enumerate(requests):
            a, b, c = self._segments(r)
            tree.setdefault(a, {}).setdefault(b, []).append((i, c))
        temp = self.temperature if self.temperature > 0 else 1.0
        yes, no = torch.tensor(self._yes_ids), torch.tensor(self._no_ids)
        out = [0.0] * len(requests)
        bs = self.batch_size
        questions = sorted(tree, key=len)
        for qa in range(0, len(questions), bs):
            q_chunk = questions[qa : qa + bs]
            q_state, _, _ = self._extend(None, [], [encode(q) for q in q_chunk])
            responses = [(row, b) for row, q in enumerate(q_chunk) for b in sorted(tree[q], key=len)]
            for rb in range(0, len(responses), bs):
                r_chunk = responses[rb : rb + bs]
                r_state, _, _ = self._extend(q_state, [row for row, _ in r_chunk], [encode(b) for _, b in r_chunk])
                leaves = [(row, i, c) for row, (qrow, b) in enumerate(r_chunk) for i, c in tree[q_chunk[qrow]][b]]
                for lc in range(0, len(leaves), 4 * bs):
                    l_chunk = leaves[lc : lc + 4 * bs]
                    _, hidden, seg_len = self._extend(r_state, [row for row, _, _ in l_chunk], [encode(c) for _, _, c in l_chunk])
                    last = hidden[torch.arange(len(l_chunk)), seg_len - 1]
                    logits = self.model.lm_head(last).float() / temp
                    margin = torch.logsumexp(logits[:, yes], -1) - torch.logsumexp(logits[:, no], -1)
                    for k, (_, i, _) in enumerate(l_chunk):
                        out[i] = float(margin[k])
        return out

    # ---------------------------------------------------------------- async interface
    async def _drain(self, pending: list) -> None:
        loop = asyncio.get_running_loop()
        while pending:
            await asyncio.sleep(self._max_wait_s)
            batch = pending[:]
            del pending[:]
            flat = [r for reqs, _ in batch for r in reqs]
            try:
                probs = await loop.run_in_executor(self._executor, self.p_yes, flat)
            except BaseException as exc:  # noqa: BLE001 - handed to every waiter
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            offset = 0
            for reqs, fut in batch:
                if not fut.done():
                    fut.set_result(probs[offset : offset + len(reqs)])
                offset += len(reqs)

    async def ap_yes(self, requests: Sequence[JudgeRequest]) -> np.ndarray:
        """Async :meth:`p_yes`: requests from concurrent callers on one event loop are merged into shared batches
        (collected for ``max_wait_s``, or while the previous batch runs)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        state = self._batchers.get(id(loop))
        if state is None or state[0] is not loop:
            state = (loop, [], [None])
            self._batchers[id(loop)] = state
        _, pending, drainer = state
        pending.append((list(requests), fut))
        if drainer[0] is None or drainer[0].done():
            drainer[0] = loop.create_task(self._drain(pending))
        return await fut

    async def ajudge(self, requests: Sequence[JudgeRequest], seeds: Sequence[int]) -> list[Verdict]:
        """Verdicts drawn from Bernoulli(P(yes)) with ``numpy.random.default_rng(seed).random()`` per request."""
        if len(requests) != len(seeds):
            raise ValueError(f"{len(requests)} requests but {len(seeds)} seeds")
        if not requests:
            return []
        probs = await self.ap_yes(requests)
        verdicts = []
        for p, seed in zip(probs, seeds):
            u = np.random.default_rng(int(seed)).random()
            verdicts.append(Verdict("met" if u < p else "unmet", "judge", p_yes=float(p)))
        return verdicts

    async def aclose(self) -> None:
        """Forget this event loop's batcher (the model stays loaded)."""
        self._batchers.pop(id(asyncio.get_running_loop()), None)
