"""``setgrpo-verl compare``: its runs' verl overrides, its run directory's plan and resume decisions, and its analysis
of verl metrics files (docs/cli.md#compare)."""

import json
import math

import numpy as np
import pytest

from setgrpo_verl.report import ReportError
from setgrpo_verl.report.outcome import outcome_line, outcome_rows, outcome_table, read_curve
from setgrpo_verl.runner import cli
from setgrpo_verl.runner.compare import ARMS, arm_overrides, compare_depends, edit_overrides, run_name
from setgrpo_verl.runner.lifecycle import plan_run
from setgrpo_verl.rundir import COMPLETE

GRADER = {"type": "noisy", "flip_prob": 0.06, "seed": 0, "base": {"type": "rules", "seed": 1}}
COMMON = ["data.train_batch_size=8", "algorithm.setgrpo.alpha=0.2", "data.seed=1",
          "+reward.reward_kwargs.grader={type:noisy,flip_prob:0.06,seed:0,base:{type:rules,seed:1}}",
          "reward.reward_manager.name=setgrpo_dual"]


def _values(overrides):
    return {o.partition("=")[0]: o.partition("=")[2] for o in overrides}


def test_edit_overrides_replaces_in_place_appends_and_drops():
    out = edit_overrides(["+a.b=1", "c=2", "d=3"], {"a.b": 5, "+e": "x y", "c": None}, drop=["d"])
    assert out == ["+a.b=5", "c=null", "+e='x y'"]


@pytest.mark.parametrize("arm", list(ARMS))
def test_each_arm_validates_on_the_held_out_prompts_with_its_seed(arm, tmp_path):
    values = _values(arm_overrides(arm, 2, common=COMMON, grader=GRADER, run_dir=tmp_path, val_every=10,
                                   validate_first=True))
    out = tmp_path.resolve() / "compare" / f"{arm}_s2"
    assert values["data.val_files"] == str(tmp_path.resolve() / "data" / "heldout.parquet")
    assert values["data.train_files"] == str(tmp_path.resolve() / "data" / "train.parquet")
    assert values["trainer.test_freq"] == "10" and values["trainer.save_freq"] == "10"
    assert values["trainer.val_before_train"] == "true"
    assert values["trainer.default_local_dir"] == str(out / "checkpoints")
    assert values["hydra.run.dir"] == str(out / "hydra")
    assert values["data.seed"] == "2" and values["actor_rollout_ref.rollout.seed"] == "2"
    assert values["+reward.reward_kwargs.grader"] == "{type:noisy,flip_prob:0.06,seed:2,base:{type:rules,seed:2}}"
    assert values["trainer.logger"] == "[console,file]"
    grpo = ARMS[arm] == "grpo"
    assert ("algorithm.setgrpo.alpha" in values) is not grpo
    assert values.get("algorithm.adv_estimator") == ("grpo" if grpo else None)
    assert values.get("+reward.reward_kwargs.scorings") == {"grpo": "1", "grpo_mean2": "2"}.get(arm)
    assert values.get("+reward.reward_kwargs.point") == ("mean" if arm == "grpo_mean2" else None)
    assert values.get("algorithm.setgrpo.variant") == ("reliability" if arm == "setgrpo_reliability" else None)
    record = str(tmp_path.resolve() / "calibration" / "record.json")
    assert values.get("algorithm.setgrpo.record_path") == (record if arm == "setgrpo_paper" else None)
    # every key once: Hydra composes them in order, and a duplicate would hide which one wins
    keys = [o.partition("=")[0].lstrip("+") for o in arm_overrides(arm, 2, common=COMMON, grader=GRADER,
                                                                    run_dir=tmp_path, val_every=10,
                                                                    validate_first=True)]
    assert len(keys) == len(set(keys))


def test_a_continued_run_does_not_validate_again_before_its_next_step(tmp_path):
    values = _values(arm_overrides("grpo", 0, common=COMMON, grader=GRADER, run_dir=tmp_path, val_every=5,
                                   validate_first=False))
    assert values["trainer.val_before_train"] == "false"


def test_only_the_paper_arm_reads_the_calibration():
    depends = compare_depends(["grpo", "setgrpo_paper"], [0, 1])
    assert list(depends) == ["data", "calibration", "compare/grpo_s0", "compare/grpo_s1", "compare/setgrpo_paper_s0",
                             "compare/setgrpo_paper_s1", "outcome"]
    assert depends["compare/grpo_s1"] == ("data",)
    assert depends["compare/setgrpo_paper_s0"] == ("data", "calibration")
    assert "calibration" not in compare_depends(["grpo", "setgrpo_reliability"], [0])


def _stage(path, *, complete=False, checkpoint=None):
    path.mkdir(parents=True)
    if complete:
        (path / COMPLETE).write_text("1.0 s\n")
    if checkpoint is not None:
        (path / "checkpoints").mkdir()
        (path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(checkpoint))


def test_resume_keeps_finished_runs_continues_checkpointed_ones_and_restarts_the_rest(tmp_path):
    arms, seeds = ["grpo", "setgrpo_reliability"], [0, 1]
    depends = compare_depends(arms, seeds)
    _stage(tmp_path / "data", complete=True)
    _stage(tmp_path / run_name("grpo", 0), complete=True)
    _stage(tmp_path / run_name("grpo", 1), checkpoint=20)
    _stage(tmp_path / run_name("setgrpo_reliability", 0))
    plan = plan_run(tmp_path, list(depends), resume=True, same_data=True, depends=depends)
    assert {d.name: d.action for d in plan.dirs} == {
        "data": "keep", "compare/grpo_s0": "keep", "compare/grpo_s1": "continue",
        "compare/setgrpo_reliability_s0": "replace", "compare/setgrpo_reliability_s1": "create", "outcome": "create"}
    refused = plan_run(tmp_path, list(depends), same_data=True, depends=depends)
    assert refused.action("compare/grpo_s0") == "refuse" and refused.action("compare/grpo_s1") == "refuse"
    assert "--resume" in refused["compare/grpo_s1"].reason and "step 20" in refused["compare/grpo_s1"].reason
    # another data split: every run made from the old one would no longer match it
    other = plan_run(tmp_path, list(depends), resume=True, same_data=False, depends=depends)
    assert other.action("data") == "refuse"


