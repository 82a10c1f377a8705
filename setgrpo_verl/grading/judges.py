"""Rubric judges: decide one criterion for one response (yes/no), seeded.

The judges live in three modules, one job each; this module gathers their public names:

* :mod:`.protocol` -- the versioned judge prompt, the reply shapes read and the verdict vocabulary
  (docs/grading.md#unparsed-verdicts);
* :mod:`.http_judge` -- :class:`OpenAIJudge`, any OpenAI-compatible chat-completions server;
* :mod:`.local_judge` -- :class:`LocalHFJudge`, a local Hugging Face causal LM (default: the embedded
  SmolLM2-135M-Instruct).

Every judge exposes ``identity`` = ``{name, model, temperature, template_hash}`` for the calibration record
(docs/algorithm.md#7-record) and ``async ajudge(requests, seeds) -> list[Verdict]``; ``aclose()`` releases resources.
"""

from __future__ import annotations

from .http_judge import OpenAIJudge
from .local_judge import LocalHFJudge
from .protocol import (
    JUDGE_SYSTEM_PROMPT,
    JUDGE_TEMPLATE_VERSION,
    JUDGE_USER_TEMPLATE,
    VERDICT_WORDS,
    JudgeReply,
    JudgeRequest,
    judge_messages,
    parse_verdict,
    read_reply,
    strip_reasoning,
    template_hash,
)

__all__ = [
    "JUDGE_SYSTEM_PROMPT",
    "JUDGE_TEMPLATE_VERSION",
    "JUDGE_USER_TEMPLATE",
    "VERDICT_WORDS",
    "JudgeReply",
    "JudgeRequest",
    "LocalHFJudge",
    "OpenAIJudge",
    "judge_messages",
    "parse_verdict",
    "read_reply",
    "strip_reasoning",
    "template_hash",
]
