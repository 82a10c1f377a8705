"""Rubric data model, score arithmetic, rule checks, seeding and graders (no model needed)."""

import asyncio
import json

import pytest

from setgrpo_verl.grading import (
    NLTK_DATA_RULES,
    DualScorer,
    FunctionGrader,
    GradingError,
    GradingItem,
    Rubric,
    RubricGrader,
    Rule,
    Verdict,
    build_grader,
    check_rule,
    grader_identity,
    parse_verdict,
    rubric_score,
    verdict_seed,
)

ROW = {
    "question": "Describe a cat.",
    "id": "cat-1",
    "rubrics": [
        {"criterion": "Mentions whiskers", "points": 5},
        {"criterion": "Mentions fur", "points": 3},
        {"criterion": "Says cats are reptiles", "points": -4},
        {"criterion": "Uses the word 'purr' at least once", "points": 2,
         "rule": {"id": "ifbench:sentence:keyword", "kwargs": {"word": "purr", "N": 1, "other": None}}},
    ],
}


def test_score_arithmetic_hand_computed():
    r = Rubric.from_row(ROW)
    # W = 5 + 3 + 2 = 10 (positive points only)
    assert rubric_score(r, [True, True, False, True]) == pytest.approx(1.0)
    assert rubric_score(r, [True, False, False, False]) == pytest.approx(0.5)
    assert rubric_score(r, [True, True, True, False]) == pytest.approx((5 + 3 - 4) / 10)
    assert rubric_score(r, [False, False, True, False]) == pytest.approx(-0.4)
    assert r.score_range == (pytest.approx(-0.4), 1.0)
    # unparsed criteria leave numerator and normaliser: (5 - 4) / (5 + 2)
    assert rubric_score(r, [True, None, True, False]) == pytest.approx(1 / 7)
    assert rubric_score(r, [Verdict("met", "judge"), Verdict("unparsed", "judge"), Verdict("met", "judge"),
                            Verdict("unmet", "rule")]) == pytest.approx(1 / 7)


def test_all_negative_rubric():
    r = Rubric.from_row({"question": "q", "id": "neg", "rubrics": [
        {"criterion": "rude", "points": -3}, {"criterion": "off-topic", "points": -1}]})
    # no positive points: normalised by the penalty mass N = 4, score in [-1, 0]
    assert rubric_score(r, [False, False]) == 0.0
    assert rubric_score(r, [True, False]) == pytest.approx(-0.75)
    assert rubric_score(r, [True, True]) == pytest.approx(-1.0)
    assert r.score_range == (-1.0, 0.0)
    with pytest.raises(GradingError, match="every criterion with non-zero points has an unparsed verdict"):
        rubric_score(r, [None, None])


def test_rubric_validation_errors():
    with pytest.raises(ValueError, match="'x', rubrics: missing"):
        Rubric.from_row({"question": "q", "id": "x"})
    with pytest.raises(ValueError, match="'x', rubrics: empty"):
        Rubric.from_row({"question": "q", "id": "x", "rubrics": []})
    with pytest.raises(ValueError, match=r"'x', rubrics\[0\].points: missing"):
        Rubric.from_row({"question": "q", "id": "x", "rubrics": [{"criterion": "c"}]})
    with pytest.raises(ValueError, match="all criteria have 0 points"):
        Rubric.from_row({"question": "q", "id": "x", "rubrics": [{"criterion": "c", "points": 0}]})
    with pytest.raises(ValueError, match="3 verdicts"):
        rubric_score(Rubric.from_row(ROW), [True, True, True])
    r = Rubric.from_row(json.dumps(ROW))  # JSON string form (verl's ground_truth)
    assert Rubric.from_row(r.to_json()) == r and r.criteria[3].rule.kwargs == {"word": "purr", "N": 1}


def test_parse_verdict_reads_only_a_clear_verdict():
    assert parse_verdict("yes") is True and parse_verdict(" No. ") is False and parse_verdict("YES\n") is True
    assert parse_verdict("yes, because") is True  # a first word before a separator (docs/grading.md#reading-a-verdict)
    for bad in ("Maybe", "", None, "no no", "y", "yes because"):
        assert parse_verdict(bad) is None