def test_compare_refuses_a_grader_without_a_truth_and_repeated_seeds(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["compare", "--run-dir", str(run), "--judge", "local", "--flip-prob", "0.1", "--dry-run"]) == 2
    assert "needs a grader with a known truth: pass --judge rules --flip-prob P" in capsys.readouterr().err
    assert cli.main(["compare", "--run-dir", str(run), "--dry-run"]) == 2
    assert "--judge rules --flip-prob P" in capsys.readouterr().err
    assert cli.main(["compare", "--run-dir", str(run), "--flip-prob", "0.1", "--seeds", "0", "0", "--dry-run"]) == 2
    assert "--seeds 0 0: each at most once" in capsys.readouterr().err
    assert not run.exists()


def test_dry_run_prints_the_plan_and_every_command_and_writes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["compare", "--run-dir", str(run), "--flip-prob", "0.06", "--arms", "grpo", "grpo_mean2",
                     "--seeds", "0", "1", "--steps", "30", "--val-every", "10", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ("compare: 2 arm(s) x 2 seed(s) = 4 runs of 30 steps (K 4, 8 groups a step) at flip 0.06; 240 held-out "
            "prompts validated greedily 4 times a run") in out
    assert "240 calibration and 2520 training prompts" in out and "setgrpo_paper" not in out
    commands = [line for line in out.splitlines() if "verl.trainer.main_ppo" in line]
    assert len(commands) == 4
    for arm, seed in (("grpo", 0), ("grpo", 1), ("grpo_mean2", 0), ("grpo_mean2", 1)):
        assert f"plan: {run}/compare/{arm}_s{seed}/ (absent): create" in out
        assert sum(f"trainer.experiment_name={arm}_s{seed} " in c for c in commands) == 1
    assert all("trainer.test_freq=10" in c and "heldout.parquet" in c for c in commands)
    assert out.rstrip().endswith("every other check the command makes before verl starts passed")
    assert not run.exists()


def test_compare_refuses_to_join_finished_or_checkpointed_runs_at_another_precision(tmp_path, capsys):
    """The CPU's default precision follows the host (bf16 with bf16 units, fp32 without): a run directory continued
    on another kind of host would pair runs of two arithmetics, so compare refuses before Ray and names the fix."""
    from setgrpo_verl.runner.launch import cpu_overrides

    run = tmp_path / "run"
    args = ["compare", "--run-dir", str(run), "--flip-prob", "0.06", "--arms", "grpo", "--seeds", "1", "--resume",
            "--dry-run"]
    assert cli.main(args + ["--precision", "fp32"]) == 0
    capsys.readouterr()
    done = run / run_name("grpo", 0)
    _metrics(done, [0.5, 0.55])
    (done / "command.sh").write_text(_composed(run, "grpo", 0, ["--flip-prob", "0.06", "--precision", "bf16"],
                                               flags=()))
    assert cli.main(args + ["--precision", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "compare/grpo_s0 ran at bf16, and this command runs at fp32" in err and "pass --precision" in err
    assert cli.main(args + ["--precision", "bf16"]) == 0
    capsys.readouterr()
    (done / COMPLETE).unlink()  # interrupted before any checkpoint: nothing of it is kept, so nothing to match
    assert cli.main(args + ["--precision", "fp32"]) == 0


def test_the_precision_check_counts_kept_continued_and_untouched_work_and_skips_what_is_replaced(tmp_path):
    from setgrpo_verl.runner.compare import check_precision
    from setgrpo_verl.runner.launch import cpu_overrides
    from setgrpo_verl.rundir import LaunchError

    def command(precision):
        return ["python", "-m", "verl.trainer.main_ppo", *cpu_overrides(1, precision)]

    arms, seeds = ["grpo", "setgrpo_paper"], [0]
    depends = compare_depends(arms, seeds)
    _stage(tmp_path / "data", complete=True)
    for name, kw in (("calibration", {"complete": True}), (run_name("grpo", 0), {"checkpoint": 10}),
                     (run_name("setgrpo_paper", 0), {})):
        _stage(tmp_path / name, **kw)
        (tmp_path / name / "command.sh").write_text(" ".join(command("bf16")) + "\n")
    (tmp_path / "calibration" / "record.json").write_text("{}")
    untouched = tmp_path / run_name("grpo", 1)  # a finished run of a seed this command does not run
    _stage(untouched, complete=True)
    untouched.joinpath("command.sh").write_text(" ".join(command("bf16")) + "\n")
    plan = plan_run(tmp_path, list(depends), resume=True, same_data=True, depends=depends)
    assert (plan.action("calibration"), plan.action("compare/grpo_s0"), plan.action("compare/setgrpo_paper_s0")) \
        == ("keep", "continue", "replace")
    commands = [("grpo", "compare/grpo_s0", command("fp32")), ("train", "compare/setgrpo_paper_s0", command("fp32"))]
    with pytest.raises(LaunchError) as refused:
        check_precision(commands, tmp_path, plan)
    # the kept calibration and the continued run are named; the run started over (no checkpoint) is not
    assert str(refused.value).startswith(f"{tmp_path}: calibration ran at bf16, compare/grpo_s0 ran at bf16, "
                                         "compare/grpo_s1 ran at bf16, and this command runs at fp32")
    assert "remove its calibration/" in str(refused.value)
    check_precision([(s, n, command("bf16")) for s, n, _ in commands], tmp_path, plan)
    untouched.joinpath("command.sh").write_text(" ".join(command("fp32")) + "\n")
    overwrite = plan_run(tmp_path, list(depends), overwrite=True, same_data=True, depends=depends)
    check_precision(commands, tmp_path, overwrite)  # everything this command runs is written again


def test_command_precision_reads_the_rollout_and_actor_dtypes():
    from setgrpo_verl.report.outcome import command_precision
    from setgrpo_verl.runner.launch import cpu_overrides

    assert command_precision(" ".join(cpu_overrides(1, "bf16"))) == "bf16"
    assert command_precision(" ".join(cpu_overrides(1, "fp32"))) == "fp32"
    assert command_precision("actor_rollout_ref.rollout.dtype=bfloat16") == "rollout bf16, actor default"
    assert command_precision("python -m verl.trainer.main_ppo") is None
    # the last setting wins, as in Hydra; the dotted key and a dict with param_dtype later on are read too
    later = " ".join(cpu_overrides(1, "bf16")) + " actor_rollout_ref.rollout.dtype=float32"
    assert command_precision(later) == "rollout fp32, actor bf16"
    assert command_precision("actor_rollout_ref.rollout.dtype=float32 "
                             "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32") == "fp32"
    assert command_precision("actor_rollout_ref.rollout.dtype=bfloat16 '+actor_rollout_ref.actor.fsdp_config."
                             "mixed_precision={reduce_dtype:fp32,param_dtype:bf16}'") == "bf16"


# --- the analysis, on verl metrics files written as verl's file logger writes them ---

def _metrics(path, truth, *, calls=8.0, seconds=30.0, val_every=2, source="rubrichub"):
    """A run's metrics.jsonl: validation before training (step 0), then one row per step with its timing, grader
    calls and, every ``val_every`` steps, the held-out truth reward; ``truth`` holds the values at steps 0, M, 2M..."""
    path.mkdir(parents=True, exist_ok=True)
    key = f"val-aux/{source}/truth_score/mean@1"
    rows = [{"step": 0, "data": {key: truth[0], "val-core/rubrichub/reward/mean@1": 0.1}}]
    for step in range(1, (len(truth) - 1) * val_every + 1):
        data = {"timing_s/step": seconds, "setgrpo/grading/calls_per_step": calls, "critic/score/mean": 0.5}
        if step % val_every == 0:
            data.update({key: truth[step // val_every], "timing_s/testing": 6.0})
        rows.append({"step": step, "data": data})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "command.sh").write_text("python -m verl.trainer.main_ppo "
                                     "'+reward.reward_kwargs.grader={type:noisy,flip_prob:0.06,seed:0,base:{type:rules,"
                                     "seed:0}}'\n")
    (path / COMPLETE).write_text("1.0 s\n")


def test_a_curve_holds_the_truth_reward_calls_and_wall_clock_at_each_validation(tmp_path):
    _metrics(tmp_path, [0.5, 0.52, 0.55], calls=64.0, seconds=30.0)
    curve = read_curve(tmp_path / "metrics.jsonl")
    assert curve.steps.tolist() == [0, 2, 4]
    assert curve.truth.tolist() == [0.5, 0.52, 0.55]
    assert curve.calls.tolist() == [0.0, 128.0, 256.0]
    assert curve.seconds.tolist() == [0.0, 66.0, 132.0]


def test_a_run_without_validation_before_training_is_refused(tmp_path):
    _metrics(tmp_path, [0.5, 0.52])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()[1:]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match="no held-out truth reward before the first step"):
        read_curve(tmp_path / "metrics.jsonl")


def test_a_step_lost_to_a_crash_after_its_checkpoint_counts_as_the_runs_median_step(tmp_path):
    """A run resumed from the checkpoint of step 2 trained step 2 without its row (verl logs after the checkpoint):
    its calls and seconds are the median step's, and the curve names it."""
    _metrics(tmp_path, [0.5, 0.52, 0.55], calls=64.0, seconds=30.0)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows[3]["data"]["timing_s/step"] = 50.0  # steps 1, 3, 4 took 30, 50 and 30 + 6 s of validation: median 36 s
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] != 2))
    curve = read_curve(tmp_path / "metrics.jsonl")
    assert curve.lost == (2,) and curve.steps.tolist() == [0, 4]
    assert curve.calls.tolist() == [0.0, 256.0]
    assert curve.seconds.tolist() == [0.0, 30.0 + 36.0 + 50.0 + 36.0]
    result = outcome_rows({"grpo": {0: curve}})
    assert result["arms"][0]["lost_steps"] == {"0": [2]}


def test_the_figure_draws_an_arm_at_the_steps_every_run_of_it_validated(tmp_path, monkeypatch):
    """Seed 0 lost its step-2 validation (a crash between checkpoint and metrics row): the arm's line is the mean of
    both seeds at steps 0 and 4."""
    import matplotlib.axes

    from setgrpo_verl.report.outcome import plot_outcome

    _metrics(tmp_path / "grpo_s0", [0.50, 0.52, 0.56])
    _metrics(tmp_path / "grpo_s1", [0.48, 0.51, 0.54])
    rows = [json.loads(line) for line in (tmp_path / "grpo_s0" / "metrics.jsonl").read_text().splitlines()]
    (tmp_path / "grpo_s0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] != 2))
    curves = {"grpo": {s: read_curve(tmp_path / f"grpo_s{s}" / "metrics.jsonl") for s in (0, 1)}}
    assert curves["grpo"][0].steps.tolist() == [0, 4]
    drawn = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, x, y, *a, **kw: drawn.append((list(x), list(y), kw["label"])) or plot(self, x, y, *a, **kw))
    assert plot_outcome(curves, tmp_path / "outcome.png").stat().st_size > 0
    x, y, label = drawn[0]
    assert x == [0, 4] and y == pytest.approx([0.49, 0.55]) and label == "grpo (2 seeds)"
    _metrics(tmp_path / "grpo_s1", [0.48, 0.51], val_every=3)  # validated at steps 0 and 3 only: nothing shared
    curves["grpo"][1] = read_curve(tmp_path / "grpo_s1" / "metrics.jsonl")
    with pytest.raises(ReportError, match="the grpo runs share fewer than two validated steps"):
        plot_outcome(curves, tmp_path / "outcome.png")


def test_finished_runs_of_different_lengths_are_refused(tmp_path):
    _metrics(tmp_path / "grpo_s0", [0.5, 0.52, 0.55])
    _metrics(tmp_path / "grpo_s1", [0.5, 0.52, 0.55, 0.56])
    curves = {"grpo": {s: read_curve(tmp_path / f"grpo_s{s}" / "metrics.jsonl") for s in (0, 1)}}
    with pytest.raises(ReportError, match=r"different steps \(grpo_s0 4, grpo_s1 6\); analyse runs of the same"):
        outcome_rows(curves)


def test_missing_steps_after_the_last_logged_one_are_refused(tmp_path):
    _metrics(tmp_path, [0.5, 0.52, 0.55], calls=64.0, seconds=30.0)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows[-1]["data"] = {k: v for k, v in rows[-1]["data"].items() if not k.startswith(("timing_s", "setgrpo/"))}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ReportError, match=r"training steps \[4\] are missing and no step after them was logged"):
        read_curve(tmp_path / "metrics.jsonl")


