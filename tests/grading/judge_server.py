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

from setgrpo_verl.grading.judges import JUDGE_USER_TEMPLATE, JudgeRequest

_USER_RE = re.compile(
    "^" + re.escape(JUDGE_USER_TEMPLATE).replace(re.escape("{question}"), "(?P<q>.*)")
    .replace(re.escape("{response}"), "(?P<r>.*)").replace(re.escape("{criterion}"), "(?P<c>.*)") + "$",
    re.DOTALL,
)
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
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self._chat)
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

    async def _chat(self, request: Request):
        body = await request.json()
        user = body["messages"][-1]["content"]
        m = _USER_RE.match(user)
        if m is None:
            return JSONResponse({"error": {"message": "not a judge prompt"}}, status_code=400)
        criterion = m.group("c")
        self.attempts[criterion] += 1
        attempt = self.attempts[criterion]
        self.in_flight += 1
        try:
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
            self.completed += 1
            return {
                "id": f"chatcmpl-{self.completed}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
            }
        finally:
            self.in_flight -= 1
