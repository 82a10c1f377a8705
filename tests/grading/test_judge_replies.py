"""Judge replies in every OpenAI-compatible shape and in other languages, against a real local server; unparsed
verdicts give an error or a documented score, never a silent one."""

import asyncio

import numpy as np
import pytest

from setgrpo_verl.grading import (
    VERDICT_WORDS,
    VERDICT_WORDS_BY_LANGUAGE,
    DualScorer,
    GradingError,
    GradingItem,
    JudgeRequest,
    OpenAIJudge,
    Rubric,
    RubricGrader,
    build_grader,
    grader_identity,
    parse_verdict,
    read_reply,
    rubric_score,
    verdict_seed,
)
from setgrpo_verl.grading.protocol import JUDGE_SYSTEM_PROMPT, judge_messages
from setgrpo_verl.integration.reward_manager import UNPARSED_RATIO_METRIC, grading_counts, grading_metrics

from .judge_server import ANSWERS, SHAPES, JudgeServer

Q = "¿Puedes nombrar un color primario?"
RESPONSES = ["El rojo es un color primario.", "Azul.", "No lo sé.", "Verde y morado."]


@pytest.fixture(scope="module")
def server(smollm2_judge):
    with JudgeServer(smollm2_judge) as srv:
        yield srv


def _url(server, route=None):
    return server.base_url if route is None else server.base_url.replace("/v1", f"/{route}/v1")


def _ask(server, crit, *, route=None, seed=5, response=RESPONSES[0], **kw):
    async def body():
        judge = OpenAIJudge(_url(server, route), "smollm2-135m-judge", timeout=120.0, **kw)
        try:
            return (await judge.ajudge([JudgeRequest(Q, response, crit)], [seed]))[0]
        finally:
            await judge.aclose()

    return asyncio.run(body())


def _expected(server, crit, seed, response=RESPONSES[0]):
    """The server's seeded draw for this criterion: the verdict every well-read route must give."""
    p = float(server.judge.p_yes([JudgeRequest(Q, response, crit)])[0])
    return "met" if np.random.default_rng(seed).random() < p else "unmet"


# ------------------------------------------------------------------ reply shapes
@pytest.mark.parametrize("route", ["shape-content-parts", "shape-reasoning-content", "shape-reasoning",
                                   "shape-reasoning-and-content"])
def test_every_text_reply_shape_gives_the_plain_verdict(server, route):
    crit = f"The response names a colour. ({route})"
    for seed in (5, 6, 7):
        verdict = _ask(server, crit, route=route, seed=seed)
        assert verdict.outcome == _expected(server, crit, seed)
        assert verdict.raw in ("yes", "no")  # the judge's own words, nothing of ours put in front
    assert server.requests[-1]["messages"][0]["content"] == JUDGE_SYSTEM_PROMPT


@pytest.mark.parametrize("route,said", [
    ("shape-tool-call", ['tool call', '"name": "verdict"', '"arguments"']),
    ("shape-refusal", ["refused", "I can't help with that."]),
    ("shape-image-part", ["content parts of types ['image_url']"]),
])
def test_other_reply_shapes_are_errors_that_quote_the_reply(server, route, said):
    crit = f"The response names a colour. ({route})"
    with pytest.raises(GradingError) as info:
        _ask(server, crit, route=route, parse_retries=2)
    msg = str(info.value)
    assert all(s in msg for s in said) and "smollm2-135m-judge" in msg
    assert server.attempts[crit] == 1  # not re-asked as if it were an unparsed text


def test_read_reply_keeps_the_judges_text_unchanged():
    assert read_reply({"content": "yes", "reasoning_content": "I think so."}).answer == "yes"
    reply = read_reply({"content": None, "reasoning_content": "no"})
    assert (reply.answer, reply.shape) == ("no", "content null, answer in reasoning_content")
    parts = [{"type": "text", "text": "y"}, {"type": "output_text", "text": "es"}]
    assert read_reply({"content": parts}).answer == "yes"
    assert read_reply({"content": None}).answer is None and read_reply({"content": "", "tool_calls": []}).answer is None
    for bad in ({"content": 1}, {"content": {"text": "yes"}}, {"content": [], "role": "assistant"},
                {"content": None, "function_call": {"name": "f", "arguments": "{}"}}):
        with pytest.raises(GradingError):
            read_reply(bad)


