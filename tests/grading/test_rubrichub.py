"""RubricHub_v1 rows as released (prompt chat messages, Rubrics / reward_model.rubrics, criteria tags, no id), from
JSONL and parquet, through the command line's data path to a score; rule-tagged criteria are checked by code."""

import asyncio
import json

import pandas as pd
import pytest

from setgrpo_verl.runner import launch
from setgrpo_verl.grading import (
    DualScorer,
    Rubric,
    RubricGrader,
    RubricRowError,
    Verdict,
    check_rule,
    read_rubric_rows,
    validate_verl_rows,
)
from setgrpo_verl.grading.rubrichub import release_row, rule_from_tags, supported_functions
from setgrpo_verl.models import embedded_model_dir

SYSTEM = "You are a careful writer."
RULE_TAGS = {"verifier": "rule", "function": "ParagraphBasicChecker", "parameters": {"num_paragraphs": 2.0,
                                                                                       "keyword": None}}
TWO = "A white tower stands on the rocks.\n***\nIts lamp turns all night."
ONE = "A white tower on the rocks. Its lamp turns all night."


def released(i: int, *, where: str = "Rubrics", system: bool = True) -> dict:
    """One row shaped like the RubricHub_v1 release (Instruction_Following shard)."""
    criteria = [
        {"criterion": "paragraphs:two", "points": 10, "tags": RULE_TAGS},
        {"criterion": f"The description mentions the lamp ({i}).", "points": 5, "tags": {"verifier": "llm"}},
        {"criterion": "The description is rude.", "points": -5, "tags": {"verifier": "llm"}},
    ]
    prompt = [{"role": "user", "content": f"Describe lighthouse number {i} in exactly two paragraphs."}]
    if system:
        prompt.insert(0, {"role": "system", "content": SYSTEM})
    row = {"data_source": "Instruction_Following", "prompt": prompt, "ability": "instruction_following",
           "reward_model": {"style": "rubric", "ground_truth": ""}, "extra_info": {"index": i}}
    if where == "Rubrics":
        row["Rubrics"] = criteria
        row["reward_model"]["rubrics"] = criteria
    else:
        row["reward_model"]["rubrics"] = criteria
    return row


class RecordingJudge:
    """A judge that meets every criterion mentioning the lamp and records what it was asked."""

    identity = {"name": "recording", "model": None, "temperature": 0.0, "template_hash": "0" * 16}

    def __init__(self):
        self.asked = []

    async def ajudge(self, requests, seeds):
        self.asked += [r.criterion for r in requests]
        return [Verdict("met" if "lamp" in r.criterion else "unmet", "judge", raw="yes") for r in requests]

    async def aclose(self):
        return None


def _write(tmp_path, rows, kind):
    path = tmp_path / f"rubrichub_if.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    else:
        pd.DataFrame(rows).to_parquet(path, index=False)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_released_rows_through_the_cli_data_path_to_a_score(tmp_path, kind):
    rows = [released(i) for i in range(6)] + [released(6, where="reward_model", system=False)]
    path = _write(tmp_path, rows, kind)
    read = read_rubric_rows(path)
    assert [r["question"] for r in read] == [f"Describe lighthouse number {i} in exactly two paragraphs."
                                             for i in range(7)]
    ids = [r["id"] for r in read]
    assert len(set(ids)) == 7 and all(i.startswith("rubrichub-") for i in ids)
    assert ids == [release_row(r)["id"] for r in rows]  # stable: derived from the row's content, not its position

    split = launch.split_data(data=path, model_path=embedded_model_dir(), max_prompt_length=256,
                              calibration_prompts=2, seed=0)
    out = launch.write_data(tmp_path / "run", split)
    verl_rows = pd.read_parquet(out["train"]).to_dict(orient="records") + pd.read_parquet(
        out["calibration"]).to_dict(orient="records")
    assert validate_verl_rows(verl_rows) == 7
    by_id = {r["extra_info"]["id"]: r for r in verl_rows}
    assert set(by_id) == set(ids)
    # the system turn stays in the policy's chat; the judge reads the user turn as the question
    for rid, row in by_id.items():
        roles = [m["role"] for m in row["prompt"]]
        assert roles == (["user"] if rid == ids[6] else ["system", "user"])
        assert "tags" not in row["reward_model"]["ground_truth"]

    rubrics = [Rubric.from_row(by_id[i]["reward_model"]["ground_truth"]) for i in ids]
    assert all(r.criteria[0].rule is not None and r.criteria[1].rule is None for r in rubrics)
    judge = RecordingJudge()
    responses = [TWO, ONE] * 3 + [TWO]
    scores = DualScorer(RubricGrader(judge)).score([None] * 7, responses, rubrics)
    # rule (10 points) checked by code, lamp (5) met by the judge, rude (-5) unmet: (10 + 5) / 15 or 5 / 15
    assert scores.point.tolist() == pytest.approx([1.0, 1 / 3] * 3 + [1.0])
    assert scores.reference.tolist() == scores.point.tolist()
    for res, response, rubric in zip(scores.point_results, responses, rubrics):
        assert res.verdicts[0].source == "rule"
        assert res.verdicts[0].met == check_rule(rubric.criteria[0].rule, rubric.question, response)
    assert "paragraphs:two" not in judge.asked and len(judge.asked) == 2 * 7 * 2  # the rule never went to the judge


