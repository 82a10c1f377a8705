"""Command line: flags map onto the one configuration, and bad input fails with one clear line before verl starts."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys

import pytest

from setgrpo_verl import cli
from setgrpo_verl.integration.config import field_doc


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


def test_help_of_schema_flags_is_the_field_doc():
    help_text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["calibrate"].format_help().split())
    for key in ("alpha", "beta", "calibration.num_prompts"):
        assert " ".join(field_doc(key).split()) in help_text
        assert f"[algorithm.setgrpo.{key}]" in help_text


def test_flags_override_the_profile():
    args = cli.build_parser().parse_args(["train", "--run-dir", "x", "--profile", "smoke", "-K", "5", "--beta", "0.4",
                                          "--steps", "7", "--tau-grid", "0,0.5"])
    values = cli.overrides_from_args(args)
    smoke = cli.PROFILES["smoke"]
    assert values["actor_rollout_ref.rollout.n"] == 5
    assert values["algorithm.setgrpo.beta"] == 0.4 and values["algorithm.setgrpo.tau_grid"] == [0.0, 0.5]
    assert values["trainer.total_training_steps"] == 7
    assert values["algorithm.setgrpo.calibration.num_prompts"] == smoke["algorithm.setgrpo.calibration.num_prompts"]


def test_dry_run_prints_the_verl_commands(capsys, tmp_path):
    run = tmp_path / "run"
    assert cli.main(["quickstart", "--run-dir", str(run), "--dry-run", "--alpha", "0.3",
                     "trainer.logger=[console,wandb]"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and not run.exists()
    setgrpo, grpo = (shlex.split(line) for line in lines)
    for cmd in (setgrpo, grpo):
        assert cmd[1:3] == ["-m", "verl.trainer.main_ppo"] and "trainer.device=cpu" in cmd
        assert "actor_rollout_ref.rollout.name=transformers" in cmd and "--config-path" not in cmd
        assert cmd[-1] == "trainer.logger=[console,wandb]"  # user overrides come last and win
    assert grpo[grpo.index("--config-name") + 1] == "ppo_trainer" and "algorithm.adv_estimator=grpo" in grpo
    assert not any(a.startswith("algorithm.setgrpo") for a in grpo)
    # the quickstart calibrates and trains in one verl process: no record_path, the record goes to calibration/
    assert setgrpo[setgrpo.index("--config-name") + 1] == "setgrpo_trainer" and "algorithm.setgrpo.alpha=0.3" in setgrpo
    record = (run / "calibration" / "record.json").resolve()
    assert f"algorithm.setgrpo.record_out={record}" in setgrpo
    assert not any(a.startswith(("algorithm.setgrpo.record_path", "algorithm.setgrpo.calibration.only")) for a in setgrpo)
    assert cli.main(["calibrate", "--run-dir", str(run), "--dry-run"]) == 0
    (calibrate,) = (shlex.split(line) for line in capsys.readouterr().out.strip().splitlines())
    assert "algorithm.setgrpo.calibration.only=true" in calibrate
    assert cli.main(["train", "--run-dir", str(run), "--dry-run"]) == 0
    (train,) = (shlex.split(line) for line in capsys.readouterr().out.strip().splitlines())
    assert f"algorithm.setgrpo.record_path={record}" in train


@pytest.mark.parametrize("flags, needle", [
    (["-K", "1"], "--rollout-n must be >= 2"),
    (["--judge", "openai"], "--judge-base-url"),
    (["--judge", "function"], "--reward-function"),
    (["--judge-max-tokens", "64"], "--judge openai only"),
])
def test_invalid_settings(capsys, tmp_path, flags, needle):
    err = _fail(capsys, ["calibrate", "--run-dir", str(tmp_path / "run"), *flags])
    assert needle in err and not (tmp_path / "run").exists()


def test_missing_data_file(capsys, tmp_path):
    err = _fail(capsys, ["calibrate", "--run-dir", str(tmp_path / "run"), "--data", str(tmp_path / "nope.jsonl")])
    assert "no such file" in err and "RubricHub" in err


def test_rubric_row_without_positive_points(capsys, tmp_path):
    rows = _rows(30)
    rows[7]["rubrics"] = [{"criterion": "contains a slur", "points": -2.0}]
    err = _fail(capsys, ["calibrate", "--profile", "smoke", "--run-dir", str(tmp_path / "run"),
                         "--data", _jsonl(tmp_path / "d.jsonl", rows)])
    assert "row-7" in err and "positive points" in err
    assert not (tmp_path / "run" / "calibration").exists()


def test_prompt_set_smaller_than_calibration_needs(capsys, tmp_path):
    err = _fail(capsys, ["calibrate", "--profile", "smoke", "--run-dir", str(tmp_path / "run"),
                         "--data", _jsonl(tmp_path / "d.jsonl", _rows(5))])
    assert "5 of 5 prompts" in err and "--calib-groups" in err
    assert not (tmp_path / "run" / "calibration").exists()


def test_calibration_too_small_for_alpha_and_beta(capsys, tmp_path):
    err = _fail(capsys, ["calibrate", "--run-dir", str(tmp_path / "run"), "--calib-groups", "10",
                         "--alpha", "0.05", "--beta", "0.08", "--delta", "0.05", "--tau-grid", ",".join(
                             str(i / 20) for i in range(20))])
    # alpha 0.05 needs 19 coverage groups; beta 0.08 at 1 - 0.05/20 needs 72 risk groups with no reversal
    assert "--calib-groups 10 is too small" in err and ">= 19 non-degenerate" in err and ">= 72 accepted" in err
    assert "--calib-groups >= 144" in err
    assert not (tmp_path / "run").exists()


def test_unreachable_judge(capsys, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = _fail(capsys, ["calibrate", "--profile", "smoke", "--run-dir", str(tmp_path / "run"), "--judge", "openai",
                         "--judge-base-url", f"http://127.0.0.1:{port}/v1", "--judge-model", "judge"])
    assert f"127.0.0.1:{port}" in err and "probe" in err
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
