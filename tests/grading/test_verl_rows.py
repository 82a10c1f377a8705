"""``--data`` in verl's RL layout (``prompt`` chat list, the rubric in ``reward_model.ground_truth``), such as the
command line's own ``data/train.parquet``: read back as rubric rows (question = last user turn, system turn kept,
stable ids), and a ground truth that is not a rubric refused naming the row."""

import json

import pandas as pd
import pytest

from setgrpo_verl.grading import Rubric, RubricRowError, read_rubric_rows, rubrics_to_verl_rows, write_verl_parquet
from setgrpo_verl.grading.rubric import question_id
from setgrpo_verl.runner import launch
from setgrpo_verl.models import embedded_model_dir

SYSTEM = "You answer in one short paragraph."
CRITERIA = [{"criterion": "It names a colour.", "points": 2.0}, {"criterion": "It is rude.", "points": -1.0}]


def rubric_rows(n):
    return [{"id": f"r{i}", "question": f"What colour is object number {i}?", "rubrics": CRITERIA} for i in range(n)]


def verl_rows(n, *, split="train", ground_truth=None, with_index=True):
    """Rows as verl's preprocessing scripts write them: no id, a positional index, the rubric as bare criteria."""
    rows = []
    for i in range(n):
        prompt = [{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "An earlier question."},
                  {"role": "assistant", "content": "An earlier answer."},
                  {"role": "user", "content": f"What colour is object number {i}?"}]
        extra = {"split": split, **({"index": i} if with_index else {})}
        truth = json.dumps(CRITERIA) if ground_truth is None else ground_truth
        rows.append({"data_source": "colours", "prompt": prompt, "ability": "rubric",
                     "reward_model": {"style": "rubric", "ground_truth": truth}, "extra_info": extra})
    return rows


def test_the_cli_own_parquet_reads_back_as_its_rubric_rows(tmp_path):
    rubrics = [Rubric.from_row(r) for r in rubric_rows(5)]
    path = write_verl_parquet(rubrics_to_verl_rows(rubrics, system_prompt=SYSTEM), tmp_path / "train.parquet")
    read = read_rubric_rows(path)
    assert [Rubric.from_row(r) for r in read] == rubrics  # ids, questions and criteria unchanged
    assert [r["prompt"] for r in read] == [[{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": r.question}] for r in rubrics]
    assert Rubric.from_row(read[0]).messages[0] == {"role": "system", "content": SYSTEM}


def test_question_is_the_last_user_turn_and_the_system_turn_stays(tmp_path):
    path = tmp_path / "verl.parquet"
    pd.DataFrame(verl_rows(3)).to_parquet(path, index=False)
    rubric = Rubric.from_row(read_rubric_rows(path)[2])
    assert rubric.question == "What colour is object number 2?"
    assert [m["role"] for m in rubric.messages] == ["system", "user", "assistant", "user"]
    assert rubric.messages[0]["content"] == SYSTEM
    assert [(c.criterion, c.points) for c in rubric.criteria] == [("It names a colour.", 2.0), ("It is rude.", -1.0)]


def test_ids_come_from_the_row_then_its_qualified_index_then_the_question(tmp_path):
    own = verl_rows(2)
    own[0]["extra_info"]["id"] = "mine-0"
    own[1]["reward_model"]["ground_truth"] = json.dumps({"id": "gt-1", "rubrics": CRITERIA})
    indexed_train, indexed_test = verl_rows(2), verl_rows(2, split="test")
    bare = verl_rows(2, with_index=False)
    ids = {}
    for name, rows in (("own", own), ("train", indexed_train), ("test", indexed_test), ("bare", bare)):
        path = tmp_path / f"{name}.parquet"
        pd.DataFrame(rows).to_parquet(path, index=False)
        ids[name] = [Rubric.from_row(r).id for r in read_rubric_rows(path)]
        assert ids[name] == [Rubric.from_row(r).id for r in read_rubric_rows(path)]  # the same id at every read
    assert ids["own"] == ["mine-0", "gt-1"]
    # the index restarts at 0 in every split: qualified by data source and split, the two files share no id
    assert ids["train"] == ["colours:train:0", "colours:train:1"]
    assert ids["test"] == ["colours:test:0", "colours:test:1"]
    assert ids["bare"] == [question_id(f"What colour is object number {i}?") for i in range(2)]


@pytest.mark.parametrize("truth, shown", [("42", "'42'"), ("", "''"), (None, "None"),
                                          (json.dumps({"answer": 3}), "answer")])
def test_a_ground_truth_that_is_not_a_rubric_is_refused_naming_the_row(tmp_path, truth, shown):
    rows = verl_rows(3)
    rows[1]["reward_model"]["ground_truth"] = truth
    path = tmp_path / "verl.parquet"
    pd.DataFrame(rows).to_parquet(path, index=False)
    with pytest.raises(RubricRowError, match=r"verl\.parquet, row 2.*ground_truth is not a rubric") as info:
        read_rubric_rows(path)
    assert shown in str(info.value)


def test_verl_data_splits_and_the_disjointness_check_holds(tmp_path):
    path = tmp_path / "verl.parquet"
    pd.DataFrame(verl_rows(12)).to_parquet(path, index=False)
    split = launch.split_data(data=path, model_path=embedded_model_dir(), max_prompt_length=256,
                              calibration_prompts=4, seed=0)
    out = launch.write_data(tmp_path / "run", split)
    cal = pd.read_parquet(out["calibration"]).to_dict(orient="records")
    train = pd.read_parquet(out["train"])
    assert len(cal) == 4 and len(train) == 8
    assert {r["extra_info"]["id"] for r in cal} <= {f"colours:train:{i}" for i in range(12)}
    # the split's rows read back through --data keep the ids, so a record's prompts are found in its training data
    again = {Rubric.from_row(r).id for r in read_rubric_rows(out["train"])}
    assert again == set(train["extra_info"].map(lambda e: e["id"]))
    assert again.isdisjoint(r["extra_info"]["id"] for r in cal)
