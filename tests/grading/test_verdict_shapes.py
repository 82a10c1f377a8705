"""Reading a verdict (docs/grading.md#reading-a-verdict): the reply shapes of public judge outputs, with the verdict
each gives and whether it is re-asked; cut and unreadable replies are re-asked up to the bound, each re-ask and each
final failure recorded per criterion."""

import asyncio

import pytest

from setgrpo_verl.grading import GradingError, GradingItem, JudgeRequest, OpenAIJudge, Rubric, RubricGrader
from setgrpo_verl.grading.protocol import parse_verdict

#: (reply, cut by the token budget, verdict read: True yes, False no, None none -> re-asked), one row of the docs'
#: table each.
SHAPES = [
    ("Yes", False, True),
    ("no.", False, False),
    ("YES\n", False, True),
    ("**Yes**", False, True),
    ("**Verdict:** No", False, False),
    ("Yes, the response", True, True),
    ("The response", True, None),
    ("", False, None),
    ("<think>Okay, let me check", True, None),
    ("<think>The response names red.</think>\n\nYes", False, True),
    ('{"verdict": "yes"}', False, True),
    ('```json\n{"explanation": "The response does not mention dosage.", "criteria_met": false}\n```', False, False),
    ('{"reasoning": "It names red.", "answer": "No"}', False, False),
    ("The response lists three primary colours, so it meets the criterion.\n\nAnswer: Yes", False, True),
    ("Let me think step by step. The criterion asks for a citation; none is given.\nFinal verdict: NO", False, False),
    ("The response names red, a primary colour.\n\nYes", False, True),
    ("Sí, la respuesta nombra un color primario.", False, True),
    ("是的，回答满足该标准。", False, True),
    ("いいえ、基準を満たしていません。", False, False),
    ("네, 기준을 충족합니다.", False, True),
    ("Nein.", False, False),
    ("\\boxed{Yes}", False, True),
    ("[[No]]", False, False),
    ("Feedback: The response is accurate and complete. [RESULT] Yes", False, True),
    ("<answer>no</answer>", False, False),
    ("The final answer is: Yes", False, True),
    ("Yes, it names red.\nFinal answer: No", False, None),
    ("I cannot determine whether the response meets the criterion.", False, None),
    ("Maybe", False, None),
    ("Yes and no.", False, None),
    ("No", True, None),
    ("Yes", True, None),
    ('{"verdict": "yes"', True, None),
    ("No response was given", False, None),
]


@pytest.mark.parametrize("reply,cut,verdict", SHAPES)
def test_each_reply_shape_gives_its_verdict(reply, cut, verdict):
    assert parse_verdict(reply, cut=cut) is verdict


def test_the_table_covers_twenty_shapes_with_a_verdict_and_the_docs_list_them():
    from pathlib import Path

    assert sum(v is not None for _, _, v in SHAPES) >= 20
    docs = (Path(__file__).resolve().parents[2] / "docs" / "grading.md").read_text(encoding="utf-8")
    for reply in ("**Verdict:** No", "[RESULT] Yes", "criteria_met", "是的，回答满足该标准。", "[[No]]"):
        assert reply in docs


class _ScriptedJudge(OpenAIJudge):
    """An :class:`OpenAIJudge` whose server is a script: ``replies[criterion]`` lists the choices it answers in
    turn (``(text, finish_reason)``), the last repeated; the seeds asked are kept."""

    def __init__(self, replies, **kw):
        super().__init__("http://127.0.0.1:9/v1", "scripted", **kw)
        self.replies, self.seeds = replies, {}

    async def _complete(self, messages, seed):
        criterion = messages[1]["content"].rsplit("Criterion: ", 1)[1]
        asked = self.seeds.setdefault(criterion, [])
        asked.append(seed)
        script = self.replies[criterion]
        text, finish = script[min(len(asked), len(script)) - 1]
        return {"message": {"role": "assistant", "content": text}, "finish_reason": finish}


def _grade(judge, criteria, **kw):
    rubric = Rubric.from_row({"id": "r", "question": "Name a primary colour.",
                              "rubrics": [{"criterion": c, "points": 1} for c in criteria]})
    grader = RubricGrader(judge, seed=3, **kw)
    return asyncio.run(grader.agrade([GradingItem(response="Red.", rubric=rubric)], scoring_index=0))[0]


