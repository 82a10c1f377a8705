"""Reasoning judges whose reasoning is not a ``<think>`` block or a ``reasoning_content`` field: Mistral's API for
Magistral (a ``thinking`` content part before the ``text`` part) and a Magistral judge served without its reasoning
parser (``[THINK]...[/THINK]`` in ``content``); docs/grading.md#reading-a-verdict."""

from __future__ import annotations

import pytest

from setgrpo_verl.grading import GradingError
from setgrpo_verl.grading.graders import check_unparsed
from setgrpo_verl.grading.protocol import parse_verdict, read_reply, strip_reasoning
from setgrpo_verl.grading.rubric import GradingItem
from setgrpo_verl.grading.types import Verdict

REASONING = "The user asks whether the response meets the criterion. " * 8


@pytest.mark.parametrize("verdict, met", [("Yes", True), ("No", False)])
def test_a_thinking_part_before_the_text_part_is_reasoning_and_the_text_part_the_answer(verdict, met):
    reply = read_reply({"role": "assistant", "content": [
        {"type": "thinking", "thinking": [{"type": "text", "text": REASONING}]}, {"type": "text", "text": verdict}]})
    assert reply.answer == verdict and reply.reasoning == REASONING
    assert parse_verdict(reply.answer) is met


def test_reasoning_parts_alone_give_no_answer_and_other_parts_are_still_refused():
    reply = read_reply({"content": [{"type": "thinking", "thinking": [{"type": "text", "text": "Let me see"}]}]})
    assert reply.answer is None and reply.reasoning == "Let me see"
    with pytest.raises(GradingError, match=r"content parts of types \['image_url', 'text'\]"):
        read_reply({"content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "Yes"}]})


@pytest.mark.parametrize("reply, met", [
    ("[THINK]" + "Let me look at the response and the criterion carefully. " * 12 + "[/THINK]Yes", True),
    ("[THINK]The criterion asks something; the answer is yes.[/THINK]No", False),
    ("<seed:think>Check the response: yes.</seed:think>No", False),
])
def test_think_markers_of_other_families_are_skipped_like_think_tags(reply, met):
    assert parse_verdict(reply) is met


def test_an_unclosed_reasoning_block_is_no_answer_and_the_message_names_the_reasoning_parser():
    raw = "[THINK]" + "Let me look at the response and the criterion carefully. " * 12
    assert strip_reasoning(raw) is None and parse_verdict(raw) is None
    item = GradingItem(response="Hello!", nonce="0")
    with pytest.raises(GradingError, match=r"never closes: .*--reasoning-parser"):
        check_unparsed([item], [[Verdict("unparsed", "judge", raw=raw, failure="unreadable")]], 0.0, scoring_index=0)
