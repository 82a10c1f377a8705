"""A real OpenAI-compatible chat-completions server for the HTTP judge tests (FastAPI + uvicorn, 127.0.0.1).

Answers come from the local SmolLM2 judge (verdict sampled from P(yes) with the request's seed). Faults are
injected by markers in the criterion text (the user message):

* ``[[slow]]``        - hold the request until the client disconnects (or 30 s);
* ``[[429xN]]``       - the first N attempts get 429 with ``Retry-After: 0.05``;
* ``[[500xN]]``       - the first N attempts get 500;
* ``[[garbage]]``     - always answer an unparseable sentence;
* ``[[garbage-once]]`` - the first attempt is unparseable, later ones are judged normally;
* ``[[htmlxN]]``, ``[[emptyxN]]``, ``[[error-payloadxN]]`` - the first N attempts get HTTP 200 with, instead of a
  chat completion, a proxy's HTML error page, an empty body, or an ``{"error": {...}}`` payload.

Besides the plain route ``/v1`` (an instruction judge that answers one word), two routes emulate a reasoning
("thinking", Qwen3-style) judge behind vLLM: ``/reasoning-parser-on/v1`` (the server splits the reasoning off into
``reasoning_content``) and ``/reasoning-parser-off/v1`` (the reply text holds ``<think>...</think>``). Such a judge
generates :data:`THINKING` tokens (one token per word, the tags one token each) before ``\n\n`` and its verdict,
unless the request's ``chat_template_kwargs`` has ``enable_thinking: false``; a reply longer than the request's
``max_tokens`` is cut there with ``finish_reason="length"``. The verdict is the same seeded draw as on the plain
route, so a thinking judge with a large enough budget gives exactly the plain judge's verdicts.

The routes of :data:`SHAPES` (``/shape-content-parts/v1``, ...) give the plain route's verdict in another reply shape
of OpenAI-compatible servers. The route ``/ctx-<N>/v1`` is a judge whose context holds ``N`` characters: a longer
user message gets vLLM's HTTP 400 "maximum context length"; the route ``/limit-<N>/v1`` is a judge that allows ``N``
requests in flight (each held 20 ms) and refuses the surplus with HTTP 429 and ``Retry-After: 0.05``, as a hosted
judge's concurrency limit does (``refused`` counts them, ``peak`` is the most requests in flight); a marker ``[[lang:<code>]]`` in the criterion makes the judge answer in that language
(:data:`ANSWERS`).
"""

from __future__ import annotations

import asyncio
import collections
import re
import socket
import threading
import time

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from setgrpo_verl.grading.protocol import JUDGE_USER_TEMPLATE, JudgeRequest

_USER_RE = re.compile(
    "^" + re.escape(JUDGE_USER_TEMPLATE).replace(re.escape("{question}"), "(?P<q>.*)")
    .replace(re.escape("{response}"), "(?P<r>.*)").replace(re.escape("{criterion}"), "(?P<c>.*)") + "$",
    re.DOTALL,
)
#: The reasoning a thinking judge emits before its verdict (24 words).
THINKING = ("Okay, let me check whether the response meets the criterion. I will compare what it says with what the "
            "criterion asks and then decide.")
_BAD_BODIES = {
    "html": (b"<html><body><h1>502 Bad Gateway</h1>nginx</body></html>", "text/html"),
    "empty": (b"", "application/json"),
    "error-payload": (b'{"error": {"message": "injected overload", "type": "overloaded", "code": 503}}',
                      "application/json"),
}


