"""Converters: RubricHub files and the embedded IFBench data -> rows that verl's RLHFDataset loads."""

import json

import pandas as pd
import pytest
from omegaconf import OmegaConf

from setgrpo_verl.grading import (
    NLTK_DATA_RULES,
    IFBENCH_QUALITY_CRITERIA,
    Rubric,
    check_rule,
    convert_rubric_file,
    ifbench_to_verl,
    load_ifbench_rubrics,
    read_rubric_rows,
)

RUBRICHUB_ROWS = [
    {"question": "How do I treat a mild burn?", "id": "med-1", "rubrics": [
        {"criterion": "Advises cooling the burn under running water", "points": 5},
        {"criterion": "Recommends applying butter", "points": -5},
        {"criterion": "Suggests seeing a doctor if blistering is severe", "points": 3}]},
    {"question": "Write a two-line poem about rain.", "id": "wr-7", "rubrics": [
        {"criterion": "Has exactly two lines", "points": 2},
        {"criterion": "Mentions rain", "points": 1}]},
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from setgrpo_verl.models import embedded_model_dir

    return AutoTokenizer.from_pretrained(str(embedded_model_dir()))


def _verl_dataset(path, tokenizer, tmp_path, max_prompt_length=1024):
    from verl.utils.dataset.rl_dataset import RLHFDataset

    config = OmegaConf.create({"max_prompt_length": max_prompt_length, "filter_overlong_prompts": True,
                               "filter_overlong_prompts_workers": 1, "cache_dir": str(tmp_path / "verl_cache")})
    return RLHFDataset(str(path), tokenizer, config)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_rubrichub_file_to_verl_dataset(fmt, tokenizer, tmp_path):
    src = tmp_path / f"rubrichub.{fmt}"
    if fmt == "jsonl":
        src.write_text("\n".join(json.dumps(r) for r in RUBRICHUB_ROWS) + "\n")
    else:  # RubricHub's own parquet layout: rubrics as a list-of-struct column
        pd.DataFrame(RUBRICHUB_ROWS).to_parquet(src)
    assert read_rubric_rows(src)[0]["rubrics"][1]["points"] == -5
    dst = convert_rubric_file(src, tmp_path / "train.parquet", data_source="rubrichub")
    ds = _verl_dataset(dst, tokenizer, tmp_path)
    assert len(ds) == 2
    row = ds[1]
    assert row["data_source"] == "rubrichub"
    assert row["raw_prompt"] == [{"role": "user", "content": "Write a two-line poem about rain."}]
    assert row["reward_model"]["style"] == "rubric" and row["extra_info"]["id"] == "wr-7" and row["index"] == 1
    rubric = Rubric.from_row(row["reward_model"]["ground_truth"])
    assert rubric == Rubric.from_row(RUBRICHUB_ROWS[1])


def test_ifbench_rubrics(tokenizer, tmp_path, ifbench_samples):
    rows = load_ifbench_rubrics()
    assert len(rows) == 294 and len({r["id"] for r in rows}) == 294
    n_rule = n_nltk = 0
    for row in rows:
        rubric = Rubric.from_row(row)
        quality = [(c.criterion, c.points) for c in rubric.criteria[-len(IFBENCH_QUALITY_CRITERIA):]]
        assert quality == list(IFBENCH_QUALITY_CRITERIA)
        for c in rubric.criteria[: -len(IFBENCH_QUALITY_CRITERIA)]:
            assert c.points == 3.0 and c.criterion.startswith("The response follows this instruction: ")
            if c.rule is None:
                n_nltk += 1
            else:
                n_rule += 1
                assert c.rule.id.split(":", 1)[1] not in NLTK_DATA_RULES
                # every rule criterion runs offline on the package's real sample output (no crash)
                check_rule(c.rule, rubric.question, ifbench_samples[rubric.question])
    assert (n_rule, n_nltk) == (310, 25)  # 335 instructions: 310 checked by code, 25 (NLTK data) judged
    assert load_ifbench_rubrics(limit=5) == rows[:5]
    path = ifbench_to_verl(tmp_path / "ifbench.parquet")
    ds = _verl_dataset(path, tokenizer, tmp_path, max_prompt_length=4096)
    assert len(ds) == 294
    # verl's overlong-prompt filter applies as usual: one IFBench prompt has 2591 chat tokens
    assert len(_verl_dataset(path, tokenizer, tmp_path, max_prompt_length=1024)) == 293
    assert ds[0]["data_source"] == "ifbench" and ds[0]["raw_prompt"][0]["content"] == rows[0]["question"]


def test_verl_dataset_path_refuses_a_malformed_rubric_row(tokenizer, tmp_path):
    """verl's dataset hook (data.custom_cls) with RubricRLHFDataset: a rubric row written by hand (not through the
    converter) with null points fails when verl builds the dataset, naming the file, row, id, criterion and field."""
    from verl.trainer.ppo.utils import create_rl_dataset

    from setgrpo_verl.grading import RubricRowError, rubrics_to_verl_rows
    from setgrpo_verl.grading.verl_dataset import RubricRLHFDataset

    good = rubrics_to_verl_rows(RUBRICHUB_ROWS)
    bad = json.loads(json.dumps(good[1]))
    gt = json.loads(bad["reward_model"]["ground_truth"])
    gt["rubrics"][1]["points"] = None
    bad["reward_model"]["ground_truth"] = json.dumps(gt)
    bad["extra_info"]["index"] = 2
    config = OmegaConf.create({
        "max_prompt_length": 1024, "filter_overlong_prompts": True, "filter_overlong_prompts_workers": 1,
        "cache_dir": str(tmp_path / "verl_cache"),
        "custom_cls": {"path": "pkg://setgrpo_verl.grading.verl_dataset", "name": "RubricRLHFDataset"}})
    ok_path, bad_path = tmp_path / "ok.parquet", tmp_path / "bad.parquet"
    pd.DataFrame(good).to_parquet(ok_path)
    pd.DataFrame(good + [bad]).to_parquet(bad_path)
    ds = create_rl_dataset(str(ok_path), config, tokenizer, None)
    assert type(ds) is RubricRLHFDataset and len(ds) == 2 and ds[1]["extra_info"]["id"] == "wr-7"
    with pytest.raises(RubricRowError) as info:
        create_rl_dataset(str(bad_path), config, tokenizer, None)
    err = info.value
    assert (err.location, err.row_id, err.criterion_index, err.field) == (f"{bad_path}, row 3", "wr-7", 1, "points")
