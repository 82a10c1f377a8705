"""What of a policy response is graded: the answer after its thinking block, or the full text
(docs/grading.md#thinking-policies).

A thinking policy (Qwen3, Qwen3.5 with thinking on) writes ``<think>reasoning</think>answer``. The judge and the rule
checkers grade the answer by default (:data:`DEFAULT_RESPONSE_PART`): the text after the last ``</think>``, leading
whitespace dropped (the chat template's separator). A response without thinking tags is graded whole. A response whose
thinking block never closes (the rollout's ``max_response_length`` ran out while it reasoned) has no answer: it is
graded as the empty answer, by the same grader as every other response, and counted
(:class:`~.dual.DualScorer` applies the rule and marks such responses in ``DualScores.no_answer``; the reward manager
reports their share of a batch as ``setgrpo/grading/no_answer_ratio``).

Reasoning markers that are special tokens, which a decode without special tokens loses with the boundary they mark
(gpt-oss's harmony channels ``<|channel|>analysis<|message|>...<|channel|>final<|message|>answer``, Magistral's
``[THINK]...[/THINK]``, Seed's ``<seed:think>...</seed:think>``), are read from a decode that keeps special tokens and
spelled as ``<think>`` / ``</think>`` before the other special tokens are removed (:func:`visible_response`), so
those policies are graded on their answer too, and a response cut inside its reasoning has no answer.

``response: full`` on the grader config grades the whole text instead, reasoning included (what this package did
before); it enters the grader identity, so a record calibrated one way is refused for a run graded the other way.
"""

from __future__ import annotations

from typing import Any, Mapping

from .protocol import REASONING_MARKERS, strip_reasoning, template_hash

__all__ = ["DEFAULT_RESPONSE_PART", "REASONING_MARKERS", "RESPONSE_PARTS", "check_response_part", "graded_text",
           "prompt_opens_thinking", "split_response_part", "visible_response", "with_response_part"]

#: The grader config key (``reward.reward_kwargs.grader.response``) and its values.
RESPONSE_PARTS = ("answer", "full")
DEFAULT_RESPONSE_PART = "answer"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: gpt-oss's harmony format: a message's channel, then its text; the ``final`` channel is the answer.
_CHANNEL, _FINAL = "<|channel|>", "<|channel|>final<|message|>"


def visible_response(text: str, special_tokens: Any = ()) -> str:
    """A response decoded with its special tokens (``skip_special_tokens=False``), with its reasoning block spelled
    ``<think>...</think>`` (:data:`REASONING_MARKERS`; harmony: everything before the last ``final`` channel is
    reasoning, and a response with channels but no ``final`` one is unclosed reasoning) and then every other special
    token of ``special_tokens`` removed: the text :func:`graded_text` reads.

    Args:
        text: the decoded response (or prompt end) with special tokens kept.
        special_tokens: the tokenizer's special-token strings (``all_special_tokens`` and the added tokens marked
            special).
    """
    for opening, closing in REASONING_MARKERS:
        text = text.replace(opening, THINK_OPEN).replace(closing, THINK_CLOSE)
    if _CHANNEL in text:
        final = text.rfind(_FINAL)
        text = (THINK_OPEN + text[:final] + THINK_CLOSE + text[final + len(_FINAL):] if final >= 0
                else THINK_OPEN + text)
    for token in sorted(set(special_tokens) - {THINK_OPEN, THINK_CLOSE}, key=len, reverse=True):
        if token:
            text = text.replace(token, "")
    return text


def check_response_part(value: Any) -> str:
    """``value`` as one of :data:`RESPONSE_PARTS`.

    Raises:
        ValueError: anything else, naming the key and both values.
    """
    if value not in RESPONSE_PARTS:
        raise ValueError(f"reward.reward_kwargs.grader.response={value!r}: set answer (grade the text after the "
                         "policy's <think> block, the default) or full (grade the whole response, reasoning included); "
                         "docs/grading.md#thinking-policies")
    return str(value)


def prompt_opens_thinking(prompt: str) -> bool:
    """True when ``prompt`` (the end of the templated prompt, decoded) leaves a ``<think>`` block open: chat templates
    that open the reasoning in the generation prompt, whose responses then carry only the closing tag."""
    low = prompt.lower()
    return low.rfind(THINK_OPEN) > low.rfind(THINK_CLOSE)


def graded_text(response: str, part: str = DEFAULT_RESPONSE_PART, *, opened: bool = False) -> tuple[str, bool]:
    """The text to grade of one policy response, and whether its thinking block never closes.

    Args:
        response: the decoded response.
        part: ``answer`` (the text after the last ``</think>``, leading whitespace dropped; the whole text when the
            response has no thinking tags) or ``full`` (the response as it is).
        opened: the prompt opened the thinking block (:func:`prompt_opens_thinking`), so the response starts inside
            it.

    Returns:
        ``(text, no_answer)``; ``no_answer`` is True for a thinking block that never closes, whose text is ``""``
        with ``answer`` (with ``full`` the text is the response and ``no_answer`` is still reported).
    """
    answer = strip_reasoning(THINK_OPEN + response if opened else response)
    if part == "full":
        return response, answer is None
    if answer is None:
        return "", True
    closed = THINK_CLOSE in response.lower()
    return (answer.lstrip() if closed else answer), False


def with_response_part(identity: dict, part: str) -> dict:
    """``identity`` with a non-default response part folded into its ``template_hash`` (grading the reasoning too is
    another protocol); unchanged for the default."""
    if part == DEFAULT_RESPONSE_PART:
        return identity
    out = dict(identity)
    out["template_hash"] = template_hash(judge=identity.get("template_hash"), response=part)
    return out


def split_response_part(config: Mapping[str, Any]) -> tuple[dict, str]:
    """``(the grader config without its response key, the response part)`` of a grader mapping
    (``reward.reward_kwargs.grader``); the part defaults to :data:`DEFAULT_RESPONSE_PART`.

    Raises:
        ValueError: a response part other than :data:`RESPONSE_PARTS`.
    """
    cfg = dict(config)
    return cfg, check_response_part(cfg.pop("response", DEFAULT_RESPONSE_PART))
