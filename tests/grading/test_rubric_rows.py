"""Malformed rubric rows are refused where data enters, naming the row, the criterion and the field.

One validator (``Rubric.from_row``) serves every entry point: the ``--data`` file reader, the verl converters and
the verl reward manager. The CLI turns its error into one ``error:`` line and exit status 2 before any model loads.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from setgrpo_verl.grading import Rubric, RubricRowError, read_rubric_rows, rubrics_to_verl_rows

GOOD = {"id": "ok-1", "question": "Write one sentence about the number 3.", "rubrics": [
    {"criterion": "The response is one sentence.", "points": 2},
    {"criterion": "Uses the word 'three' once", "points": 1,
     "rule": {"id": "ifbench:count:keywords_multiple",
              "kwargs": {"keyword1": "three", "keyword2": "number", "keyword3": "one", "keyword4": "two",
                         "keyword5": "four"}}}]}


def _with(criterion_1: dict | None = None, **row) -> dict:
    out = json.loads(json.dumps(GOOD))
    if criterion_1 is not None:
        out["rubrics"][1] = criterion_1
    out.update(row)
    return out


# (row, expected row_id, criterion index, field)
MALFORMED = {
    "points null": (_with({"criterion": "Mentions the number.", "points": None}), "ok-1", 1, "points"),
    "points not numeric": (_with({"criterion": "Mentions the number.", "points": "high"}), "ok-1", 1, "points"),
    "points numeric string": (_with({"criterion": "Mentions the number.", "points": "3"}), "ok-1", 1, "points"),
    "points bool": (_with({"criterion": "Mentions the number.", "points": True}), "ok-1", 1, "points"),
    "points inf": (_with({"criterion": "Mentions the number.", "points": float("inf")}), "ok-1", 1, "points"),
    "points missing": (_with({"criterion": "Mentions the number."}), "ok-1", 1, "points"),
    "criterion null": (_with({"criterion": None, "points": 1}), "ok-1", 1, "criterion"),
    "criterion blank": (_with({"criterion": "  \n", "points": 1}), "ok-1", 1, "criterion"),
    "criterion not text": (_with({"criterion": 7, "points": 1}), "ok-1", 1, "criterion"),
    "criterion not a mapping": (_with("Mentions the number"), "ok-1", 1, None),
    "rule id misspelled": (_with({"criterion": "Uses 'seven' twice", "points": 1, "rule": {
        "id": "ifbench:count:keyword_multiple", "kwargs": {"keyword1": "seven"}}}), "ok-1", 1, "rule.id"),
    "rule benchmark unknown": (_with({"criterion": "c", "points": 1, "rule": {"id": "ifevil:x"}}), "ok-1", 1, "rule.id"),
    "rule kwargs incomplete": (_with({"criterion": "c", "points": 1, "rule": {
        "id": "ifbench:count:word_count_range", "kwargs": {"min_words": 3}}}), "ok-1", 1, "rule.kwargs"),
    "rule kwargs not a mapping": (_with({"criterion": "c", "points": 1, "rule": {
        "id": "ifbench:count:word_count_range", "kwargs": [3, 5]}}), "ok-1", 1, "rule.kwargs"),
    "rule without id": (_with({"criterion": "c", "points": 1, "rule": {"kwargs": {}}}), "ok-1", 1, "rule"),
    "question null": (_with(question=None), "ok-1", None, "question"),
    "question blank": (_with(question=" "), "ok-1", None, "question"),
    "rubrics not a list": (_with(rubrics={"criterion": "c", "points": 1}), "ok-1", None, "rubrics"),
    "rubrics empty": (_with(rubrics=[]), "ok-1", None, "rubrics"),
    "all points zero": (_with(rubrics=[{"criterion": "c", "points": 0}]), "ok-1", None, "rubrics"),
    "chat prompt malformed": (_with(prompt=[{"role": "user"}]), "ok-1", None, "prompt"),
    "id not a string": (_with(id=["a"]), None, None, "id"),
}


def test_good_row_is_accepted_with_its_values():
    r = Rubric.from_row(GOOD)
    assert [(c.criterion, c.points) for c in r.criteria] == [("The response is one sentence.", 2.0),
                                                            ("Uses the word 'three' once", 1.0)]
    assert r.criteria[1].rule.id == "ifbench:count:keywords_multiple"


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_row_is_refused_naming_row_criterion_and_field(case):
    row, row_id, index, field = MALFORMED[case]
    with pytest.raises(RubricRowError) as info:
        Rubric.from_row(row)
    err = info.value
    assert isinstance(err, ValueError)  # callers that catch ValueError (the CLI) see it
    assert (err.row_id, err.criterion_index, err.field) == (row_id, index, field)
    if row_id is not None:
        assert repr(row_id) in str(err)
    if index is not None:
        assert f"rubrics[{index}]" in str(err)
    # the JSON string form (verl's reward_model.ground_truth) is refused the same way
    if case not in ("points inf",):
        with pytest.raises(RubricRowError) as again:
            Rubric.from_row(json.dumps(row))
        assert (again.value.row_id, again.value.criterion_index, again.value.field) == (row_id, index, field)


def test_misspelled_rule_id_suggests_the_registered_one():
    row = MALFORMED["rule id misspelled"][0]
    with pytest.raises(RubricRowError) as info:
        Rubric.from_row(row)
    assert "'ifbench:count:keywords_multiple'" in info.value.reason


def test_file_reader_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    bad = _with({"criterion": "Mentions the number.", "points": None}, id="p5")
    path.write_text("\n".join(json.dumps(r) for r in [GOOD, _with(id="p2"), bad, _with(id="p9")]) + "\n\n")
    with pytest.raises(RubricRowError) as info:
        read_rubric_rows(path)
    assert info.value.location == f"{path}, line 3"
    assert (info.value.row_id, info.value.criterion_index, info.value.field) == ("p5", 1, "points")
    # a line that is not JSON is named too
    path.write_text(json.dumps(GOOD) + "\n{\"id\": \"x\",\n")
    with pytest.raises(ValueError, match=r"line 2"):
        read_rubric_rows(path)
    # a parquet file (RubricHub's own layout) gets the same checks
    import pandas as pd

    pq = tmp_path / "rows.parquet"
    pd.DataFrame([_with(id="a"), _with({"criterion": None, "points": 1.0}, id="b")]).to_parquet(pq)
    with pytest.raises(RubricRowError) as info:
        read_rubric_rows(pq)
    assert (info.value.location, info.value.row_id, info.value.field) == (f"{pq}, row 2", "b", "criterion")


def test_converter_refuses_unknown_rule_before_writing():
    rows = [GOOD, MALFORMED["rule id misspelled"][0] | {"id": "q7"}]
    with pytest.raises(RubricRowError) as info:
        rubrics_to_verl_rows(rows)
    assert (info.value.location, info.value.row_id, info.value.criterion_index, info.value.field) == (
        "input row 2", "q7", 1, "rule.id")


def test_cli_data_gives_one_error_line_and_exit_2_before_any_model_loads(tmp_path):
    """The rule id is the case that used to fail only after the policy had loaded and rolled out."""
    data = tmp_path / "data.jsonl"
    rows = [_with(id=f"r{i}") for i in range(12)]
    bad = "rule id misspelled"
    rows[7] = MALFORMED[bad][0] | {"id": "r7"}
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(
        [sys.executable, "-m", "setgrpo_verl", "calibrate", "--run-dir", str(run_dir), "--profile", "smoke",
         "--data", str(data), "--judge", "openai", "--judge-base-url", "http://127.0.0.1:9/v1", "--judge-model", "m"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0] == proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"{data}, line 8" in errors[0] and "'r7'" in errors[0] and "rubrics[1].rule.id" in errors[0]
    # refused before the judge probe, the policy load and the rollouts: no calibration stage was started
    assert not (run_dir / "calibration").exists()


def test_a_criterion_listed_twice_is_refused_with_the_row_count_or_kept_once(tmp_path):
    from setgrpo_verl.grading import read_rubric_rows, validate_verl_rows, rubrics_to_verl_rows
    from setgrpo_verl.grading.convert import convert_rubric_file

    twice = {"id": "r1", "question": "Q1?", "rubrics": [
        {"criterion": "Is short.", "points": 2}, {"criterion": "Is polite.", "points": 1},
        {"criterion": "  Is   short. ", "points": 2}]}
    clean = {"id": "r2", "question": "Q2?", "rubrics": [{"criterion": "Is short.", "points": 1}]}
    also = {"id": "r3", "question": "Q3?", "rubrics": [{"criterion": "A.", "points": 1}, {"criterion": "A.", "points": 1}]}
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in (twice, clean, also)))
    with pytest.raises(RubricRowError) as info:
        read_rubric_rows(src)
    message = str(info.value)
    assert "line 1: rubric row 'r1', rubrics[2].criterion: lists criterion 2 again as criterion 0" in message
    assert "2 of 3 rows repeat a criterion" in message and "duplicate_criteria='keep_one'" in message
    kept = read_rubric_rows(src, duplicate_criteria="keep_one")
    assert [[c["criterion"] for c in r["rubrics"]] for r in kept] == [["Is short.", "Is polite."], ["Is short."],
                                                                      ["A."]]
    with pytest.raises(RubricRowError, match="2 of 3 rows repeat a criterion"):
        validate_verl_rows(rubrics_to_verl_rows([twice, clean, also]), source="train.parquet")
    out = convert_rubric_file(src, tmp_path / "train.parquet", duplicate_criteria="keep_one")
    import pandas as pd

    assert validate_verl_rows(pd.read_parquet(out).to_dict(orient="records")) == 3