def test_a_cut_or_unreadable_reply_is_reasked_with_the_next_seed_and_the_reasks_are_recorded():
    judge = _ScriptedJudge({
        "a": [("Yes, the response", "length")],                      # read at once, though cut
        "b": [("The response", "length"), ("No.", "stop")],          # cut before a verdict: one re-ask
        "c": [("", "stop"), ("I think", "stop"), ("**Yes**", "stop")],  # empty, unreadable, then read: two re-asks
    })
    result = _grade(judge, ["a", "b", "c"])
    assert [v.outcome for v in result.verdicts] == ["met", "unmet", "met"]
    assert [v.reasks for v in result.verdicts] == [0, 1, 2]
    assert [len(judge.seeds[c]) for c in "abc"] == [1, 2, 3]
    first = judge.seeds["c"][0]
    assert judge.seeds["c"] == [first, first + 1, first + 2]  # the next seed each time: reproducible
    assert [v.to_dict().get("reasks") for v in result.verdicts] == [None, 1, 2]


def test_a_reply_unreadable_after_the_bound_is_a_failure_named_per_criterion():
    judge = _ScriptedJudge({"a": [("Yes", "stop")], "b": [("Perhaps.", "stop")]}, parse_retries=2)
    with pytest.raises(GradingError) as info:
        _grade(judge, ["a", "b"])
    assert "criterion 1 ('b'): unreadable after 2 re-ask(s)" in str(info.value)
    assert len(judge.seeds["b"]) == 3
    # allowed as a share: the unparsed verdict records why, and the response is scored over the rest
    result = _grade(_ScriptedJudge({"a": [("Yes", "stop")], "b": [("x", "stop"), ("The", "length")]}, parse_retries=1),
                    ["a", "b"], max_unparsed_ratio=0.5)
    assert result.verdicts[1].outcome == "unparsed" and result.verdicts[1].failure == "cut"
    assert result.verdicts[1].to_dict()["failure"] == "cut" and result.score == 1.0


def test_every_attempt_cut_names_the_token_budget():
    judge = _ScriptedJudge({"a": [("<think>Okay, let me", "length")]}, max_tokens=16, parse_retries=2)
    with pytest.raises(GradingError, match=r"max_tokens=16 \(finish_reason='length'\).*still reasoning.*all 3 "
                                           r"attempts"):
        _grade(judge, ["a"])
    assert len(judge.seeds["a"]) == 3


def test_the_default_budget_leaves_room_for_a_sentence_around_the_verdict():
    judge = OpenAIJudge("http://127.0.0.1:9/v1", "m")
    assert judge.max_tokens == 16 and judge.parse_retries == 2
    assert JudgeRequest("q", "r", "c") is not None


def test_the_verdict_seed_is_fresh_per_rollout_sample_and_reproducible():
    from setgrpo_verl.grading import verdict_seed

    class Seeds:
        identity = {"name": "x", "model": "m", "temperature": 1.0, "template_hash": "h"}

        def __init__(self):
            self.seen = []

        async def ajudge(self, requests, seeds):
            from setgrpo_verl.grading import Verdict

            self.seen.append(list(seeds))
            return [Verdict("met", "judge") for _ in requests]

    rubric = Rubric.from_row({"id": "r", "question": "q", "rubrics": [{"criterion": "c", "points": 1}]})
    judge = Seeds()
    grader = RubricGrader(judge, seed=3)
    for nonce in ("1/7/0", "2/7/0", "1/7/0", None):  # the same response at steps 1 and 2, step 1 again, no nonce
        asyncio.run(grader.agrade([GradingItem(response="Red.", rubric=rubric, nonce=nonce)], scoring_index=0))
    step1, step2, again, plain = (s[0] for s in judge.seen)
    assert step1 != step2 and step1 == again  # fresh per sample, reproducible
    assert plain == verdict_seed(3, 0, "q", "Red.", 0, "c")  # without a nonce: the scheme before nonces
    assert step1 == verdict_seed(3, 0, "q", "Red.", 0, "c", "1/7/0") != plain
