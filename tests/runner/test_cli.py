"""Command line: flags map onto the one configuration, and bad input fails with one clear line before verl starts."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys

import pytest

from setgrpo_verl.runner import cli
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
    for command in ("calibrate", "train", "report", "quickstart", "inspect-record", "validate"):
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


def test_the_default_quickstart_trains_setgrpo_only_and_baseline_adds_verls_grpo(capsys, tmp_path):
    for flags, stages in (((), ["train_setgrpo"]), (("--baseline",), ["train_setgrpo", "train_grpo"])):
        assert cli.main(["quickstart", "--run-dir", str(tmp_path / "run"), "--dry-run", *flags]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        commands = [shlex.split(x) for x in out if not x.startswith("[")]
        assert [c[c.index("--config-name") + 1] for c in commands] == ["setgrpo_trainer", "ppo_trainer"][:len(stages)]
        planned = [p.split("run/")[1].split("/")[0] for p in out if p.startswith("[setgrpo-verl] plan:")]
        assert [d for d in planned if d.startswith("train_")] == stages


def test_dry_run_prints_the_verl_commands(capsys, tmp_path):
    run = tmp_path / "run"
    assert cli.main(["quickstart", "--run-dir", str(run), "--dry-run", "--baseline", "--alpha", "0.3",
                     "trainer.logger=[console,wandb]"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    plan, lines = [x for x in out if x.startswith("[setgrpo-verl] plan:")], [x for x in out if not x.startswith("[")]
    assert len(lines) == 2 and not run.exists()
    # the CPU backend's runs: the GPU environment checks are not run, and the dry run says so
    (checks,) = [x for x in out if x.startswith("[setgrpo-verl] checks:")]
    assert "GPU environment checks" in checks and "were not run" in checks and "R580" in checks
    assert [p.split(f"{run}/")[1] for p in plan] == [f"{d}/ (absent): create, written by this command" for d in
                                                     ("data", "calibration", "train_setgrpo", "train_grpo", "report")]
    setgrpo, grpo = (shlex.split(line) for line in lines)
    for cmd in (setgrpo, grpo):
        assert cmd[1:3] == ["-m", "verl.trainer.main_ppo"] and "trainer.device=cpu" in cmd
        assert "actor_rollout_ref.rollout.name=transformers" in cmd and "--config-path" not in cmd
        # user overrides come last and win; a tracker list keeps the file logger that metrics.jsonl is
        assert cmd[-1] == "trainer.logger=[console,wandb,file]"
        # Hydra's outputs/ goes to the stage directory, not to the directory the command runs from
        stage = "train_grpo" if cmd is grpo else "train_setgrpo"
        assert f"hydra.run.dir={(run / stage / 'hydra').resolve()}" in cmd
    assert grpo[grpo.index("--config-name") + 1] == "ppo_trainer" and "algorithm.adv_estimator=grpo" in grpo
    assert not any(a.startswith("algorithm.setgrpo") for a in grpo)
    # GRPO reads the point score alone: one grader call per response, counted by the graded sync trainer
    assert [a for a in grpo if "scorings" in a or "trainer_mode" in a] == ["+reward.reward_kwargs.scorings=1",
                                                                           "trainer.v1.trainer_mode=graded_sync"]
    # the quickstart calibrates and trains in one verl process: no record_path, the record goes to calibration/
    assert setgrpo[setgrpo.index("--config-name") + 1] == "setgrpo_trainer" and "algorithm.setgrpo.alpha=0.3" in setgrpo
    record = (run / "calibration" / "record.json").resolve()
    assert f"algorithm.setgrpo.record_out={record}" in setgrpo
    assert not any(a.startswith(("algorithm.setgrpo.record_path", "algorithm.setgrpo.calibration.only")) for a in setgrpo)
    assert cli.main(["calibrate", "--run-dir", str(run), "--dry-run"]) == 0
    (calibrate,) = (shlex.split(line) for line in capsys.readouterr().out.strip().splitlines() if line[0] != "[")
    assert "algorithm.setgrpo.calibration.only=true" in calibrate
    # train needs the calibration: its dry run fails as the command would, after printing the plan and command
    assert cli.main(["train", "--run-dir", str(run), "--dry-run"]) == 2
    (train,) = (shlex.split(line) for line in capsys.readouterr().out.strip().splitlines() if line[0] != "[")
    assert f"algorithm.setgrpo.record_path={record}" in train
    # SetGRPO's stages keep the default two scorings (their check before Ray refuses one)
    assert not any("scorings" in a or "trainer_mode" in a for a in (*setgrpo, *calibrate, *train))
    assert cli.main(["train", "--run-dir", str(run), "--dry-run", "--estimator", "grpo"]) == 2
    (baseline,) = (shlex.split(line) for line in capsys.readouterr().out.strip().splitlines() if line[0] != "[")
    assert "+reward.reward_kwargs.scorings=1" in baseline and "trainer.v1.trainer_mode=graded_sync" in baseline


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
    assert "--max-prompt-length" not in err  # every prompt fits: a longer prompt length would not help
    assert not (tmp_path / "run" / "calibration").exists()
    # prompts dropped as too long, but too few even if all fitted: a longer prompt length would not help either
    err = _fail(capsys, ["calibrate", "--profile", "smoke", "--run-dir", str(tmp_path / "run"), "--data",
                         str(tmp_path / "d.jsonl"), "--max-prompt-length", "5"])
    assert "0 of 5 prompts fit in 5 prompt tokens" in err and "--max-prompt-length" not in err
    # prompts dropped as too long from a file that holds enough: then a longer prompt length is one of the fixes
    err = _fail(capsys, ["calibrate", "--profile", "smoke", "--run-dir", str(tmp_path / "run"), "--data",
                         _jsonl(tmp_path / "e.jsonl", _rows(20)), "--max-prompt-length", "5"])
    assert "0 of 20 prompts fit in 5 prompt tokens" in err and "raise --max-prompt-length, lower --calib-groups" in err


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


def test_paper_dry_run_without_data_names_the_compose_command(capsys, tmp_path):
    """The dry run makes the run's prompt-count check: the paper profile's 16,000 groups need composed rows."""
    err = _fail(capsys, ["validate", "--run-dir", str(tmp_path / "run"), "--dry-run", "--profile", "paper"])
    assert "calibration needs 16000" in err and "make_validation_rubrics.py compose" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("profile", ["validate"])
def test_validate_dry_run_uses_the_noisy_rules_grader_at_the_profiles_levels(capsys, tmp_path, profile):
    run = tmp_path / "run"
    assert cli.main(["validate", "--run-dir", str(run), "--dry-run", "--noise-seed", "4", "--profile", profile]) == 0
    (line,) = [x for x in capsys.readouterr().out.strip().splitlines() if not x.startswith("[")]
    cmd = shlex.split(line)
    assert "+reward.reward_kwargs.grader={type:noisy,flip_prob:0.1,seed:4,base:{type:rules,seed:1}}" in cmd
    values = cli.PROFILES[profile]
    for key in ("alpha", "beta", "delta", "calibration.num_prompts"):
        assert f"algorithm.setgrpo.{key}={values['algorithm.setgrpo.' + key]}" in cmd
    for key, value in (("calibration.on_infeasible", "reject_all"), ("calibration.only", "true")):
        assert f"algorithm.setgrpo.{key}={value}" in cmd
    assert not any(a.startswith("algorithm.setgrpo.tau_grid") for a in cmd)  # the default 20 thresholds
    assert "actor_rollout_ref.rollout.n=4" in cmd and "data.max_response_length=48" in cmd and not run.exists()


def test_flip_prob_wraps_any_judge(capsys, tmp_path):
    assert cli.main(["calibrate", "--run-dir", str(tmp_path / "run"), "--dry-run", "--flip-prob", "0.2"]) == 0
    cmd = shlex.split(capsys.readouterr().out)
    (grader,) = [a for a in cmd if a.startswith("+reward.reward_kwargs.grader=")]
    assert grader.startswith("+reward.reward_kwargs.grader={type:noisy,flip_prob:0.2,seed:0,base:{type:local_hf,")


@pytest.mark.parametrize("argv, needle", [
    (["calibrate", "--judge", "rules", "--judge-model", "x"], "--judge rules checks rule criteria by code"),
    (["calibrate", "--flip-prob", "1.5"], "--flip-prob 1.5: must be in [0, 1)"),
    (["calibrate", "--noise-seed", "3"], "give --flip-prob too"),
    (["validate", "--ablation", "spherical_set"], "drop --ablation"),
    (["validate", "--splits", "0"], "--splits 0"),
    (["validate", "--holdout-fraction", "1"], "--holdout-fraction 1.0"),
    (["validate", "--calib-groups", "40", "--alpha", "0.05"], "leaves 30 calibration groups per split, but alpha=0.05"),
])
def test_invalid_noise_and_validate_settings(capsys, tmp_path, argv, needle):
    err = _fail(capsys, [argv[0], "--run-dir", str(tmp_path / "run"), *argv[1:]])
    assert needle in err and not (tmp_path / "run").exists()


def test_rules_judge_refuses_judged_criteria_and_warns_on_beta(capsys, tmp_path):
    rows = _rows(200)
    for row in rows:
        row["rubrics"] = [{"criterion": "Uses 3 to 5 words", "points": 1,
                           "rule": {"id": "ifbench:count:word_count_range", "kwargs": {"min_words": 3, "max_words": 5}}}]
    rows[3]["rubrics"].append({"criterion": "is polite", "points": 1})
    assert cli.main(["validate", "--run-dir", str(tmp_path / "run"), "--calib-groups", "90", "--alpha", "0.05",
                     "--beta", "0.08", "--delta", "0.05", "--data", _jsonl(tmp_path / "d.jsonl", rows)]) == 2
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    # enough groups for alpha but not for beta: a warning (coverage is still checked), then the row check fails
    assert "68 calibration groups per split cannot certify" in out and ">= 72 accepted risk groups" in out
    assert "row-3" in err and "criterion 1 has no rule" in err
    assert not (tmp_path / "run").exists()


def test_tracker_lists_keep_the_file_logger():
    from setgrpo_verl.runner.launch import with_file_logger

    assert with_file_logger(["trainer.logger=[console,tensorboard]", "a=1"]) == [
        "trainer.logger=[console,tensorboard,file]", "a=1"]
    assert with_file_logger(["++trainer.logger='[wandb]'"]) == ["++trainer.logger=[wandb,file]"]
    assert with_file_logger(["trainer.logger=tensorboard"]) == ["trainer.logger=[tensorboard,file]"]
    assert with_file_logger(["trainer.logger=[console,file]"]) == ["trainer.logger=[console,file]"]


def test_trackers_write_in_the_stage_directory(tmp_path, monkeypatch):
    from setgrpo_verl.runner.launch import run_stage

    keys = ("TENSORBOARD_DIR", "WANDB_DIR", "SWANLAB_LOG_DIR", "TRACKIO_DIR", "MLFLOW_TRACKING_URI")
    for key in keys:
        monkeypatch.delenv(key, raising=False)
    probe = f"import os; print('TB', *(os.environ[k] for k in {keys!r}))"
    stage = run_stage(tmp_path / "run", "train", [sys.executable, "-c", probe], env=dict(__import__("os").environ))
    line = next(x for x in (stage / "main_ppo.log").read_text().splitlines() if x.startswith("TB "))
    where = stage.resolve()
    assert line == (f"TB {where / 'tensorboard'} {where} {where / 'swanlog'} {where / 'trackio'} "
                    f"sqlite:///{where / 'mlruns.db'}")
    # a location the user set is kept
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    stage = run_stage(tmp_path / "run2", "train", [sys.executable, "-c", probe], env=dict(__import__("os").environ))
    line = next(x for x in (stage / "main_ppo.log").read_text().splitlines() if x.startswith("TB "))
    assert line.endswith(" http://tracking.example:5000")


def test_judge_temperature_zero_is_refused_before_anything_is_written(capsys, tmp_path, monkeypatch):
    import setgrpo_verl.models

    def no_model():  # the embedded model's first use converts and loads it: the refusal comes first
        raise AssertionError("the embedded model was resolved before the judge temperature was refused")

    monkeypatch.setattr(setgrpo_verl.models, "embedded_model_dir", no_model)
    err = _fail(capsys, ["calibrate", "--run-dir", str(tmp_path / "run"), "--judge-temperature", "0"])
    assert "(reward.reward_kwargs.grader.temperature, --judge-temperature): SetGRPO calibrates a stochastic" in err
    assert not (tmp_path / "run").exists()


def test_a_calibration_on_the_exact_rules_grader_is_refused_before_anything_is_written(capsys, tmp_path):
    """--judge rules without --flip-prob scores every response the same way twice: nothing to calibrate."""
    err = _fail(capsys, ["calibrate", "--run-dir", str(tmp_path / "run"), "--judge", "rules"])
    assert "reward.reward_kwargs.grader is a rules grader, which scores every response the same way twice" in err
    assert "(the command line's --flip-prob > 0)" in err
    assert not (tmp_path / "run").exists()


def test_train_steps_beyond_the_epochs_are_refused_before_verl(capsys, tmp_path):
    from setgrpo_verl.grading import rubrics_to_verl_rows, write_verl_parquet

    run = tmp_path / "run"
    (run / "calibration").mkdir(parents=True)
    (run / "calibration" / "COMPLETE").write_text("")
    write_verl_parquet(rubrics_to_verl_rows(_rows(7)), run / "data" / "train.parquet")
    (run / "data" / "COMPLETE").write_text("")
    for dry in ([], ["--dry-run"]):  # a dry run never prints a command the run would refuse
        err = _fail(capsys, ["train", "--profile", "smoke", "--run-dir", str(run), "--steps", "5",
                             "--groups-per-step", "3", "trainer.total_epochs=1", *dry])
        assert ("--steps 5: the training split has 7 prompts, 2 steps of 3 groups per epoch (verl drops the last "
                "partial batch), and trainer.total_epochs=1 stops verl after 2 steps: lower --steps to 2, raise "
                "trainer.total_epochs to 3") in err
        assert not (run / "train_setgrpo").exists()


def test_duplicate_criteria_flag(capsys, tmp_path):
    rows = _rows(30, points=(1.0, 2.0))
    for row in rows[:3]:
        row["rubrics"].append(dict(row["rubrics"][0]))
    data = _jsonl(tmp_path / "d.jsonl", rows)
    err = _fail(capsys, ["calibrate", "--profile", "smoke", "--run-dir", str(tmp_path / "run"), "--data", data])
    assert "3 of 30 rows repeat a criterion" in err and "--duplicate-criteria keep_one" in err
    assert not (tmp_path / "run").exists()
    from setgrpo_verl.runner.datasplit import split_data
    from setgrpo_verl.models import embedded_model_dir

    split = split_data(data=data, model_path=embedded_model_dir(), max_prompt_length=512, calibration_prompts=6,
                       seed=1, duplicate_criteria="keep_one")
    rubrics = [json.loads(r["reward_model"]["ground_truth"])["rubrics"] for r in split["calibration"] + split["train"]]
    assert len(rubrics) == 30 and all(len(r) == 2 for r in rubrics)


def test_validate_help_names_its_own_data_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["validate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: the composite validation rubrics shipped in the package with --judge rules" in text
    with pytest.raises(SystemExit):
        cli.main(["calibrate", "--help"])
    assert "the IFBench rubric conversion of the IFBench prompts shipped in the package with any other judge" in " ".join(
        capsys.readouterr().out.split())


def _dry_command(capsys, argv):
    assert cli.main([*argv, "--dry-run"]) == 0
    (line,) = [x for x in capsys.readouterr().out.strip().splitlines() if not x.startswith("[")]
    return shlex.split(line)


def test_the_main_job_runs_the_noisy_rules_grader_on_the_validation_rubrics(capsys, tmp_path):
    cmd = _dry_command(capsys, ["quickstart", "--run-dir", str(tmp_path / "run")])
    assert "+reward.reward_kwargs.grader={type:noisy,flip_prob:0.06,seed:0,base:{type:rules,seed:1}}" in cmd
    assert cli.MAIN_JOB_FLIP_PROB == 0.06
    values = cli.PROFILES["default"]
    assert (values["algorithm.setgrpo.alpha"], values["algorithm.setgrpo.beta"], values["algorithm.setgrpo.delta"],
            values["algorithm.setgrpo.calibration.num_prompts"]) == (0.2, 0.3, 0.1, 128)
    for key in ("alpha", "beta", "delta", "calibration.num_prompts"):
        assert f"algorithm.setgrpo.{key}={values['algorithm.setgrpo.' + key]}" in cmd
    assert "algorithm.setgrpo.tau_grid=[0.0,0.2,0.4,0.6]" in cmd and "data.max_prompt_length=128" in cmd
    # the split draws the validation rubrics: every prompt fits the profile's 128 tokens
    args = cli.build_parser().parse_args(["quickstart", "--run-dir", str(tmp_path / "run")])
    args.flip_prob = cli.MAIN_JOB_FLIP_PROB
    split = cli.make_split(args, cli._plan(args))
    assert "validation rubrics" in split["source"] and len(split["calibration"]) == 128


def test_the_judge_demonstration_is_one_flag_away(capsys, tmp_path):
    cmd = _dry_command(capsys, ["quickstart", "--run-dir", str(tmp_path / "run"), "--judge", "local"])
    (grader,) = [a for a in cmd if a.startswith("+reward.reward_kwargs.grader=")]
    assert grader.startswith("+reward.reward_kwargs.grader={type:local_hf,") and "noisy" not in grader
    judge = cli.PROFILES["judge"]
    for key in ("alpha", "beta", "delta", "calibration.num_prompts"):
        assert f"algorithm.setgrpo.{key}={judge['algorithm.setgrpo.' + key]}" in cmd
    # calibrate and train keep the LLM judge by default, and with it the judge profile
    cmd = _dry_command(capsys, ["calibrate", "--run-dir", str(tmp_path / "run2")])
    assert "algorithm.setgrpo.alpha=0.5" in cmd and any("type:local_hf" in a for a in cmd)
    cmd = _dry_command(capsys, ["calibrate", "--run-dir", str(tmp_path / "run3"), "--judge", "rules",
                                "--flip-prob", "0.06"])
    assert "algorithm.setgrpo.alpha=0.2" in cmd and "algorithm.setgrpo.calibration.num_prompts=128" in cmd


def test_dry_run_makes_the_prompt_count_check(capsys, tmp_path):
    err = _fail(capsys, ["calibrate", "--profile", "smoke", "--run-dir", str(tmp_path / "run"), "--dry-run",
                         "--data", _jsonl(tmp_path / "d.jsonl", _rows(5))])
    assert "5 of 5 prompts" in err and "--calib-groups" in err and not (tmp_path / "run").exists()


def test_help_shows_each_profiles_levels(capsys):
    with pytest.raises(SystemExit):
        cli.main(["quickstart", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, values in cli.PROFILES.items():
        levels = ", ".join(f"{k} {values[f'algorithm.setgrpo.{k}']:g}" for k in ("alpha", "beta", "delta"))
        assert f"{levels}, {values['algorithm.setgrpo.calibration.num_prompts']:,} calibration groups" in text, name


def test_judge_max_response_tokens_flag_sets_the_graders_cut(capsys, tmp_path):
    run = tmp_path / "run"
    assert cli.main(["calibrate", "--run-dir", str(run), "--dry-run", "--judge", "openai", "--judge-base-url",
                     "http://127.0.0.1:9/v1", "--judge-model", "m", "--judge-max-response-tokens", "7000"]) == 0
    assert "max_response_tokens:7000" in capsys.readouterr().out
    assert cli.main(["calibrate", "--run-dir", str(run), "--dry-run", "--judge-max-response-tokens", "200"]) == 0
    assert "grader={type:local_hf,seed:1,max_response_tokens:200," in capsys.readouterr().out
    err = _fail(capsys, ["calibrate", "--run-dir", str(run), "--dry-run", "--judge", "rules",
                         "--judge-max-response-tokens", "7"])
    assert "--judge-max-response-tokens applies to --judge openai or local only" in err
    err = _fail(capsys, ["calibrate", "--run-dir", str(run), "--dry-run", "--judge", "local",
                         "--judge-max-response-tokens", "0"])
    assert "--judge-max-response-tokens 0: must be a positive integer" in err


def test_judge_max_concurrency_flag_sets_the_requests_in_flight_per_reward_worker(capsys, tmp_path):
    run = tmp_path / "run"
    openai = ["--judge", "openai", "--judge-base-url", "http://127.0.0.1:9/v1", "--judge-model", "m"]
    assert cli.main(["calibrate", "--run-dir", str(run), "--dry-run", *openai, "--judge-max-concurrency", "4"]) == 0
    assert "max_concurrency:4" in capsys.readouterr().out
    assert cli.main(["calibrate", "--run-dir", str(run), "--dry-run", *openai]) == 0
    assert "max_concurrency:" not in capsys.readouterr().out  # unset: the grader's own default
    err = _fail(capsys, ["calibrate", "--run-dir", str(run), "--dry-run", "--judge-max-concurrency", "4"])
    assert "--judge-max-concurrency apply to --judge openai only" in err
    err = _fail(capsys, ["calibrate", "--run-dir", str(run), "--dry-run", *openai, "--judge-max-concurrency", "0"])
    assert "--judge-max-concurrency 0: must be a positive integer" in err


FIXED = "algorithm.setgrpo.srgo_procedure=fixed_sequence"


@pytest.mark.parametrize(("overrides", "needle"), [
    ((FIXED, "algorithm.setgrpo.tau_start=0.2"), "algorithm.setgrpo.tau_start=0.2 must be one of the thresholds of "
                                                 "tau_grid [0.0, 0.3, 0.6] for srgo_procedure=fixed_sequence"),
    (("algorithm.setgrpo.srgo_procedure=fixed-sequence", "algorithm.setgrpo.tau_start=0.3"),
     "algorithm.setgrpo.srgo_procedure='fixed-sequence': choose one of ('bonferroni', 'fixed_sequence')"),
    (("algorithm.setgrpo.srgo_procdure=fixed_sequence",), "verl cannot compose the calibrate stage's config"),
    (("algorithm.setgrpo.tau_start=0.3",), "algorithm.setgrpo.tau_start=0.3 is for srgo_procedure=fixed_sequence "
                                           "only"),
    (("--calib-groups", "12", "--calib-batch-size", "4", "--shard", "3/4"),
     "part 3 holds no batch, since the calibration has 3 batch(es) (12 prompts in batches of 4)"),
])
def test_dry_run_fails_where_the_command_would_and_neither_writes(capsys, tmp_path, overrides, needle):
    """The dry run makes the check verl's main_ppo makes before Ray; the command makes it before writing anything."""
    run = tmp_path / "run"
    for dry in (["--dry-run"], []):
        err = _fail(capsys, ["calibrate", "--profile", "smoke", "--run-dir", str(run), *dry, *overrides])
        assert needle in err, err
        assert not run.exists()


