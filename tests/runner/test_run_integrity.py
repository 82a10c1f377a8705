"""Run-directory integrity: every check before anything is written, a disjoint duplicate-free split, and a training
split that never holds a prompt the record was calibrated on (no verl process starts in these tests)."""

from __future__ import annotations

import hashlib
import json

import pandas as pd
import pytest

from setgrpo_verl.runner import cli, launch
from setgrpo_verl.core import calibrate, CalibrationRecord, CalibrationSettings
from setgrpo_verl.core.record import prompt_fingerprint
from setgrpo_verl.runner.datasplit import split_matches
from setgrpo_verl.grading import write_verl_parquet
from setgrpo_verl.integration.run_check import check_training_data
from setgrpo_verl.integration.prompts import prompt_identity
from setgrpo_verl.runner.lifecycle import plan_run
from setgrpo_verl.models import embedded_model_dir

from ..core.synthetic import make_groups


def _rows(n: int) -> list[dict]:
    return [{"id": f"p{i}", "question": f"Name a colour number {i}.",
             "rubrics": [{"criterion": "Names a colour.", "points": 1}]} for i in range(n)]


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _split(data: str, seed: int = 1, prompts: int = 12) -> dict:
    return launch.split_data(data=data, model_path=embedded_model_dir(), max_prompt_length=80,
                             calibration_prompts=prompts, seed=seed)


def _digest(run) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((run / "data").iterdir())}


def _fingerprints(rows: list[dict]) -> list[dict]:
    return [prompt_fingerprint(*prompt_identity(r["reward_model"], r["extra_info"], r["prompt"])) for r in rows]


@pytest.fixture()
def finished(tmp_path):
    """What a finished `calibrate --data D --seed 1 --profile smoke` leaves (record from synthetic scores)."""
    data = _jsonl(tmp_path / "prompts.jsonl", _rows(40))
    run = tmp_path / "run"
    split = _split(data)
    launch.write_data(run, split)
    p, r, m = make_groups(60, k=3, seed=2)
    record = calibrate(p, r, m,
                       CalibrationSettings(alpha=0.2, beta=0.5, delta=0.2, tau_grid=(0.0, 0.3),
                                           on_infeasible="reject_all"),
                       metadata={"calibration_prompts": _fingerprints(split["calibration"])})
    (run / "calibration").mkdir()
    record.to_json(run / "calibration" / "record.json")
    (run / "calibration" / launch.COMPLETE).write_text("12.0 s\n")
    return run, data, split


@pytest.mark.parametrize("command", [["calibrate"], ["quickstart", "--no-baseline", "--judge", "local"],
                                     ["validate", "--judge", "local"]])
