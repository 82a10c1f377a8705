"""What of a thinking policy's response is graded (docs/grading.md#thinking-policies), on synthetic responses."""

from __future__ import annotations

import asyncio

import pytest

from setgrpo_verl.grading import DualScorer, GradingItem, build_grader, grader_identity
from setgrpo_verl.grading.answers import graded_text, prompt_opens_thinking

RESPONSES = {
    "closed": "<think>\nThe word is secret.\n</think>\n\nThe answer is 42.",
    "plain": "  The answer is secret 42.",
    "unclosed": "<think>\nLet me think about the secret for a long time",
    "closing_only": "The secret is in my reasoning.\n</think>\n\nThe answer is 42.",
}


@pytest.mark.parametrize("name, opened, expected", [
    ("closed", False, ("The answer is 42.", False)),
    ("plain", False, ("  The answer is secret 42.", False)),  # no tags: the whole response, untouched
    ("unclosed", False, ("", True)),  # no answer: graded as the empty answer
    ("closing_only", True, ("The answer is 42.", False)),  # the template opened the block in the prompt
    ("plain", True, ("", True)),  # opened by the prompt and never closed
])
def test_the_answer_after_the_think_block_is_graded(name, opened, expected):
    assert graded_text(RESPONSES[name], "answer", opened=opened) == expected
    text, missing = graded_text(RESPONSES[name], "full", opened=opened)
    assert (text, missing) == (RESPONSES[name], expected[1])  # full: the response as it is, still counted


def test_a_prompt_opens_thinking_when_its_last_think_tag_is_an_open_one():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=false
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def _grader(tmp_path, **extra):
    src = tmp_path / "secret.py"
    src.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
                   "    return {'score': 1.0 if 'secret' in solution_str else 0.0, 'seen': solution_str}\n")
    return {"type": "function", "path": str(src), "name": "compute_score", **extra}


def test_the_scorer_grades_answers_by_default_and_counts_responses_without_one(tmp_path):
    names = list(RESPONSES)
    items = [GradingItem(response=RESPONSES[n], prompt="q", nonce=str(i)) for i, n in enumerate(names)]
    answer = asyncio.run(DualScorer(_grader(tmp_path)).ascore(items))
    full = asyncio.run(DualScorer(_grader(tmp_path, response="full")).ascore(items))
    # the word sits in the reasoning of "closed" and "closing_only": graded on the answer it is absent
    assert answer.point.tolist() == [0.0, 1.0, 0.0, 0.0] and answer.reference.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert full.point.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert answer.no_answer.tolist() == [False, False, True, False] == full.no_answer.tolist()
    assert answer.metrics()["grading/no_answer"] == 1.0
    # the prompt opened the block: a response without a closing tag has no answer
    opened = asyncio.run(DualScorer(_grader(tmp_path)).ascore(items, opened=[False, True, False, True]))
    assert opened.no_answer.tolist() == [False, True, True, False] and opened.point.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_the_response_part_enters_the_identity_only_when_it_is_not_the_default(tmp_path):
    plain, full = _grader(tmp_path), _grader(tmp_path, response="full")
    assert grader_identity(plain) == grader_identity(_grader(tmp_path, response="answer")) == build_grader(plain).identity
    assert grader_identity(full) != grader_identity(plain)
    assert DualScorer(full).identity == grader_identity(full) and DualScorer(plain).identity == grader_identity(plain)
    with pytest.raises(ValueError, match=r"grader.response='reasoning': set answer"):
        grader_identity(_grader(tmp_path, response="reasoning"))
    with pytest.raises(ValueError, match="applied by DualScorer"):
        build_grader(full)
    with pytest.raises(ValueError, match="applied by DualScorer"):
        grader_identity({"type": "noisy", "flip_prob": 0.1, "base": {"type": "rules", "response": "full"}})