def test_outcome_rows_give_each_arms_gain_with_its_paired_t_band(tmp_path):
    truths = {"grpo": [(0.50, 0.53), (0.48, 0.52), (0.51, 0.53)],
              "grpo_mean2": [(0.50, 0.55), (0.48, 0.53), (0.51, 0.55)],
              "setgrpo_reliability": [(0.50, 0.56), (0.48, 0.52), (0.51, 0.56)]}
    for arm, runs in truths.items():
        for seed, (start, end) in enumerate(runs):
            _metrics(tmp_path / f"{arm}_s{seed}", [start, (start + end) / 2, end])
    curves = {arm: {s: read_curve(tmp_path / f"{arm}_s{s}" / "metrics.jsonl") for s in range(3)} for arm in truths}
    result = outcome_rows(curves)
    assert result["seeds"] == [0, 1, 2] and result["steps"] == 4
    rows = {r["arm"]: r for r in result["arms"]}
    assert [r["arm"] for r in result["arms"]] == ["setgrpo_reliability", "grpo_mean2", "grpo"]
    t = 4.302652729911275  # Student t, 97.5 % quantile, 2 degrees of freedom
    gains = np.array([0.06, 0.04, 0.05])
    assert rows["setgrpo_reliability"]["gain"] == pytest.approx(0.05)
    assert rows["setgrpo_reliability"]["band"] == pytest.approx(t * gains.std(ddof=1) / math.sqrt(3))
    diff = gains - np.array([0.05, 0.05, 0.04])  # minus grpo_mean2's gains, seed by seed
    assert rows["setgrpo_reliability"]["paired"]["grpo_mean2"] == pytest.approx(
        [diff.mean(), t * diff.std(ddof=1) / math.sqrt(3)])
    assert "grpo" not in rows["grpo"]["paired"] and rows["grpo"]["calls_per_step"] == pytest.approx(8.0)
    assert rows["grpo"]["seconds_per_step"] == pytest.approx((4 * 30.0 + 2 * 6.0) / 4)
    line = outcome_line(result)
    lo, hi = 0.05 - rows["setgrpo_reliability"]["band"], 0.05 + rows["setgrpo_reliability"]["band"]
    assert line.startswith(f"outcome: setgrpo_reliability 0.050 [{lo:.3f}, {hi:.3f}], grpo_mean2 0.047 [")
    assert line.endswith("(held-out truth reward gain, 3 seeds, 4 steps)")