def test_rule_checks_offline():
    kw = Rule("ifbench:count:word_count_range", {"min_words": 3, "max_words": 5})
    assert check_rule(kw, "p", "My cat will purr.") is True
    assert check_rule(kw, "p", "My cat is silent and sleeps all day long.") is False
    assert check_rule(kw, "p", "") is False
    with pytest.raises(ValueError, match=r"lacks kwargs \['max_words'\]"):
        check_rule(Rule("ifbench:count:word_count_range", {"min_words": 3}), "p", "a b c")
    with pytest.raises(ValueError, match="rule ids are '<benchmark>:<instruction id>'"):
        check_rule(Rule("nope"), "p", "r")
    with pytest.raises(ValueError, match="not an if-verifiable ifbench instruction"):
        check_rule(Rule("ifbench:made:up"), "p", "r")


def test_nltk_rules_raise_a_clear_error_when_data_is_missing():
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab")
        pytest.skip("NLTK punkt_tab data is installed here: the rule runs")
    except LookupError:
        pass
    assert "format:title_case" in NLTK_DATA_RULES
    with pytest.raises(GradingError, match="needs NLTK data"):
        check_rule(Rule("ifbench:format:title_case"), "p", "This Is Title Case")


class _CoinJudge:
    """A deterministic fake judge: met iff the verdict seed is even (tests seeding and score assembly)."""

    identity = {"name": "coin", "model": None, "temperature": 1.0, "template_hash": "0" * 16}

    def __init__(self):
        self.calls = []

    async def ajudge(self, requests, seeds):
        self.calls.append(list(requests))
        return [Verdict("met" if s % 2 == 0 else "unmet", "judge") for s in seeds]

    async def aclose(self):
        pass


def test_rubric_grader_mixes_rules_and_judge_with_reproducible_seeds():
    r = Rubric.from_row(ROW)
    judge = _CoinJudge()
    grader = RubricGrader(judge, seed=11)
    items = [GradingItem("Whiskers and fur; it will purr.", r), GradingItem("A reptile.", r)]
    res = asyncio.run(grader.agrade(items, scoring_index=1))
    assert len(judge.calls[0]) == 6  # 3 judged criteria x 2 items, one batched judge call; the rule is checked by code
    for item, out in zip(items, res):
        assert out.verdicts[3].source == "rule"
        assert out.verdicts[3].met == ("purr" in item.response)
        for j in range(3):
            s = verdict_seed(11, 1, item.question, item.response, j, r.criteria[j].criterion)
            assert out.verdicts[j].met == (s % 2 == 0)
        assert out.score == pytest.approx(rubric_score(r, out.verdicts))
    # scoring i is reproducible whatever the batch: same item alone, in another order
    alone = asyncio.run(RubricGrader(_CoinJudge(), seed=11).agrade(items[::-1], scoring_index=1))
    assert [a.verdicts for a in alone[::-1]] == [b.verdicts for b in res]
    # the two scorings use different seeds: across many responses, some judged verdicts differ
    many = [GradingItem(f"response {k}", r) for k in range(20)]
    dual = asyncio.run(DualScorer(RubricGrader(_CoinJudge(), seed=11)).ascore(many))
    assert dual.metrics()["grading/judged_disagreement_rate"] > 0.2
    # one scoring: the point scoring alone, the same verdicts as scoring 0 of two; no reference, no disagreement
    once = asyncio.run(DualScorer(RubricGrader(_CoinJudge(), seed=11), scoring_indices=(0,)).ascore(many))
    assert (once.reference, once.reference_results, once.scorings, dual.scorings) == (None, None, 1, 2)
    assert [r.verdicts for r in once.point_results] == [r.verdicts for r in dual.point_results]
    assert set(once.metrics()) == {"grading/point_mean", "grading/judged", "grading/unparsed", "grading/unparsed_rate",
                                   "grading/reasks", "grading/no_answer"}
    assert once.metrics()["grading/judged"] == dual.metrics()["grading/judged"] / 2
    with pytest.raises(ValueError, match="scoring_indices must be two distinct integers or one"):
        DualScorer(RubricGrader(_CoinJudge()), scoring_indices=(0, 0))