# ------------------------------------------------------------------ verdict words in other languages
def test_verdict_vocabulary():
    assert parse_verdict("yes") is True and parse_verdict(" No. ") is False and parse_verdict("YES\n") is True
    assert parse_verdict("Sí") is True and parse_verdict("否。") is False and parse_verdict("Ja!") is True
    assert parse_verdict("<think>hmm</think>\n\nOui") is True and parse_verdict("<think>oui") is None
    for bad in ("1", "maybe", "", "yes no", "yes it does"):
        assert parse_verdict(bad) is None
    # a verdict the reply clearly gives is read (docs/grading.md#reading-a-verdict)
    assert parse_verdict("yes, it does") is True and parse_verdict("Sí, claro") is True and parse_verdict("*no*") is False
    # English, Chinese and the common European languages; no word is yes in one language and no in another
    assert {"English", "Chinese", "Spanish", "French", "German", "Italian", "Portuguese", "Russian"} <= set(
        VERDICT_WORDS_BY_LANGUAGE)
    for yes, no in VERDICT_WORDS_BY_LANGUAGE.values():
        assert all(VERDICT_WORDS[w.casefold()] is True for w in yes)
        assert all(VERDICT_WORDS[w.casefold()] is False for w in no)
    # the judge is told to answer in English whatever the language of the question
    assert "English" in judge_messages(JudgeRequest(Q, "x", "c"))[0]["content"]


@pytest.mark.parametrize("lang", sorted(set(ANSWERS) - {"tlh"}))
def test_a_judge_answering_in_another_language_gives_the_same_verdicts(server, lang):
    crit = f"[[lang:{lang}]] La respuesta nombra un color."
    for seed in (1, 2, 3, 4):
        verdict = _ask(server, crit, seed=seed)
        assert verdict.outcome == _expected(server, crit, seed)
        assert verdict.raw in ANSWERS[lang]


def _group(server, rubric, **grader):
    async def body():
        judge = OpenAIJudge(server.base_url, "smollm2-135m-judge", timeout=120.0, parse_retries=1)
        try:
            return await DualScorer(RubricGrader(judge, seed=9, **grader)).ascore(
                [GradingItem(r, rubric) for r in RESPONSES])
        finally:
            await judge.aclose()

    return asyncio.run(body())


def _true_scores(server, rubric, scoring, unread=()):
    out = []
    for response in RESPONSES:
        met = []
        for j, c in enumerate(rubric.criteria):
            seed = verdict_seed(9, scoring, Q, response, j, c.criterion)
            met.append(None if j in unread else _expected(server, c.criterion, seed, response) == "met")
        out.append(rubric_score(rubric, met))
    return out


def test_a_group_with_mixed_language_verdicts_gets_its_true_scores(server):
    rubric = Rubric.from_row({"question": Q, "id": "mixed", "rubrics": [
        {"criterion": "[[lang:es]] La respuesta nombra un color primario.", "points": 2},
        {"criterion": "[[lang:zh]] 回答提到了红色。", "points": 1},
        {"criterion": "The response names a colour that is not primary.", "points": 1},
        {"criterion": "[[lang:de]] Die Antwort ist unhöflich.", "points": -2}]})
    out = _group(server, rubric)
    np.testing.assert_allclose(out.point, _true_scores(server, rubric, 0))
    np.testing.assert_allclose(out.reference, _true_scores(server, rubric, 1))
    assert out.metrics()["grading/unparsed"] == 0


