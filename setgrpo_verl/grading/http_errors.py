"""What an OpenAI-compatible judge server's HTTP answer says, for :mod:`~.http_judge`: which statuses are retried, a
body that is no chat completion, a refusal for a request longer than the judge's context
(:class:`JudgeContextError`), the server's own message and how long to wait before a request is sent again
(docs/grading.md#requests-in-flight).
"""

from __future__ import annotations

import json
import re

from .protocol import JudgeRequest
from .types import GradingError

__all__ = ["CONTEXT_TOKENS", "CONTEXT_WORDS", "RETRIED_STATUSES", "JudgeContextError", "backoff", "completion_choice",
           "is_context_refusal", "retry_after", "server_message"]

#: HTTP statuses the ``openai`` client retries (with backoff); any other 4xx is final (429 is handled apart).
RETRIED_STATUSES = (408, 409)
CONTEXT_WORDS = re.compile(r"context length|context window|max_model_len|maximum input length|prompt is too long|"
                            r"too many tokens|input is too long", re.IGNORECASE)
CONTEXT_TOKENS = re.compile(r"(?:context length|context window)[^0-9]{0,20}(\d+)", re.IGNORECASE)


class JudgeContextError(GradingError):
    """The judge server refused a request longer than its context; ``request`` is the
    :class:`~.protocol.JudgeRequest` (so that the grader can name the row)."""

    def __init__(self, message: str, request: JudgeRequest):
        super().__init__(message)
        self.request = request


def backoff(attempt: int) -> float:
    """Seconds before retry ``attempt`` (>= 1): the ``openai`` client's schedule, 0.5 s doubling, at most 8 s."""
    return min(0.5 * 2 ** (attempt - 1), 8.0)


def retry_after(exc, rounds: int) -> float:
    """Seconds before a request refused with HTTP 429 is sent again: the judge's ``Retry-After`` (seconds) or
    ``retry-after-ms`` when it gives one, else :func:`backoff`; at most 8 s. The in-flight limit, halved by the
    refusal, already sends fewer requests, so a judge's own hint is not stretched further."""
    headers = getattr(getattr(exc, "response", None), "headers", None) or {}
    for key, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            value = float(headers.get(key)) * scale
        except (TypeError, ValueError):
            continue
        if value >= 0:
            return min(value, 8.0)
    return backoff(rounds)


def completion_choice(body: str) -> tuple[dict | None, str]:
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


def server_message(exc) -> str:
    """The server's own message of an ``openai.APIStatusError`` (its ``message`` field when the body is JSON)."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return str(exc)


def is_context_refusal(exc) -> bool:
    """True for an HTTP 400 whose message says the request is longer than the model's context."""
    return getattr(exc, "status_code", None) == 400 and bool(CONTEXT_WORDS.search(server_message(exc)))