def test_paragraph_basic_checker_is_checked_as_two_paragraphs_separated_by_stars():
    rule_id, kwargs = rule_from_tags(RULE_TAGS)
    assert (rule_id, kwargs) == ("ifeval:length_constraints:number_paragraphs", {"num_paragraphs": 2})
    rubric = Rubric.from_row(release_row(released(0)))
    rule = rubric.criteria[0].rule
    assert check_rule(rule, rubric.question, TWO) is True
    assert check_rule(rule, rubric.question, ONE) is False
    assert check_rule(rule, rubric.question, TWO + "\n***\nA third one.") is False
    assert check_rule(rule, rubric.question, "A.\n***\n\n***\nB.") is False  # an empty paragraph
    with pytest.raises(ValueError, match="num_paragraphs=3"):
        rule_from_tags(RULE_TAGS | {"parameters": {"num_paragraphs": 3}})


def test_if_verifiable_class_names_are_supported_functions():
    funcs = supported_functions()
    assert funcs["KeywordChecker"][0] == "ifeval:keywords:existence"
    assert funcs["KeywordsMultipleChecker"][0] == "ifbench:count:keywords_multiple"
    rule_id, kwargs = rule_from_tags({"verifier": "rule", "function": "NumberOfWords",
                                      "parameters": {"num_words": 50.0, "relation": "at least", "keywords": None}})
    assert (rule_id, kwargs) == ("ifeval:length_constraints:number_words", {"num_words": 50, "relation": "at least"})
    assert rule_from_tags({"verifier": "llm"}) is None and rule_from_tags({"axis": "completeness"}) is None


def test_an_unsupported_rule_function_is_refused_when_the_file_is_read(tmp_path):
    row = released(0)
    row["Rubrics"][0]["tags"] = {"verifier": "rule", "function": "ParagraphBasicChecker2", "parameters": {}}
    row["reward_model"]["rubrics"] = row["Rubrics"]
    path = _write(tmp_path, [row], "jsonl")
    with pytest.raises(RubricRowError) as info:
        read_rubric_rows(path)
    err = info.value
    assert (err.criterion_index, err.field) == (0, "tags") and "line 1" in str(err)
    assert "'ParagraphBasicChecker2'" in str(err) and "never sent to the judge" in str(err)
    assert "ParagraphBasicChecker, " in str(err) and "KeywordChecker" in str(err)  # the supported ones are listed


@pytest.mark.parametrize("change,match", [
    (lambda r: r["Rubrics"][1]["tags"].update(verifier="human"), "tags.verifier is 'human'"),
    (lambda r: r["Rubrics"][0].update(rule={"id": "ifbench:count:numbers", "kwargs": {"N": 2}}),
     "both a rule and rule tags"),
    (lambda r: r["reward_model"]["rubrics"].append({"criterion": "x", "points": 1}), "Rubrics and reward_model"),
    (lambda r: r["prompt"].append({"role": "user", "content": "And another?"}), "2 user turns"),
    (lambda r: r["Rubrics"][0]["tags"].update(parameters=[2]), "must be a mapping"),
])
def test_malformed_release_rows_are_refused_naming_the_field(change, match):
    row = json.loads(json.dumps(released(0)))
    if "reward_model" not in match:  # edit one copy of the criteria only
        del row["reward_model"]["rubrics"]
    change(row)
    with pytest.raises(RubricRowError, match=match):
        Rubric.from_row(row)


def test_a_renamed_row_keeps_its_rule_tags():
    row = released(0)
    renamed = {"id": "if-0", "question": row["prompt"][1]["content"], "rubrics": row["Rubrics"]}
    rubric = Rubric.from_row(renamed)
    assert rubric.id == "if-0" and rubric.criteria[0].rule.id == "ifeval:length_constraints:number_paragraphs"
    assert Rubric.from_row(rubric.to_row()) == rubric  # our layout carries the rule on