def test_rerun_without_overwrite_touches_nothing(capsys, finished, command):
    run, data, _ = finished
    before = _digest(run)
    argv = [*command, "--run-dir", str(run), "--data", data, "--profile", "smoke", "--seed", "7"]
    if command[0] == "validate":
        argv += ["--calib-groups", "12", "--alpha", "0.5", "--flip-prob", "0.1"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "calibration is complete: pass --resume to keep it, --overwrite to replace it" in err.replace(f"{run}/", ""), err
    assert _digest(run) == before and not (run / "train_setgrpo").exists()


def test_another_split_into_an_existing_data_dir_is_refused(capsys, finished):
    run, data, split = finished
    for stage in ("calibration",):
        for f in (run / stage).iterdir():
            f.unlink()
        (run / stage).rmdir()
    before = _digest(run)
    assert cli.main(["calibrate", "--run-dir", str(run), "--data", data, "--profile", "smoke", "--seed", "7"]) == 2
    err = capsys.readouterr().err
    assert "already holds another data split" in err and "--overwrite" in err
    assert _digest(run) == before
    # the same settings give the same split: kept as it is, nothing rewritten; another split needs --overwrite
    assert plan_run(run, ["data"], same_data=split_matches(run, _split(data))).action("data") == "keep"
    assert split_matches(run, _split(data, seed=7)) is False
    assert plan_run(run, ["data"], overwrite=True, same_data=False).action("data") != "keep"


@pytest.mark.parametrize(("flags", "needle"), [
    (["--data", "OTHER"], "train --data"),
    (["--calib-groups", "20"], "train --calib-groups 20: the run directory's data split was made with "
                               "--calib-groups 12"),
])
def test_train_refuses_flags_that_would_change_the_split(capsys, finished, tmp_path, flags, needle):
    run, data, _ = finished
    flags = [_jsonl(tmp_path / "other.jsonl", _rows(50)) if f == "OTHER" else f for f in flags]
    assert cli.main(["train", "--run-dir", str(run), "--profile", "smoke", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and "--overwrite" in err and not (run / "train_setgrpo").exists()
    # the flags that name the split it was made with are consistent, hence accepted
    launch.check_split_flags(run, data=data, calib_groups=12)
    (run / "data" / launch.SPLIT_FILE).unlink()  # a split that records no settings cannot be checked
    with pytest.raises(launch.LaunchError, match="records no settings"):
        launch.check_split_flags(run, data=data, calib_groups=None)


def test_split_removes_duplicates_by_id_or_question_text(tmp_path):
    rows = _rows(40)
    rows += [dict(r) for r in rows[:10]]  # ten prompts exported twice
    rows.append({**rows[20], "id": "copy-of-p20", "question": "  name a COLOUR number 20. "})  # same text, new id
    split = _split(_jsonl(tmp_path / "dup.jsonl", rows))
    assert split["duplicates"] == 11
    cal = [r["extra_info"]["id"] for r in split["calibration"]]
    train = [r["extra_info"]["id"] for r in split["train"]]
    assert len(cal) == 12 and len(train) == 28 and not set(cal) & set(train) and len(set(train)) == len(train)
    launch.write_data(tmp_path / "run", split)
    meta = json.loads((tmp_path / "run" / "data" / launch.SPLIT_FILE).read_text())
    assert meta["duplicates_removed"] == 11 and meta["ids"]["calibration"] == cal


def test_training_data_holding_a_calibration_prompt_is_refused(capsys, finished):
    run, _, split = finished
    record = run / "calibration" / "record.json"
    train = run / "data" / "train.parquet"
    loaded = CalibrationRecord.from_json(record)
    check_training_data(loaded, str(train))  # the run's own split is disjoint
    leaked = dict(split["calibration"][3])
    renamed = {**split["calibration"][5], "extra_info": {"id": "fresh-id", "index": 0, "split": "train"}}
    write_verl_parquet(split["train"] + [leaked, renamed], train)
    cal_id = split["calibration"][3]["extra_info"]["id"]
    # through the CLI: exit 2 before any stage directory is written
    assert cli.main(["train", "--run-dir", str(run), "--profile", "smoke"]) == 2
    err = capsys.readouterr().err
    assert f"contains 2 prompt(s) this record was calibrated on, the first {cal_id!r}" in err
    assert not (run / "train_setgrpo").exists()
    # through main_ppo's pre-Ray check (algorithm.setgrpo.record_path): by id and by question text
    with pytest.raises(ValueError, match=r"data.train_files .* contains 2 prompt\(s\)"):
        check_training_data(loaded, [str(train)])
    write_verl_parquet(split["train"] + [renamed], train)
    with pytest.raises(ValueError, match=r"first 'fresh-id' \(same question text as calibration prompt"):
        check_training_data(loaded, str(train))
    assert len(pd.read_parquet(train)) == len(split["train"]) + 1


@pytest.mark.parametrize(("argv", "needle"), [
    (["calibrate", "--rho", "0"], "--rho: rho=0.0 must be > 0 (default 0.1) for the GRPO coefficient map"),
    (["calibrate", "--tau-grid", "0.5,0.2"], "--tau-grid: tau_grid=[0.5, 0.2] must be non-empty, strictly increasing"),
    (["calibrate", "--tau-grid", "0,1"], "strictly inside (-1, 1)"),
    (["calibrate", "--ablation", "fixed_threshold"], "--fixed-tau: fixed_tau=None must be set exactly when"),
    (["validate", "-K", "3", "--calib-batch-size", "35", "--groups-per-step", "3"],
     # verl pads a batch of 105 responses to 108 (a multiple of 3 prompts x K), which 4 divides; not the last one's 90
     "algorithm.setgrpo.sketch.micro_batch_size_per_gpu=4 does not divide the 90 responses that each of the 1 actor "
     "rank(s) gets in the last calibration batch (--calib-groups 240 in batches of 35)"),
])
def test_settings_core_would_refuse_stop_the_command_line_first(capsys, tmp_path, argv, needle):
    """Even --dry-run stops: the command line builds the same CalibrationSettings and micro-batch check as verl's run."""
    run = tmp_path / "run"
    assert cli.main([*argv, "--run-dir", str(run), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert not run.exists()