def test_rules_only_grader_rejects_judged_criteria():
    r = Rubric.from_row(ROW)
    with pytest.raises(GradingError, match="has no judge"):
        asyncio.run(RubricGrader(None).agrade([GradingItem("purr", r)], scoring_index=0))


def test_function_grader_verl_style(tmp_path):
    src = tmp_path / "my_reward.py"
    src.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info, scoring_index, seed, bonus=0.0):\n"
        "    return {'score': len(ground_truth['rubrics']) + scoring_index + bonus, 'verdicts': [True, None]}\n"
    )
    grader = build_grader({"type": "function", "path": str(src), "name": "compute_score", "kwargs": {"bonus": 0.5}})
    assert grader.identity["name"] == f"function:{src}:compute_score"
    out = DualScorer(grader).score([None], ["resp"], [ROW])
    assert list(out.point) == [4.5] and list(out.reference) == [5.5]
    assert [v.outcome for v in out.point_results[0].verdicts] == ["met", "unparsed"]


def _score_by_length(data_source, solution_str, ground_truth, extra_info, scoring_index, seed):
    return float(len(solution_str))


def test_a_function_object_grader_is_named_by_module_and_qualified_name():
    from setgrpo_verl.grading.graders import FunctionGrader

    assert FunctionGrader(fn=_score_by_length).identity["name"] == f"function:{__name__}:_score_by_length"


def test_build_grader_errors_and_identity():
    with pytest.raises(ValueError, match="needs a 'type'"):
        build_grader({})
    with pytest.raises(ValueError, match="unknown grader type"):
        build_grader({"type": "magic"})
    with pytest.raises(ValueError, match="unknown keys for a local_hf grader"):
        build_grader({"type": "local_hf", "temprature": 1.0})
    with pytest.raises(ValueError, match=r"needs \['model'\]"):
        build_grader({"type": "openai", "base_url": "http://127.0.0.1:1/v1"})
    ident = grader_identity({"type": "openai", "base_url": "http://x/v1", "model": "m", "temperature": 0.7})
    assert ident == build_grader({"type": "openai", "base_url": "http://x/v1", "model": "m", "temperature": 0.7}).identity
    assert set(ident) == {"name", "model", "temperature", "template_hash"} and ident["temperature"] == 0.7
    a = grader_identity({"type": "local_hf"})
    b = grader_identity({"type": "local_hf", "max_response_tokens": 64})
    assert a["name"] == "rubric+local_hf" and a["template_hash"] != b["template_hash"]


@pytest.mark.parametrize("config", [
    {"type": "local_hf", "temperature": 0.0},
    {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m", "temperature": 0},
    {"type": "noisy", "flip_prob": 0.1, "base": {"type": "local_hf", "temperature": -1.0}},
])
def test_temperature_zero_judge_is_refused_before_any_model_loads(config, monkeypatch):
    """A judge at temperature 0 scores each response the same twice: the conformal set is a point (GRPO)."""
    from setgrpo_verl.grading import graders

    def no_model(*args, **kwargs):
        raise AssertionError("a judge was built")

    monkeypatch.setattr(graders, "LocalHFJudge", no_model)
    monkeypatch.setattr(graders, "OpenAIJudge", no_model)
    for check in (build_grader, grader_identity):
        with pytest.raises(ValueError, match=r"reward\.reward_kwargs\.grader\.temperature, --judge-temperature\): "
                                             "SetGRPO calibrates a stochastic grader"):
            check(config)


def test_a_reward_function_that_raises_names_function_row_and_response():
    def scorer(data_source, solution_str, ground_truth, extra_info, **kwargs):
        if "boom" in solution_str:
            raise KeyError("criteria")
        return 0.5

    other = {**ROW, "id": "cat-2"}
    with pytest.raises(GradingError) as info:
        DualScorer(FunctionGrader(fn=scorer)).score([None, None], ["fine", "boom"], [ROW, other])
    message = str(info.value)
    assert "scorer raised KeyError: 'criteria' in scoring 0" in message
    assert "row 'cat-2', response 'boom'" in message
    assert isinstance(info.value.__cause__, KeyError)
