"""recipes/prepare_rubrichub.sh: duplicates removed with one line saying how many, disjoint train / calib / test
splits, and the RubricHub_v1 release files read as downloaded."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from setgrpo_verl.grading import drop_duplicate_rows

SCRIPT = Path(__file__).resolve().parents[2] / "recipes" / "prepare_rubrichub.sh"


def _row(i, question=None, rid=None):
    return {"id": rid or f"p{i}", "question": question or f"Write a two-line poem about topic number {i}.",
            "rubrics": [{"criterion": "Has two lines.", "points": 2},
                        {"criterion": "Mentions the topic.", "points": 1}]}


def _prepare(tmp_path, train, test=None, **env):
    out = tmp_path / "out"
    env = {**os.environ, "RUBRICHUB_TRAIN": str(train), "DATA_DIR": str(out), "CALIB_SIZE": "12", "VAL_SIZE": "4",
           "SEED": "0", "PYTHON": sys.executable, "RUBRICHUB_TEST": str(test or ""), **env}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids, questions = {}, {}
    for name in ("train", "calib", "test"):
        rubrics = [json.loads(rm["ground_truth"]) for rm in pd.read_parquet(out / f"{name}.parquet")["reward_model"]]
        ids[name] = [r["id"] for r in rubrics]
        questions[name] = [r["question"] for r in rubrics]
    return proc.stdout, ids, questions


def _disjoint(parts):
    names = list(parts)
    for a in names:
        assert len(set(parts[a])) == len(parts[a]), a  # no duplicate inside a split either
        for b in names[names.index(a) + 1:]:
            assert not set(parts[a]) & set(parts[b]), (a, b)


def test_drop_duplicate_rows_by_id_or_question_text():
    rows = [_row(0), _row(1), _row(0), _row(2, question="Write a two-line  poem about topic number 1. "),
            _row(3, rid="p1")]
    kept, dropped = drop_duplicate_rows(rows)
    assert [r["id"] for r in kept] == ["p0", "p1"] and dropped == 3


@pytest.mark.slow
def test_duplicated_prompts_never_cross_splits(tmp_path):
    rows = [_row(i) for i in range(40)]
    rows += [dict(r) for r in rows[:6]]  # exported twice: same id, same text
    rows += [_row(100 + i, question=rows[10 + i]["question"]) for i in range(4)]  # same text under another id
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stdout, ids, questions = _prepare(tmp_path, train)
    assert "removed 10 duplicate rows (same id or same question text), 40 distinct prompts remain" in stdout
    assert {k: len(v) for k, v in ids.items()} == {"train": 24, "calib": 12, "test": 4}
    _disjoint(ids)
    _disjoint(questions)

    # a separate test file: its prompts (by id or text) are left out of train and calib
    test_rows = [_row(0), _row(200, question=rows[5]["question"]), _row(300)]
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps(r) + "\n" for r in test_rows))
    stdout, ids, questions = _prepare(tmp_path, train, test)
    assert "2 training-file prompts that are also in the test file left out of train / calib" in stdout
    assert {k: len(v) for k, v in ids.items()} == {"train": 26, "calib": 12, "test": 3}
    _disjoint(ids)
    _disjoint(questions)


@pytest.mark.slow
def test_a_release_file_is_read_as_downloaded(tmp_path):
    tags = {"verifier": "rule", "function": "ParagraphBasicChecker", "parameters": {"num_paragraphs": 2.0}}
    rows = []
    for i in range(20):
        criteria = [{"criterion": "paragraphs:two", "points": 10, "tags": tags},
                    {"criterion": f"Mentions lighthouse {i}.", "points": 5, "tags": {"verifier": "llm"}}]
        rows.append({"data_source": "Instruction_Following", "Rubrics": criteria,
                     "prompt": [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": f"Describe lighthouse {i} in two paragraphs."}],
                     "reward_model": {"style": "rubric", "ground_truth": "", "rubrics": criteria},
                     "extra_info": {"index": i}})
    rows.append(dict(rows[3]))  # the same released row twice
    shards = [tmp_path / "rurbichub_v1_Instruction_Following.parquet", tmp_path / "rurbichub_v1_Chat.jsonl"]
    pd.DataFrame(rows[:15]).to_parquet(shards[0], index=False)
    shards[1].write_text("".join(json.dumps(r) + "\n" for r in rows[15:] + [rows[7]]))  # row 7 in both shards
    stdout, ids, questions = _prepare(tmp_path, ",".join(map(str, shards)), CALIB_SIZE="5", VAL_SIZE="3")
    assert "removed 2 duplicate rows" in stdout
    assert {k: len(v) for k, v in ids.items()} == {"train": 12, "calib": 5, "test": 3}
    _disjoint(ids)
    train = pd.read_parquet(tmp_path / "out" / "train.parquet")
    assert [m["role"] for m in train["prompt"][0]] == ["system", "user"]
    rubric = json.loads(train["reward_model"][0]["ground_truth"])
    assert rubric["rubrics"][0]["rule"] == {"id": "ifeval:length_constraints:number_paragraphs",
                                            "kwargs": {"num_paragraphs": 2}}
