"""The composite validation rubrics (docs/validation.md#validation-rubrics): rule criteria that run offline, 3-6
instructions of distinct types with unequal points per prompt, prompts that fit the validate profile, and a
shipped file that ``scripts/make_validation_rubrics.py compose`` reproduces byte for byte."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import pytest

from setgrpo_verl.runner import launch
from setgrpo_verl.grading import NLTK_DATA_RULES, Rubric, Rule, check_rule, load_validation_rubrics
from setgrpo_verl.grading.convert import validation_rubrics_file
from setgrpo_verl.grading.rules import rule_description, validate_rule
from setgrpo_verl.models import embedded_model_dir

REPO = Path(__file__).resolve().parents[2]
RESPONSES = ("Sure, here is a short note about the rain and my umbrella.",
             '<<Rain>>\n* It rains.\n* I stay in with 3 cups of tea [here].', "")


def _script():
    spec = importlib.util.spec_from_file_location("make_validation_rubrics",
                                                  REPO / "scripts" / "make_validation_rubrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return load_validation_rubrics()


@pytest.fixture(scope="module")
def met_rates() -> dict:
    return json.loads(validation_rubrics_file("validation_rubrics_met_rates.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_model_dir()), local_files_only=True)


def test_rows_parse_with_stable_ids_and_distinct_questions(rows):
    assert len(rows) == 3000
    assert [r["id"] for r in rows] == [f"ifcomp-{i:04d}" for i in range(3000)]
    assert len({" ".join(r["question"].split()) for r in rows}) == 3000
    rubrics = [Rubric.from_row(r) for r in rows]
    assert all(r.to_row() == {"question": row["question"], "id": row["id"], "rubrics": row["rubrics"]}
               for r, row in zip(rubrics, rows))
    assert load_validation_rubrics(limit=5) == rows[:5]
    with pytest.raises(ValueError, match="limit=-1"):
        load_validation_rubrics(limit=-1)


def test_every_criterion_is_a_kept_rule_that_runs_offline(rows, met_rates):
    kept = {t for t, e in met_rates["types"].items() if e["kept"]}
    rules = {}
    for row in rows:
        for c in row["rubrics"]:
            rule = Rule(c["rule"]["id"], c["rule"]["kwargs"])
            assert c["criterion"] == "The response follows this instruction: " + " ".join(
                rule_description(rule).split())
            rules[json.dumps(c["rule"], sort_keys=True)] = (rule, row["question"])
    assert {r.id for r, _ in rules.values()} == kept  # every kept type is used, and only those
    assert not {f"ifbench:{i}" for i in NLTK_DATA_RULES} & kept
    verdicts = {}
    for rule, question in rules.values():
        validate_rule(rule)
        verdicts.setdefault(rule.id, set()).update(check_rule(rule, question, r) for r in RESPONSES)
    assert all(v <= {True, False} for v in verdicts.values())
    # verdicts that the sample responses settle: a comma in the first, a title, 2 bullets, a placeholder in the second
    settled = {"ifeval:punctuation:no_comma": {}, "ifeval:detectable_format:title": {},
               "ifeval:detectable_format:number_bullet_lists": {"num_bullets": 2},
               "ifeval:detectable_content:number_placeholders": {"num_placeholders": 1}}
    for rule_id, kwargs in settled.items():
        assert rule_id in verdicts
        assert [check_rule(Rule(rule_id, kwargs), "", r) for r in RESPONSES[:2]] == [False, True], rule_id
    assert all(not check_rule(rule, q, "") for rule, q in rules.values())  # an empty response meets nothing


def _distinct_scores(points: list[float]) -> int:
    total = sum(points)
    return len({round(sum(s) / total, 9) for k in range(len(points) + 1) for s in itertools.combinations(points, k)})


def test_prompts_have_3_to_6_distinct_types_with_unequal_points(rows):
    counts, values = [], []
    for row in rows:
        types = [c["rule"]["id"] for c in row["rubrics"]]
        points = [c["points"] for c in row["rubrics"]]
        assert 3 <= len(types) <= 6 and len(set(types)) == len(types), row["id"]
        assert len(set(points)) == len(points) and all(p in range(1, 7) for p in points), row["id"]
        lengths = [t for t in types if t in ("ifeval:length_constraints:number_words", "ifbench:count:word_count_range",
                                             "ifbench:count:unique_word_count")]
        assert len(lengths) <= 1, row["id"]  # word-count instructions could contradict each other
        assert not {"ifeval:detectable_format:title", "ifeval:startend:quotation"} <= set(types)  # ifeval conflict
        counts.append(len(types))
        values.append(_distinct_scores(points))
    assert sum(values) / len(values) > 5
    assert min(values) >= 7  # 3 distinct positive integers already give 7 or 8 score values
    assert len(set(counts)) >= 3  # not all prompts of one size


def test_prompts_fit_the_validate_profile(rows, tokenizer):
    lengths = [len(tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False))
               for r in rows]
    assert max(lengths) <= 128
    assert min(lengths) > 40  # the chat template (about 30 tokens), a task and 3 instructions


def test_met_rate_table_keeps_informative_types_at_the_validate_settings(met_rates):
    settings = met_rates["settings"]
    assert settings["max_new_tokens"] == 48 and settings["samples_per_prompt"] == 4
    assert settings["temperature"] == 1.0 and settings["top_p"] == 1.0 and settings["prompts"] >= 200
    lo, hi = settings["met_range"]
    for rule_id, entry in met_rates["types"].items():
        measured = "met_rate" in entry
        if entry["kept"]:
            assert lo <= entry["met_rate"] <= hi and entry["disagreement"] >= settings["min_disagreement"], rule_id
        elif measured:
            assert not (lo <= entry["met_rate"] <= hi) or entry["disagreement"] < settings["min_disagreement"]
        assert entry["why"]


def test_compose_reproduces_the_shipped_file(met_rates, tokenizer):
    script = _script()
    rows = script.compose_rows(met_rates, seed=script.COMPOSE_SEED, rows=script.ROWS, tokenizer=tokenizer)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    assert text.encode("utf-8") == validation_rubrics_file().read_bytes()


def test_compose_refuses_a_table_measured_with_other_kwargs(met_rates, tokenizer):
    script = _script()
    kept = sorted(t for t, e in met_rates["types"].items() if e["kept"] and e["kwargs_choices"])
    changed = json.loads(json.dumps(met_rates))
    changed["types"][kept[0]]["kwargs_choices"] = {"bogus": [1]}
    with pytest.raises(ValueError, match="re-run measure"):
        script.compose_rows(changed, seed=0, rows=3, tokenizer=tokenizer)


def test_validate_default_data_is_the_composite_rubrics():
    split = launch.split_data(data=None, model_path=embedded_model_dir(), max_prompt_length=128,
                              calibration_prompts=192, seed=0, rules_only=True, default_data="validation")
    assert split["source"] == "the embedded composite validation rubrics (rule criteria only)"
    assert len(split["calibration"]) == 192 and len(split["train"]) == 3000 - 192  # none dropped as overlong
    assert all(r["extra_info"]["id"].startswith("ifcomp-") for r in split["calibration"])
    with pytest.raises(launch.LaunchError, match="use one of ifbench, validation"):
        launch.split_data(data=None, model_path=embedded_model_dir(), max_prompt_length=128,
                          calibration_prompts=192, seed=0, rules_only=True, default_data="bogus")


def test_more_rows_extend_the_shipped_file_and_feed_a_larger_calibration(tmp_path):
    out = tmp_path / "rubrics.jsonl"
    _script().main(["compose", "--rows", "3040", "--out", str(out)])
    lines = out.read_text(encoding="utf-8").splitlines()
    shipped = validation_rubrics_file().read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3040 and lines[:3000] == shipped
    extra = [json.loads(line) for line in lines[3000:]]
    assert [r["id"] for r in extra] == [f"ifcomp-{i}" for i in range(3000, 3040)]
    assert len({r["question"] for r in map(json.loads, lines)}) == 3040
    split = launch.split_data(data=out, model_path=embedded_model_dir(), max_prompt_length=128,
                              calibration_prompts=3020, seed=0, rules_only=True, default_data="validation")
    assert len(split["calibration"]) == 3020 and len(split["train"]) == 20


def test_a_calibration_larger_than_the_embedded_rows_says_how_to_make_more():
    from setgrpo_verl.runner.cli import PROFILES

    groups = PROFILES["paper"]["algorithm.setgrpo.calibration.num_prompts"]
    with pytest.raises(launch.LaunchError, match=f"calibration needs {groups}") as err:
        launch.split_data(data=None, model_path=embedded_model_dir(), max_prompt_length=128,
                          calibration_prompts=groups, seed=0, rules_only=True, default_data="validation")
    assert f"make_validation_rubrics.py compose --rows {groups + 500} --out rubrics.jsonl" in str(err.value)
