"""The record names what it was calibrated on and which package versions wrote it."""

import dataclasses
import json
import warnings

import pytest

from setgrpo_verl.core import calibrate, CalibrationRecord, CalibrationSettings
from setgrpo_verl.core.record import package_versions, prompt_fingerprint, question_key, RecordVersionWarning
from setgrpo_verl.core.compatibility import check_disjoint

from .synthetic import make_groups

SETTINGS = CalibrationSettings(alpha=0.2, beta=0.5, delta=0.2, tau_grid=(0.0, 0.3), on_infeasible="reject_all")
QUESTIONS = [f"Write a two-line poem about topic number {i}." for i in range(60)]


@pytest.fixture(scope="module")
def record():
    p, r, m = make_groups(60, k=4, seed=3)
    prompts = [prompt_fingerprint(f"p{i}", q, [{"criterion": "Has two lines.", "points": 2}])
               for i, q in enumerate(QUESTIONS)]
    return calibrate(p, r, m, SETTINGS, metadata={"calibration_prompts": prompts})


def test_fingerprints_round_trip_and_hash_the_normalised_question(record, tmp_path):
    assert len(record.calibration_prompts) == 60 and record.calibration_prompts[0]["id"] == "p0"
    a = prompt_fingerprint("x", "  Write  a POEM.\n", [1])
    assert a == prompt_fingerprint("y", "write a poem.", [1]) | {"id": "x"}
    assert a["rubric_sha256"] != prompt_fingerprint("x", "Write a poem.", [2])["rubric_sha256"]
    assert question_key(" A\tb  C ") == "a b c"
    path = tmp_path / "record.json"
    record.to_json(path)
    assert CalibrationRecord.from_json(path) == record
    with pytest.raises(ValueError, match="calibration_prompts must be"):
        dataclasses.replace(record, calibration_prompts=({"id": "p0"},))


def test_training_prompts_from_the_calibration_set_are_refused_by_id_or_text(record):
    fresh = [(f"t{i}", f"A fresh question {i}.") for i in range(5)]
    check_disjoint(record, fresh)
    with pytest.raises(ValueError, match=r"train.parquet contains 1 prompt\(s\) this record was calibrated on, the "
                                         r"first 'p7' \(same id as calibration prompt 'p7'"):
        check_disjoint(record, fresh + [("p7", "another text")], source="train.parquet")
    # same question under another id, with other spacing and case
    with pytest.raises(ValueError, match=r"2 prompt\(s\).*first 'new-3' \(same question text as calibration prompt "
                                         r"'p3'"):
        check_disjoint(record, fresh + [("new-3", "  write a two-line poem about TOPIC number 3. "),
                                       (None, QUESTIONS[9])])


def _other_version(record, **versions):
    return dataclasses.replace(record, package_versions={**record.package_versions, **versions})


def test_another_major_minor_warns_naming_both_versions(record, tmp_path):
    installed = package_versions()
    path = tmp_path / "old.json"
    _other_version(record, **{"setgrpo-verl": "0.0.9", "verl": "0.8.0"}).to_json(path)
    with pytest.warns(RecordVersionWarning) as caught:
        CalibrationRecord.from_json(path)
    text = str(caught[0].message)
    assert f"setgrpo-verl 0.0.9 (installed {installed['setgrpo-verl']})" in text
    assert f"verl 0.8.0 (installed {installed['verl']})" in text
    # a patch release only: no warning
    major, minor = installed["verl"].split(".")[:2]
    _other_version(record, verl=f"{major}.{minor}.99").to_json(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecordVersionWarning)
        CalibrationRecord.from_json(path)


def test_another_schema_or_shape_stays_an_error(record, tmp_path):
    data = record.to_dict()
    with pytest.raises(ValueError,
                       match=r"schema_version is 2, this package reads 6 \(and 3, 4, 5, migrated on reading\); recalibrate"):
        CalibrationRecord.from_dict({**data, "schema_version": 2})
    path = tmp_path / "list.json"
    path.write_text(json.dumps([data]))
    with pytest.raises(ValueError, match="a calibration record is a JSON object, got a JSON list"):
        CalibrationRecord.from_json(path)