def test_a_group_with_verdicts_in_an_unread_language_is_an_error_or_scored_over_the_parsed_criteria(server):
    rubric = Rubric.from_row({"question": Q, "id": "klingon", "rubrics": [
        {"criterion": "[[lang:es]] La respuesta nombra un color primario.", "points": 2},
        {"criterion": "[[lang:tlh]] The response names red.", "points": 1},
        {"criterion": "The response names a colour that is not primary.", "points": 1},
        {"criterion": "The response is rude.", "points": -2}]})
    with pytest.raises(GradingError) as info:  # default: any unparsed verdict stops, with the judge's replies
        _group(server, rubric)
    msg = str(info.value)
    assert "4 of 4 responses" in msg and ("\"HIja'\"" in msg or "\"ghobe'\"" in msg)
    assert "docs/grading.md#reading-a-verdict" in msg and "unreadable after 1 re-ask(s)" in msg
    # a documented, explicit allowance: 1 of 4 judged criteria may be unparsed; scores over the parsed ones
    out = _group(server, rubric, max_unparsed_ratio=0.25)
    np.testing.assert_allclose(out.point, _true_scores(server, rubric, 0, unread=(1,)))
    np.testing.assert_allclose(out.reference, _true_scores(server, rubric, 1, unread=(1,)))
    assert out.metrics()["grading/unparsed"] == 8 and out.metrics()["grading/unparsed_rate"] == pytest.approx(0.25)


# ------------------------------------------------------------------ the policy's settings and metrics
def test_unparsed_policy_settings():
    base = {"type": "openai", "base_url": "http://127.0.0.1:1/v1", "model": "m"}
    assert build_grader(base).max_unparsed_ratio == 0.0
    assert build_grader(base | {"max_unparsed_ratio": 0.2}).max_unparsed_ratio == 0.2
    with pytest.raises(ValueError, match="replaced by max_unparsed_ratio"):
        build_grader(base | {"on_unparsed": "unparsed"})
    for bad in (1.0, -0.1, "0.1", True):
        with pytest.raises(ValueError, match="max_unparsed_ratio"):
            build_grader(base | {"max_unparsed_ratio": bad})
    # scoring over the parsed criteria only is another protocol: it enters the identity, 0 leaves it unchanged
    assert grader_identity(base | {"max_unparsed_ratio": 0.0}) == grader_identity(base)
    relaxed = grader_identity(base | {"max_unparsed_ratio": 0.2})
    assert relaxed["template_hash"] != grader_identity(base)["template_hash"]
    assert build_grader(base | {"max_unparsed_ratio": 0.2}).identity == relaxed


def test_unparsed_ratio_metric_from_verl_batches():
    extra = [{"reward_extra_info": {"unparsed": u, "judged": 6}} for u in (0, 3, 0, 0)]
    assert grading_metrics({"extra_fields": np.array(extra, dtype=object)}) == {UNPARSED_RATIO_METRIC: 3 / 24}
    assert grading_counts({"extra_fields": extra}) == (3.0, 24.0)
    assert grading_metrics({"unparsed": np.array([1, 0]), "judged": np.array([4, 4])}) == {UNPARSED_RATIO_METRIC: 1 / 8}
    assert grading_metrics({"unparsed": [0], "judged": [0]}) == {UNPARSED_RATIO_METRIC: 0.0}  # rules only
    assert grading_metrics({"extra_fields": [{"reward_extra_info": {"score": 1.0}}]}) == {}  # another manager


def test_unparsed_ratio_metric_from_a_transfer_queue_batch():
    """The layout the trainer reads from TransferQueue: per-sample ``extra_fields`` in a TensorDict."""
    import torch
    from verl.utils import tensordict_utils as tu

    fields = [{"rm_scores": torch.zeros(3), "extra_fields": {"reward_extra_info": {
        "reference_score": 0.5, "unparsed": u, "judged": 4}}} for u in (0, 1, 0, 2)]
    data = tu.list_of_dict_to_tensordict(fields)
    assert grading_counts(data) == (3.0, 16.0)
    assert grading_metrics(data) == {UNPARSED_RATIO_METRIC: 3 / 16}