def test_dry_run_of_an_interrupted_calibration_exits_2_after_its_plan(capsys, tmp_path):
    from setgrpo_verl.models import embedded_model_dir
    from setgrpo_verl.runner import launch

    run = tmp_path / "run"
    launch.write_data(run, launch.split_data(data=None, model_path=embedded_model_dir(), max_prompt_length=80,
                                             calibration_prompts=12, seed=1))  # the split the command makes
    (run / "calibration" / "shards").mkdir(parents=True)
    (run / "calibration" / "shards" / "batch_000000.npz").write_bytes(b"x")
    assert cli.main(["calibrate", "--profile", "smoke", "--run-dir", str(run), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert f"{run / 'calibration'} was interrupted after 1 calibration shard(s): pass --resume" in err, err
    assert "the command would stop before writing anything" in out
    assert [line for line in out.splitlines() if "verl.trainer.main_ppo" in line]


def test_a_pilot_of_the_same_prompts_is_refused_before_anything_is_written(capsys, tmp_path):
    """A pilot record that shares prompts with the split the command is about to write: refused by the dry run and
    by the command, before verl starts."""
    from setgrpo_verl.core import calibrate, CalibrationSettings
    from setgrpo_verl.core.record import prompt_fingerprint

    from ..core.synthetic import make_groups

    rows = _rows(40)
    pilot = calibrate(*make_groups(200, k=4, seed=3),
                      CalibrationSettings(alpha=0.5, beta=0.65, delta=0.2, tau_grid=(0.0, 0.2, 0.4, 0.6),
                                          on_infeasible="reject_all"),
                      metadata={"calibration_prompts": [prompt_fingerprint(r["id"], r["question"], r["rubrics"])
                                                        for r in rows]})
    pilot.to_json(tmp_path / "pilot.json")
    run = tmp_path / "run"
    argv = ["calibrate", "--profile", "smoke", "--run-dir", str(run), "--data", _jsonl(tmp_path / "d.jsonl", rows),
            FIXED, f"algorithm.setgrpo.tau_start={pilot.tau_sel}", f"algorithm.setgrpo.tau_start_pilot={tmp_path / 'pilot.json'}"]
    for dry in (["--dry-run"], []):
        err = _fail(capsys, argv + dry)
        assert "12 calibration prompt(s) were also the pilot's" in err and "calibrate the pilot on disjoint" in err
        assert not run.exists()


def test_dry_run_says_which_checks_it_leaves_out(capsys, tmp_path):
    run = str(tmp_path / "run")
    assert cli.main(["calibrate", "--profile", "smoke", "--run-dir", run, "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "[setgrpo-verl] dry run: every other check the command makes before verl starts passed"
    assert any(line.startswith("[setgrpo-verl] checks: the GPU environment checks") for line in out)
    assert cli.main(["calibrate", "--profile", "smoke", "--run-dir", run, "--dry-run", "--judge", "openai",
                     "--judge-base-url", "http://127.0.0.1:9/v1", "--judge-model", "m"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(
        "passed, except the judge probe (a request to --judge-base-url, which only the command makes)")


def test_the_command_line_hides_verls_warnings_about_engines_it_never_uses(tmp_path, monkeypatch):
    """verl warns about each optional engine it cannot import (megatron, veomni, ...) when the pre-Ray checks import
    it; the main job's console shows its own lines, and other warnings still show."""
    import warnings

    from setgrpo_verl.runner import cli

    def handler(args):
        warnings.warn("megatron engine is not available: ModuleNotFoundError(\"No module named 'megatron'\")",
                      UserWarning)
        warnings.warn("something else", UserWarning)
        return ""

    monkeypatch.setitem(cli.HANDLERS, "report", handler)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert cli.main(["report", "--run-dir", str(tmp_path / "r")]) == 0
    assert [str(w.message) for w in seen] == ["something else"]