def test_each_arm_has_its_own_seeds_and_pairs_with_a_baseline_over_the_seeds_both_have(tmp_path):
    """The candidate and GRPO on the mean of two at seeds 0-2, plain GRPO at seed 0 only: each arm's gain and band
    come from its own seeds, a paired difference from the seeds the two arms share, and the line gives the counts."""
    truths = {"setgrpo_reliability": [(0.50, 0.56), (0.48, 0.52), (0.51, 0.56)],
              "grpo_mean2": [(0.50, 0.55), (0.48, 0.53), (0.51, 0.55)], "grpo": [(0.50, 0.53)]}
    curves = {}
    for arm, runs in truths.items():
        for seed, (start, end) in enumerate(runs):
            _metrics(tmp_path / f"{arm}_s{seed}", [start, (start + end) / 2, end])
            curves.setdefault(arm, {})[seed] = read_curve(tmp_path / f"{arm}_s{seed}" / "metrics.jsonl")
    result = outcome_rows(curves)
    rows = {r["arm"]: r for r in result["arms"]}
    assert result["seeds"] == [0, 1, 2] and rows["grpo"]["seeds"] == [0]
    t = 4.302652729911275  # Student t, 97.5 % quantile, 2 degrees of freedom
    diff = np.array([0.06, 0.04, 0.05]) - np.array([0.05, 0.05, 0.04])
    assert rows["setgrpo_reliability"]["paired"]["grpo_mean2"] == pytest.approx(
        [diff.mean(), t * diff.std(ddof=1) / math.sqrt(3)])
    assert rows["setgrpo_reliability"]["paired_seeds"] == {"grpo": [0], "grpo_mean2": [0, 1, 2]}
    assert rows["setgrpo_reliability"]["paired"]["grpo"][0] == pytest.approx(0.03)
    assert math.isnan(rows["setgrpo_reliability"]["paired"]["grpo"][1])  # one shared seed: no band
    assert rows["grpo"]["gain"] == pytest.approx(0.03) and math.isnan(rows["grpo"]["band"])
    assert outcome_line(result).endswith("(held-out truth reward gain, 3, 3 and 1 seeds, 4 steps)")
    assert outcome_table(result).splitlines()[3].split()[:2] == ["grpo", "1"]


def test_the_late_gain_averages_the_validations_of_the_last_fifth_of_the_steps(tmp_path):
    """Validations every 2 of 10 steps: the late window is steps 8 and 10, so a last validation that dips reads as
    the mean of the two, paired with the baseline seed by seed."""
    _metrics(tmp_path / "grpo_mean2_s0", [0.50, 0.55, 0.60, 0.65, 0.72, 0.66])
    _metrics(tmp_path / "setgrpo_reliability_s0", [0.50, 0.52, 0.58, 0.63, 0.67, 0.70])
    curves = {arm: {0: read_curve(tmp_path / f"{arm}_s0" / "metrics.jsonl")} for arm in ("grpo_mean2", "setgrpo_reliability")}
    result = outcome_rows(curves)
    rows = {r["arm"]: r for r in result["arms"]}
    assert result["late_from"] == 8.0
    assert rows["grpo_mean2"]["gain"] == pytest.approx(0.16) and rows["grpo_mean2"]["late_gain"] == pytest.approx(0.19)
    assert rows["setgrpo_reliability"]["late_gain"] == pytest.approx(0.185)
    assert rows["setgrpo_reliability"]["paired"]["grpo_mean2"][0] == pytest.approx(0.04)
    assert rows["setgrpo_reliability"]["late_paired"]["grpo_mean2"][0] == pytest.approx(-0.005)
    assert math.isnan(rows["setgrpo_reliability"]["late_band"])
    table = outcome_table(result).splitlines()
    assert table[3] == "paired differences: over the seeds both arms have"
    assert table[4] == "late window: the mean of each run's validations at steps >= 8, minus step 0"
    assert table[6].split() == ["setgrpo_reliability", "+0.185", "[n/a:", "one", "seed]", "-", "-0.005", "[n/a:", "one",
                                "seed]"]


