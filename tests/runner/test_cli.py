"""Command line: parsing, profiles, and bad input that must fail with a clear message before anything runs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from setgrpo_verl import cli, runner


def _fail(capsys, argv) -> str:
    assert cli.main(argv) == 2
    return capsys.readouterr().err


def _rows(n: int, *, points=(1.0,)) -> list[dict]:
    return [{"question": f"Write one short sentence about the number {i}.", "id": f"row-{i}",
             "rubrics": [{"criterion": f"criterion {j}", "points": p} for j, p in enumerate(points)]}
            for i in range(n)]


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_python_dash_m_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "setgrpo_verl", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("calibrate", "train", "report", "quickstart", "inspect-record"):
        assert command in out


def test_flags_override_the_profile():
    args = cli.build_parser().parse_args(["train", "--run-dir", "x", "--profile", "smoke", "-K", "5", "--beta", "0.4",
                                          "--steps", "7", "--no-online-monitor"])
    cfg = runner.RunConfig.from_profile(args.profile, **cli._overrides(args))
    smoke = runner.RunConfig.from_profile("smoke")
    assert (cfg.rollout_n, cfg.beta, cfg.train_steps, cfg.online_monitor) == (5, 0.4, 7, False)
    assert cfg.calib_groups == smoke.calib_groups and cfg.tau_grid == smoke.tau_grid
    assert runner.RunConfig.from_profile("default") == runner.RunConfig()


def test_config_round_trips_through_json(tmp_path):
    cfg = runner.RunConfig.from_profile("smoke", seed=3)
    cfg.to_json(tmp_path / "config.json")
    assert runner.RunConfig.from_json(tmp_path / "config.json") == cfg


@pytest.mark.parametrize("flags, needle", [
    (["-K", "1"], "K >= 2"),
    (["--alpha", "1.5"], "alpha=1.5"),
    (["--judge", "openai"], "--judge-base-url"),
])
def test_invalid_settings(capsys, tmp_path, flags, needle):
    err = _fail(capsys, ["calibrate", "--run-dir", str(tmp_path / "run"), *flags])
    assert needle in err and not (tmp_path / "run").exists()


def test_missing_data_file(capsys, tmp_path):
    err = _fail(capsys, ["calibrate", "--run-dir", str(tmp_path / "run"), "--data", str(tmp_path / "nope.jsonl")])
    assert "no such file" in err and "RubricHub" in err
    assert not (tmp_path / "run").exists()


def test_rubric_row_without_positive_points(capsys, tmp_path):
    rows = _rows(30)
    rows[7]["rubrics"] = [{"criterion": "contains a slur", "points": -2.0}]
    err = _fail(capsys, ["calibrate", "--profile", "smoke", "--run-dir", str(tmp_path / "run"),
                         "--data", _jsonl(tmp_path / "d.jsonl", rows)])
    assert "'row-7'" in err and "positive points" in err
    assert not (tmp_path / "run").exists()


def test_prompt_set_smaller_than_calibration_needs(capsys, tmp_path):
    err = _fail(capsys, ["calibrate", "--profile", "smoke", "--run-dir", str(tmp_path / "run"),
                         "--data", _jsonl(tmp_path / "d.jsonl", _rows(5))])
    assert "5 usable prompts" in err and "--calib-groups" in err
    assert not (tmp_path / "run").exists()


def test_calibration_too_small_for_alpha_and_beta(capsys, tmp_path):
    err = _fail(capsys, ["calibrate", "--run-dir", str(tmp_path / "run"), "--calib-groups", "10",
                         "--alpha", "0.05", "--beta", "0.08"])
    assert "--calib-groups 10 is too small" in err and "alpha=0.05" in err
    assert not (tmp_path / "run").exists()


def test_unreachable_judge(capsys, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = _fail(capsys, ["calibrate", "--profile", "smoke", "--run-dir", str(tmp_path / "run"), "--judge", "openai",
                         "--judge-base-url", f"http://127.0.0.1:{port}/v1", "--judge-model", "judge"])
    assert f"127.0.0.1:{port}" in err and "cannot be reached" in err
    assert not (tmp_path / "run").exists()


def test_inspect_record_and_report_need_a_record(capsys, tmp_path):
    assert "no calibration record" in _fail(capsys, ["inspect-record", str(tmp_path)])
    assert "no finished calibration stage" in _fail(capsys, ["report", "--run-dir", str(tmp_path)])


def test_train_refuses_an_incomplete_calibration(capsys, tmp_path):
    (tmp_path / "run" / "calibration").mkdir(parents=True)
    (tmp_path / "run" / "calibration" / "FAILED").write_text("boom")
    err = _fail(capsys, ["train", "--profile", "smoke", "--run-dir", str(tmp_path / "run")])
    assert "incomplete" in err and "--overwrite" in err
    assert not (tmp_path / "run" / "train_setgrpo").exists()