class JudgeServer:
    def __init__(self, judge):
        self.judge = judge
        self.attempts: collections.Counter = collections.Counter()
        self.in_flight = 0
        self.completed = 0
        self.refused = 0
        self.peak = 0
        self.app = FastAPI()
        self.requests: list[dict] = []  # every request body, in arrival order
        self.app.post("/v1/chat/completions")(self._chat)
        self.app.post("/{flavour}/v1/chat/completions")(self._chat)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self):
        self._thread.start()
        deadline = time.time() + 30
        while not self._server.started:
            if time.time() > deadline:
                raise RuntimeError("judge server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def wait_idle(self, timeout: float = 5.0) -> bool:
        deadline = time.time() + timeout
        while self.in_flight and time.time() < deadline:
            time.sleep(0.02)
        return self.in_flight == 0

    async def _chat(self, request: Request, flavour: str | None = None):
        body = await request.json()
        self.requests.append(body)
        context = re.fullmatch(r"ctx-(\d+)", flavour or "")
        limit = re.fullmatch(r"limit-(\d+)", flavour or "")
        if context or limit:
            flavour = None
        if flavour not in (None, "reasoning-parser-on", "reasoning-parser-off") and flavour not in SHAPES:
            return JSONResponse({"error": {"message": f"no route {flavour}"}}, status_code=404)
        user = body["messages"][-1]["content"]
        if context and len(user) > int(context.group(1)):
            return JSONResponse({"object": "error", "type": "BadRequestError", "code": 400, "message": (
                f"This model's maximum context length is {int(context.group(1)) // 4} tokens. However, you requested "
                f"{len(user) // 4 + 4} tokens. Please reduce the length of the messages or completion.")},
                status_code=400)
        m = _USER_RE.match(user)
        if m is None:
            return JSONResponse({"error": {"message": "not a judge prompt"}}, status_code=400)
        criterion = m.group("c")
        self.attempts[criterion] += 1
        attempt = self.attempts[criterion]
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if limit:
                await asyncio.sleep(0.02)
                if self.in_flight > int(limit.group(1)):
                    self.refused += 1
                    return JSONResponse({"error": {"message": "Too many concurrent requests"}}, status_code=429,
                                        headers={"retry-after": "0.05"})
            if "[[slow]]" in criterion:
                for _ in range(600):
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)
                    await asyncio.sleep(0.05)
            for code in (429, 500):
                hit = re.search(rf"\[\[{code}x(\d+)\]\]", criterion)
                if hit and attempt <= int(hit.group(1)):
                    headers = {"retry-after": "0.05"} if code == 429 else {}
                    return JSONResponse({"error": {"message": f"injected {code}"}}, status_code=code, headers=headers)
            for kind, (content, media_type) in _BAD_BODIES.items():
                hit = re.search(rf"\[\[{kind}x(\d+)\]\]", criterion)
                if hit and attempt <= int(hit.group(1)):
                    return Response(content=content, status_code=200, media_type=media_type)
            if "[[garbage]]" in criterion or ("[[garbage-once]]" in criterion and attempt == 1):
                text = "Well, it depends on how you look at it."
            else:
                req = JudgeRequest(m.group("q"), m.group("r"), criterion)
                p = float((await self.judge.ap_yes([req]))[0])
                u = np.random.default_rng(int(body.get("seed") or 0)).random()
                text = "yes" if u < p else "no"
                lang = re.search(r"\[\[lang:(\w+)\]\]", criterion)
                if lang:
                    text = ANSWERS[lang.group(1)][text == "yes"]
            message, finish, n_tokens = {"role": "assistant", "content": text}, "stop", 1
            if flavour in SHAPES:
                message, finish = SHAPES[flavour](text)
            elif flavour is not None:
                message, finish, n_tokens = _thinking_reply(text, body, parser=flavour == "reasoning-parser-on")
            self.completed += 1
            return {
                "id": f"chatcmpl-{self.completed}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 0, "completion_tokens": n_tokens, "total_tokens": n_tokens},
            }
        finally:
            self.in_flight -= 1


#: ``[[lang:<code>]]`` in a criterion: the judge answers in that language, ``(no, yes)``; ``tlh`` (Klingon) is a
#: language whose words the product does not read.
ANSWERS = {
    "es": ("No", "Sí"), "zh": ("否", "是"), "de": ("Nein.", "Ja."), "fr": ("non", "OUI"), "pt": ("Não", "Sim"),
    "ru": ("Нет", "Да"), "ja": ("いいえ", "はい"), "it": ("No", "Sì"), "tlh": ("ghobe'", "HIja'"),
}

#: Routes ``/<shape>/v1``: the plain verdict ``text`` in another OpenAI-compatible reply shape -> (message, finish).
SHAPES = {
    "shape-content-parts": lambda t: ({"role": "assistant", "content": [{"type": "text", "text": t}]}, "stop"),
    "shape-reasoning-content": lambda t: ({"role": "assistant", "content": None, "reasoning_content": t,
                                           "tool_calls": []}, "stop"),
    "shape-reasoning": lambda t: ({"role": "assistant", "content": None, "reasoning": t}, "stop"),
    "shape-reasoning-and-content": lambda t: ({"role": "assistant", "content": t,
                                               "reasoning": "The criterion asks one thing; I check it."}, "stop"),
    "shape-tool-call": lambda t: ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "verdict", "arguments": f'{{"met": "{t}"}}'}}]},
        "tool_calls"),
    "shape-refusal": lambda t: ({"role": "assistant", "content": None, "refusal": "I can't help with that."},
                                "stop"),
    "shape-image-part": lambda t: ({"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}, "stop"),
}


def _thinking_reply(verdict: str, body: dict, *, parser: bool) -> tuple[dict, str, int]:
    """(message, finish_reason, completion tokens) of a Qwen3-style thinking judge whose answer is ``verdict``."""
    thinking = (body.get("chat_template_kwargs") or {}).get("enable_thinking", True)
    tokens = ["<think>\n"] + [w + " " for w in THINKING.split()] + ["\n</think>", "\n\n"] if thinking else []
    tokens.append(verdict)
    budget = body.get("max_tokens") or len(tokens)
    finish = "length" if len(tokens) > budget else "stop"
    text = "".join(tokens[:budget])
    if not parser:
        return {"role": "assistant", "content": text}, finish, min(budget, len(tokens))
    # vLLM's reasoning parser: what lies inside <think> goes to reasoning_content, the rest (if any) to content
    reasoning, content = None, text
    if text.startswith("<think>"):
        inner, closed, after = text[len("<think>"):].partition("</think>")
        reasoning, content = inner, (after if closed else "")
    message = {"role": "assistant", "content": content or None, "reasoning_content": reasoning}
    return message, finish, min(budget, len(tokens))