def test_analysis_only_reads_the_finished_runs_and_prints_the_outcome_last(tmp_path, capsys):
    run = tmp_path / "run"
    for arm, gain in (("grpo", 0.02), ("setgrpo_paper", 0.0)):
        for seed in (0, 1):
            _metrics(run / "compare" / f"{arm}_s{seed}", [0.5, 0.5 + gain / 2, 0.5 + gain + 0.01 * seed])
    (run / "compare" / "setgrpo_paper_s1" / COMPLETE).unlink()  # interrupted: left out; grpo keeps its seed 1
    assert cli.main(["compare", "--run-dir", str(run), "--flip-prob", "0.06", "--arms", "grpo", "setgrpo_paper",
                     "--seeds", "0", "1", "--analysis-only"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2] == "not finished, left out: setgrpo_paper_s1"
    # grpo over seeds 0 and 1 (gains 0.02 and 0.03: t with 1 degree of freedom, 12.706 x 0.005)
    assert out[-1] == ("outcome: grpo 0.025 [-0.039, 0.089], setgrpo_paper 0.000 [n/a: one seed] (held-out truth "
                       "reward gain, 2 and 1 seeds, 4 steps)")
    assert (run / "outcome" / "outcome.png").stat().st_size > 0 and (run / "outcome" / COMPLETE).is_file()
    result = json.loads((run / "outcome" / "outcome.json").read_text())
    assert result["unfinished"] == ["setgrpo_paper_s1"] and result["seeds"] == [0, 1]
    paper = result["arms"][1]
    assert paper["seeds"] == [0] and paper["paired_seeds"] == {"grpo": [0]}
    assert paper["paired"]["grpo"][0] == pytest.approx(-0.02) and paper["paired"]["grpo"][1] != paper["paired"]["grpo"][1]


def test_report_outcome_writes_what_the_comparisons_analysis_writes_and_refuses_mixed_graders(tmp_path, capsys):
    """``report --outcome DIR`` on a comparison's runs (``<arm>_s<seed>/`` with metrics.jsonl and the command.sh
    compare writes) writes the same outcome.json and outcome.txt as ``compare --analysis-only``, the grader's flip
    probability read from the runs' commands and a run without its COMPLETE marker left out and named; runs at two
    flip probabilities, a run without its metrics and a path that is no directory are refused."""
    from setgrpo_verl.runner.launch import format_override

    run = tmp_path / "run"
    for arm, gain in (("grpo", 0.02), ("grpo_mean2", 0.04)):
        for seed in (0, 1):
            path = run / "compare" / f"{arm}_s{seed}"
            _metrics(path, [0.5, 0.5 + gain / 2, 0.5 + gain + 0.01 * seed])
            grader = {"type": "noisy", "flip_prob": 0.06, "seed": seed, "base": {"type": "rules", "seed": 0}}
            (path / "command.sh").write_text(f"python -m verl.trainer.main_ppo "
                                             f"'{format_override('+reward.reward_kwargs.grader', grader)}'\n")
    (run / "compare" / "grpo_mean2_s1" / COMPLETE).unlink()  # interrupted
    assert cli.main(["compare", "--run-dir", str(run), "--flip-prob", "0.06", "--arms", "grpo", "grpo_mean2",
                     "--seeds", "0", "1", "--analysis-only"]) == 0
    capsys.readouterr()
    figure = tmp_path / "figure.png"
    assert cli.main(["report", "--outcome", str(run / "compare"), "--figure", str(figure)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2] == "not finished, left out: grpo_mean2_s1"
    assert out[-1].startswith("outcome: grpo_mean2 0.040 [n/a: one seed], grpo 0.025 [-0.039, 0.089] ")
    for name in ("outcome.json", "outcome.txt"):
        assert (run / "compare" / name).read_text() == (run / "outcome" / name).read_text()
    assert figure.stat().st_size > 0 and not (run / "compare" / "outcome.png").exists()
    other = run / "compare" / "grpo_s1" / "command.sh"
    other.write_text(other.read_text().replace("flip_prob:0.06", "flip_prob:0.1"))
    assert cli.main(["report", "--outcome", str(run / "compare")]) == 2
    assert "different flip probabilities (grpo_mean2_s0 0.06, grpo_s0 0.06, grpo_s1 0.1)" in capsys.readouterr().err
    other.write_text(other.read_text().replace("flip_prob:0.1", "flip_prob:0.06").rstrip("\n")
                     + " actor_rollout_ref.rollout.dtype=float32\n")
    assert cli.main(["report", "--outcome", str(run / "compare")]) == 2
    assert ("different precisions (grpo_mean2_s0 verl default, grpo_s0 verl default, grpo_s1 rollout fp32, actor "
            "default)") in capsys.readouterr().err
    assert cli.main(["compare", "--run-dir", str(run), "--flip-prob", "0.06", "--arms", "grpo", "grpo_mean2",
                     "--seeds", "0", "1", "--analysis-only"]) == 2
    assert "compare analysis of" in (err := capsys.readouterr().err) and "grpo_s1 rollout fp32, actor default" in err
    (run / "compare" / "grpo_s1" / "metrics.jsonl").unlink()
    assert cli.main(["report", "--outcome", str(run / "compare")]) == 2
    assert "grpo_s1: [Errno 2] No such file or directory" in capsys.readouterr().err
    assert cli.main(["report", "--outcome", str(run / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_the_committed_verl_pilot_re_analyses_to_its_outcome_line():
    """validation/outcome_verl/pilot: the compare command's first run through main_ppo (2 arms, 1 seed, 4 steps,
    flip 0.06; docs/outcome.md#through-verl-the-plan). Its metrics re-analyse to the committed outcome, and what
    the plan's cost rests on is in them: a step's seconds and grader calls, a validation's seconds."""
    import json
    from pathlib import Path

    from setgrpo_verl.report.outcome import outcome_line, outcome_rows, read_curve

    pilot = Path(__file__).resolve().parents[2] / "validation" / "outcome_verl" / "pilot"
    curves = {arm: {0: read_curve(pilot / f"{arm}_s0" / "metrics.jsonl")} for arm in ("grpo_mean2", "setgrpo_reliability")}
    result = outcome_rows(curves)
    committed = json.loads((pilot / "outcome.json").read_text())
    assert outcome_line(result) == outcome_line(committed)
    assert (pilot / "outcome.txt").read_text().strip().splitlines()[-1] == outcome_line(result)
    for arm in curves:
        curve = curves[arm][0]
        assert list(curve.steps) == [0, 2, 4] and 0.5 < curve.truth[0] < 0.55
        assert curve.calls[-1] == 4 * 64  # 8 groups x K 4 x 2 scorings a step


def test_the_committed_comparison_runs_re_analyse_to_their_outcome_line(tmp_path):
    """validation/outcome_verl/flip0.06: the comparison's finished runs through main_ppo (flip 0.06, 100 steps,
    docs/outcome.md#through-verl-the-runs). Every committed ``<arm>_s<seed>`` run re-analyses to the committed
    outcome line and table; what the first run showed is in its metrics: the reliability candidate's held-out truth
    reward rose from 0.521 to 0.704, 64 grader calls a step, step 10 lost between its checkpoint and its row; GRPO on
    the mean of two scorings, the same seed, ended 0.037 lower and tied it over the late window; plain GRPO (one
    scoring) rose to 0.620; at seed 1 the candidate rose to 0.660 and GRPO on the mean of two to 0.674, level with it
    over the late window again, and plain GRPO to 0.700, ahead of both at that seed."""
    import json
    from pathlib import Path

    from setgrpo_verl.report.outcome import outcome_report, read_runs

    root = Path(__file__).resolve().parents[2] / "validation" / "outcome_verl" / "flip0.06"
    curves, flip_prob, unfinished = read_runs(root)
    assert unfinished == []  # committed runs carry no COMPLETE marker: every one counts
    result, text = outcome_report(curves, flip_prob=flip_prob)
    # the committed files are exactly what `setgrpo-verl report --outcome` writes from the runs
    assert (root / "outcome.txt").read_text() == text + "\n"
    committed = json.loads((root / "outcome.json").read_text())
    # the t quantiles come from scipy, unpinned: the JSON's full-precision floats agree to rounding
    def leaves(x, path=""):
        if isinstance(x, dict):
            return [leaf for k in sorted(x) for leaf in leaves(x[k], f"{path}/{k}")]
        if isinstance(x, list):
            return [leaf for i, v in enumerate(x) for leaf in leaves(v, f"{path}/{i}")]
        return [(path, x)]

    fresh = leaves(json.loads(json.dumps(result)))
    assert [p for p, _ in leaves(committed)] == [p for p, _ in fresh]
    for (where, old), (_, new) in zip(leaves(committed), fresh):
        assert old == (pytest.approx(new, rel=1e-12, nan_ok=True) if isinstance(new, float) else new), where
    assert committed["steps"] == result["steps"] == 100 and flip_prob == committed["flip_prob"] == 0.06
    first = curves["setgrpo_reliability"][0]
    assert first.lost == (10,) and first.steps.tolist() == [0, *range(20, 101, 10)]
    assert round(first.truth[0], 3) == 0.521 and round(first.truth[-1], 3) == 0.704
    assert first.calls[-1] == 100 * 64  # 8 groups x K 4 x 2 scorings a step
    mean2 = curves["grpo_mean2"][0]
    assert mean2.lost == () and round(mean2.truth[-1], 3) == 0.668 and round(mean2.truth.max(), 3) == 0.715
    arms = {r["arm"]: r for r in result["arms"]}
    # seed 0: the last validation puts the candidate 0.037 ahead; the late window (steps 80-100) ties them
    assert round(first.truth[-1] - first.truth[0] - (mean2.truth[-1] - mean2.truth[0]), 3) == 0.037
    assert abs(first.truth[-3:].mean() - mean2.truth[-3:].mean()) < 0.001
    one = curves["grpo"][0]  # plain GRPO scores once: half the grader calls, and behind both two-scoring arms
    assert one.calls[-1] == 100 * 32 and round(one.truth[-1], 3) == 0.620
    late_gain = lambda c: float(c.truth[-3:].mean() - c.truth[0])  # noqa: E731  (the late window: steps 80-100)
    assert round(late_gain(mean2) - late_gain(one), 3) == 0.097  # seed 0
    # seed 1 of the candidate: it validated at every tenth step, from the same start, and rose less than at seed 0
    second = curves["setgrpo_reliability"][1]
    assert second.lost == () and second.steps.tolist() == list(range(0, 101, 10))
    assert round(second.truth[0], 3) == 0.521 and round(second.truth[-1], 3) == 0.660
    assert arms["setgrpo_reliability"]["seeds"] == [0, 1] and arms["setgrpo_reliability"]["paired_seeds"]["grpo_mean2"] == [0, 1]
    assert round(arms["setgrpo_reliability"]["gain"], 3) == 0.161
    # GRPO on the mean of two at seed 1 rose to 0.674; over the late window the two arms stay level at both seeds
    assert round(curves["grpo_mean2"][1].truth[-1], 3) == 0.674
    late = arms["setgrpo_reliability"]["late_paired"]["grpo_mean2"]
    assert abs(late[0]) < 0.005 and late[0] - late[1] < 0 < late[0] + late[1]
    # plain GRPO at seed 1 rose to 0.700, above both two-scoring arms at that seed: seed 0's gap (0.097 behind
    # GRPO on the mean of two over the late window) reversed, so over two seeds no arm is apart from another
    grpo1 = curves["grpo"][1]
    assert grpo1.calls[-1] == 100 * 32 and round(grpo1.truth[-1], 3) == 0.700
    assert round(late_gain(grpo1), 3) == 0.175
    assert round(late_gain(grpo1) - late_gain(curves["grpo_mean2"][1]), 3) == 0.045
    assert round(late_gain(grpo1) - late_gain(second), 3) == 0.040
    for arm in ("setgrpo_reliability", "grpo_mean2"):  # paired over both seeds: (0.097 - 0.045) / 2 for grpo_mean2
        assert arms[arm]["paired_seeds"]["grpo"] == [0, 1]
    assert round(arms["grpo_mean2"]["late_paired"]["grpo"][0], 3) == 0.026
    # docs/outcome_verl.png is drawn from the same runs
    from setgrpo_verl.report.outcome import plot_outcome

    assert plot_outcome(curves, tmp_path / "outcome.png").stat().st_size > 0


# --- one experiment: what compare keeps, continues or sits beside, and what one analysis reads ---

_FLAGS = ["--arms", "grpo", "grpo_mean2", "--seeds", "0", "--steps", "4", "--val-every", "2",
          "--heldout-prompts", "6"]


def _composed(run, arm, seed, extra=(), flags=_FLAGS):
    """The verl command compare composes for (arm, seed) with ``extra`` flags, as its command.sh holds it."""
    from setgrpo_verl.runner.cli import overrides_from_args
    from setgrpo_verl.runner.compare import _commands, _split
    from setgrpo_verl.runner.run import make_plan

    args = cli.build_parser().parse_args(["compare", "--run-dir", str(run), *flags, "--arms", arm, "--seeds",
                                          str(seed), *extra])
    plan = make_plan(args, overrides_from_args(args))
    lifecycle = plan_run(run, list(compare_depends([arm], [seed])), depends=compare_depends([arm], [seed]))
    command = next(c for _, n, c in _commands(args, plan, lifecycle) if n == run_name(arm, seed))
    return "#!/usr/bin/env bash\nVERL_PLATFORM=cpu " + " ".join(command) + "\n"


@pytest.fixture(scope="module")
def _split_dir(tmp_path_factory):
    """The data split compare writes for :data:`_FLAGS`, made once (tokenizing the prompts takes seconds)."""
    from setgrpo_verl.runner.cli import overrides_from_args
    from setgrpo_verl.runner.compare import _split
    from setgrpo_verl.runner.datasplit import write_data
    from setgrpo_verl.runner.run import make_plan

    run = tmp_path_factory.mktemp("split") / "run"
    args = cli.build_parser().parse_args(["compare", "--run-dir", str(run), *_FLAGS, "--flip-prob", "0.06"])
    write_data(run, _split(args, make_plan(args, overrides_from_args(args))))
    return run / "data"


def _data(run, split_dir):
    """``split_dir`` copied into ``run`` (the runs of these tests were made from it)."""
    import shutil

    shutil.copytree(split_dir, run / "data")


def _finished(run, arm, seed, extra=(), truth=(0.5, 0.55, 0.6)):
    path = run / run_name(arm, seed)
    _metrics(path, list(truth))
    (path / "command.sh").write_text(_composed(run, arm, seed, extra))
    return path


def test_resume_refuses_to_keep_continue_or_join_runs_made_with_other_settings(tmp_path, capsys, _split_dir):
    """A kept, continued or untouched run was made with the settings this command would use for it, or compare
    refuses before anything runs and names the setting, its flag and both values (review D1)."""
    run = tmp_path / "run"
    base = ["compare", "--run-dir", str(run), *_FLAGS, "--flip-prob", "0.06", "--resume", "--dry-run"]
    _data(run, _split_dir)
    _finished(run, "grpo", 0, ["--flip-prob", "0.06"])
    checkpointed = run / run_name("grpo_mean2", 0)
    checkpointed.mkdir(parents=True)
    (checkpointed / "checkpoints").mkdir()
    (checkpointed / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    (checkpointed / "command.sh").write_text(_composed(run, "grpo_mean2", 0, ["--flip-prob", "0.06"]))
    _finished(run, "grpo", 1, ["--flip-prob", "0.06"])  # a seed this command does not run
    assert cli.main(base) == 0
    capsys.readouterr()
    for flag, value, key, theirs in (("--flip-prob", "0.1", "reward.reward_kwargs.grader", "{type:noisy,flip_prob:0.06"),
                                     ("--lr", "3e-6", "actor_rollout_ref.actor.optim.lr", "2e-05")):
        assert cli.main(base + [flag, value]) == 2
        err = capsys.readouterr().err
        for name in ("compare/grpo_s0", "compare/grpo_mean2_s0", "compare/grpo_s1"):
            assert f"{name} was made with {key}={theirs}" in err, err
        assert f"({flag}) where this command has" in err and "pass the flags they were made with" in err
    assert not (run / "outcome").exists()


def test_every_setting_but_what_a_resume_an_arm_or_a_seed_changes_makes_the_experiment(tmp_path):
    """K, groups per step, response length, learning rate and the grader differ between experiments; the run's
    paths (the run directory moved), its seed and name and val_before_train do not; across arms, the estimator and
    the reward's scorings do not either."""
    from setgrpo_verl.report.experiment import differing_settings, experiment_settings

    grpo = _composed(tmp_path / "a", "grpo", 0, ["--flip-prob", "0.06"])
    moved = _composed(tmp_path / "b", "grpo", 0, ["--flip-prob", "0.06"])
    assert differing_settings(grpo, moved) == []
    assert differing_settings(grpo, grpo.replace("val_before_train=true", "val_before_train=false")) == []
    for flags, key in ((["--rollout-n", "6"], "actor_rollout_ref.rollout.n"),
                       (["--groups-per-step", "4"], "data.train_batch_size"),
                       (["--max-response-length", "64"], "data.max_response_length"),
                       (["--lr", "3e-6"], "actor_rollout_ref.actor.optim.lr"),
                       (["--flip-prob", "0.1"], "reward.reward_kwargs.grader"),
                       (["--steps", "6"], "trainer.total_training_steps")):
        other = _composed(tmp_path / "a", "grpo", 0, ["--flip-prob", "0.06", *flags])
        assert key in [k for k, _, _ in differing_settings(grpo, other)], flags
        assert experiment_settings(grpo)[key] != experiment_settings(other)[key]
    seed1 = _composed(tmp_path / "a", "grpo", 1, ["--flip-prob", "0.06"])
    mean2 = _composed(tmp_path / "a", "grpo_mean2", 1, ["--flip-prob", "0.06"])
    assert experiment_settings(grpo) == experiment_settings(seed1) == experiment_settings(mean2)


def test_one_analysis_reads_one_experiment_in_compare_and_report_alike(tmp_path, capsys):
    """compare's analysis and report --outcome share one check: runs at another learning rate are refused by both,
    naming the setting; compare's analysis also refuses a --flip-prob other than the runs' (review D1)."""
    run = tmp_path / "run"
    for arm in ("grpo", "grpo_mean2"):
        _finished(run, arm, 0, ["--flip-prob", "0.06"])
    analyse = ["compare", "--run-dir", str(run), *_FLAGS, "--analysis-only"]
    assert cli.main([*analyse, "--flip-prob", "0.06"]) == 0
    assert cli.main(["report", "--outcome", str(run / "compare")]) == 0
    capsys.readouterr()
    assert cli.main([*analyse, "--flip-prob", "0.1"]) == 2
    assert "made at flip 0.06, not --flip-prob 0.1: pass --flip-prob 0.06" in capsys.readouterr().err
    _finished(run, "grpo_mean2", 0, ["--flip-prob", "0.06", "--lr", "3e-6"])
    assert cli.main([*analyse, "--flip-prob", "0.06"]) == 2
    compare_err = capsys.readouterr().err
    assert cli.main(["report", "--outcome", str(run / "compare")]) == 2
    report_err = capsys.readouterr().err
    for err in (compare_err, report_err):
        assert "runs of different experiments: actor_rollout_ref.actor.optim.lr differs (grpo_mean2_s0 3e-06, " \
               "grpo_s0 " in err, err


def test_the_committed_runs_are_one_experiment():
    from pathlib import Path

    from setgrpo_verl.report.experiment import check_same_experiment

    root = Path(__file__).resolve().parents[2] / "validation" / "outcome_verl"
    for flip in sorted(root.glob("flip*")) + [root / "pilot"]:
        runs = {p.name: (p / "command.sh").read_text() for p in flip.iterdir() if (p / "command.sh").is_file()
                and p.name != "calibration"}
        assert len(runs) >= 2
        check_same_experiment(runs, str(flip))


def test_a_run_stopped_during_a_validation_validates_it_before_training_on(tmp_path, _split_dir):
    """verl saves the checkpoint, then validates, then logs the step's row: a run stopped in between continues with
    trainer.val_before_train=true, so the validation it owes is made (review D5); one whose row has it does not."""
    run = tmp_path / "run"
    _data(run, _split_dir)
    path = run / run_name("grpo", 0)
    _metrics(path, [0.5, 0.55, 0.6])  # validated at 0, 2, 4
    (path / COMPLETE).unlink()
    (path / "command.sh").write_text(_composed(run, "grpo", 0, ["--flip-prob", "0.06"]))
    (path / "checkpoints").mkdir()
    (path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("4")
    rows = (path / "metrics.jsonl").read_text().splitlines(keepends=True)
    (path / "metrics.jsonl").write_text("".join(rows[:4]))  # rows of steps 0-3: stopped during step 4's validation
    _finished(run, "grpo_mean2", 0, ["--flip-prob", "0.06"])
    assert "trainer.val_before_train=true" in _dry_run_command(run, "grpo_s0")
    (path / "metrics.jsonl").write_text("".join(rows))
    assert "trainer.val_before_train=false" in _dry_run_command(run, "grpo_s0")

    from setgrpo_verl.runner.compare import owes_validation

    assert not owes_validation(path)
    (path / "metrics.jsonl").write_text("".join(rows[:4]))
    assert owes_validation(path)
    # the rows kept aside by a resume that died before writing them back count too
    (path / "metrics.jsonl.kept").write_text("".join(rows))
    (path / "metrics.jsonl").write_text("")
    assert not owes_validation(path)


def _dry_run_command(run, experiment):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["compare", "--run-dir", str(run), *_FLAGS, "--flip-prob", "0.06", "--resume",
                         "--dry-run"]) == 0
    return next(line for line in buf.getvalue().splitlines()
                if f"trainer.experiment_name={experiment} " in line)


def test_an_analysis_short_of_a_validation_names_the_fix_that_works(tmp_path, capsys):
    """A finished run that validated last at an earlier step than the others (an earlier version continued it
    without the validation it owed): the analysis names the run, the step and what to remove before --resume
    (review D5)."""
    run = tmp_path / "run"
    _finished(run, "grpo", 0, ["--flip-prob", "0.06"])
    short = _finished(run, "grpo_mean2", 0, ["--flip-prob", "0.06"])
    rows = (short / "metrics.jsonl").read_text().splitlines(keepends=True)
    data = json.loads(rows[-1])
    data["data"] = {k: v for k, v in data["data"].items() if "truth_score" not in k}
    (short / "metrics.jsonl").write_text("".join(rows[:-1]) + json.dumps(data) + "\n")
    (short / "checkpoints").mkdir()
    (short / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("4")
    assert cli.main(["compare", "--run-dir", str(run), *_FLAGS, "--flip-prob", "0.06", "--analysis-only"]) == 2
    err = capsys.readouterr().err
    assert "the other finished runs validated last at step 4; grpo_mean2_s0 validated last at step 2: remove " \
           f"{short / COMPLETE} and rerun this command with --resume (it continues from its checkpoint of step 4" in err
    import shutil

    shutil.rmtree(short / "checkpoints")
    assert cli.main(["compare", "--run-dir", str(run), *_FLAGS, "--flip-prob", "0.06", "--analysis-only"]) == 2
    assert f"remove {short}/ and rerun this command with --resume" in capsys.readouterr().err


def test_the_runs_of_one_arm_also_share_the_arms_own_settings(tmp_path):
    from setgrpo_verl.report.experiment import check_same_experiment

    paper = _composed(tmp_path, "setgrpo_paper", 0, ["--flip-prob", "0.06"])
    other = _composed(tmp_path, "setgrpo_paper", 1, ["--flip-prob", "0.06", "--alpha", "0.3"])
    grpo = _composed(tmp_path, "grpo", 1, ["--flip-prob", "0.06"])
    check_same_experiment({"setgrpo_paper_s0": paper, "grpo_s1": grpo}, "R")
    with pytest.raises(ReportError, match=r"R: runs of different experiments: algorithm.setgrpo.alpha differs "
                                          r"\(setgrpo_paper_s0 0.2, setgrpo_paper_s1 0.3\)"):
        check_same_experiment({"setgrpo_paper_s0": paper, "setgrpo_paper_s1": other, "grpo_s1": grpo}, "R")
