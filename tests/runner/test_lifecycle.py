"""The run directory's lifecycle: one decision per directory (setgrpo_verl.runner.lifecycle), the lock, and the commands
that used to lose finished work."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from setgrpo_verl.runner import cli, launch
from setgrpo_verl.core import CalibrationSettings, calibrate
from setgrpo_verl.integration.reward_manager import grading_counts
from setgrpo_verl.runner.lifecycle import DEPENDS, dir_state, plan_run
from setgrpo_verl.models import embedded_model_dir
from setgrpo_verl.rundir import COMPLETE, LaunchError
from setgrpo_verl.runner.runlock import LOCK_FILE, holder, run_dir_lock

from ..core.synthetic import make_groups

#: What each command writes and reads (cli.py's _cmd_* functions).
COMMANDS = {
    "calibrate": (["data", "calibration"], ()),
    "quickstart": (["data", "calibration", "train_setgrpo", "report"], ()),
    "quickstart --baseline": (["data", "calibration", "train_setgrpo", "train_grpo", "report"], ()),
    "train": (["train_setgrpo"], ("data", "calibration")),
    "train --estimator grpo": (["train_grpo"], ("data",)),
    "validate": (["data", "calibration", "validation"], ()),
    "validate --analysis-only": (["validation"], ("calibration",)),
    "report": (["report"], ("calibration",)),
}


def _make(run, states: dict[str, str]) -> None:
    for name, state in states.items():
        path = run / name
        if state == "absent":
            continue
        path.mkdir(parents=True)
        (path / "work.txt").write_text("hours of work\n")
        if state == "checkpointed":
            (path / "checkpoints").mkdir()
            (path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
        if state == "complete":
            (path / COMPLETE).write_text("1.0 s\n")


def _plan(tmp_path, command, states, flags=(), same_data=True):
    run = tmp_path / "run"
    _make(run, states)
    writes, reads = COMMANDS[command]
    plan = plan_run(run, writes, reads=reads, overwrite="--overwrite" in flags, resume="--resume" in flags,
                    same_data=same_data if states.get("data") == "complete" else None)
    return {d.name: d.action for d in plan.dirs}


C, P, K, A = "complete", "partial", "checkpointed", "absent"
ALL_COMPLETE = {name: C for name in DEPENDS}

#: (command, existing states, flags, expected action per directory).
TABLE = [
    ("calibrate", {}, (), {"data": "create", "calibration": "create"}),
    ("calibrate", {"data": C, "calibration": C}, (), {"data": "keep", "calibration": "refuse"}),
    ("calibrate", {"data": C, "calibration": C}, ("--resume",), {"data": "keep", "calibration": "keep"}),
    ("calibrate", {"data": C, "calibration": P}, ("--resume",), {"data": "keep", "calibration": "replace"}),
    # --overwrite replaces what the command writes and removes everything made from it
    ("calibrate", ALL_COMPLETE, ("--overwrite",),
     {"data": "replace", "calibration": "replace", "train_setgrpo": "remove", "train_grpo": "remove",
      "validation": "remove", "report": "remove"}),
    # a finished calibration is kept when the combined stage has no checkpoint
    ("quickstart --baseline", {"data": C, "calibration": C, "train_setgrpo": P}, ("--resume",),
     {"data": "keep", "calibration": "keep", "train_setgrpo": "replace", "train_grpo": "create", "report": "create"}),
    ("quickstart --baseline", {"data": C, "calibration": C, "train_setgrpo": K, "train_grpo": C, "report": C},
     ("--resume",),
     {"data": "keep", "calibration": "keep", "train_setgrpo": "continue", "train_grpo": "keep", "report": "replace"}),
    # a checkpointed training stage is never deleted because its calibration is started over
    ("quickstart --baseline", {"data": C, "calibration": P, "train_setgrpo": K}, ("--resume",),
     {"data": "keep", "calibration": "replace", "train_setgrpo": "refuse", "train_grpo": "create",
      "report": "create"}),
    # an old baseline does not survive --overwrite as "the same seeds"
    ("quickstart", ALL_COMPLETE, ("--overwrite",),
     {"data": "replace", "calibration": "replace", "train_setgrpo": "replace", "train_grpo": "remove",
      "validation": "remove", "report": "replace"}),
    ("train", {"data": C, "calibration": C, "train_setgrpo": K}, (),
     {"data": "keep", "calibration": "keep", "train_setgrpo": "refuse"}),
    ("train", {"data": C, "calibration": C, "train_setgrpo": K}, ("--resume",),
     {"data": "keep", "calibration": "keep", "train_setgrpo": "continue"}),
    ("train", {"data": C, "calibration": K}, (), {"data": "keep", "calibration": "refuse", "train_setgrpo": "create"}),
    ("train", {"data": C, "calibration": C, "train_setgrpo": C, "report": C}, ("--overwrite",),
     {"data": "keep", "calibration": "keep", "train_setgrpo": "replace", "report": "remove"}),
    ("train --estimator grpo", {"calibration": C}, (), {"data": "refuse", "train_grpo": "create"}),
    ("validate", {"data": C, "calibration": C, "validation": C}, ("--resume",),
     {"data": "keep", "calibration": "keep", "validation": "keep"}),
    ("validate", {"data": C, "calibration": C, "validation": P}, ("--resume",),
     {"data": "keep", "calibration": "keep", "validation": "replace"}),
    ("validate", {"data": C, "calibration": C, "validation": C}, (),
     {"data": "keep", "calibration": "refuse", "validation": "refuse"}),
    ("validate --analysis-only", {"data": C, "calibration": C, "validation": C}, ("--overwrite",),
     {"calibration": "keep", "validation": "replace"}),
    ("report", {"data": C, "calibration": C, "report": C}, (), {"calibration": "keep", "report": "replace"}),
]


@pytest.mark.parametrize("command, states, flags, expected", TABLE)
def test_the_plan_of_each_command_state_and_flag(tmp_path, command, states, flags, expected):
    assert _plan(tmp_path, command, states, flags) == expected


def test_another_split_is_refused_and_replaced_only_with_overwrite(tmp_path):
    states = {"data": C, "calibration": C}
    assert _plan(tmp_path / "a", "calibrate", states, ("--resume",), same_data=False)["data"] == "refuse"
    assert _plan(tmp_path / "b", "calibrate", states, ("--overwrite",), same_data=False) == {
        "data": "replace", "calibration": "replace"}


def test_no_finished_or_checkpointed_work_is_deleted_unless_overwrite_names_it(tmp_path):
    """Every command, every combination of states (sampled) and every flag: a complete or checkpointed directory is
    only replaced or removed under --overwrite, and the written directories get one of the four decisions."""
    rng = random.Random(0)
    names = list(DEPENDS)
    combos = [dict(zip(names, c)) for c in itertools.product((A, P, K, C), repeat=len(names))]
    n = 0
    for command, flags in itertools.product(COMMANDS, ((), ("--resume",), ("--overwrite",))):
        for states in rng.sample(combos, 12):
            states["data"] = rng.choice((A, P, C))  # data has no verl checkpoint
            actions = _plan(tmp_path / str(n), command, states, flags)
            n += 1
            for name, action in actions.items():
                if states[name] in (C, K) and action in ("replace", "remove"):
                    assert "--overwrite" in flags or name == "report", (command, states, flags, actions)
                if name in COMMANDS[command][0] and states[name] == A:
                    assert action == "create"
            for name, state in states.items():  # nothing derived from a rewritten directory is left as it was
                stale = any(actions.get(u) in ("create", "replace", "remove") for u in DEPENDS[name])
                if stale and state != A:
                    assert actions.get(name) in ("replace", "remove", "refuse"), (command, states, flags, actions)


def test_resume_and_overwrite_together_are_refused(tmp_path):
    with pytest.raises(LaunchError, match="pass one"):
        plan_run(tmp_path, ["data"], overwrite=True, resume=True)


def test_dir_state(tmp_path):
    _make(tmp_path, {"a": P, "b": K, "c": C})
    assert [dir_state(tmp_path / n) for n in "abcd"] == [P, K, C, A]


def test_a_calibration_with_shards_and_no_record_is_continued_under_resume(tmp_path):
    shards = tmp_path / "calibration" / "shards"
    shards.mkdir(parents=True)
    (shards / "batch_000000.npz").write_bytes(b"x")
    assert dir_state(tmp_path / "calibration") == K
    assert plan_run(tmp_path, ["calibration"], resume=True)["calibration"].action == "continue"
    assert "after 1 calibration shard(s)" in plan_run(tmp_path, ["calibration"], resume=True).text()
    refused = plan_run(tmp_path, ["calibration"])["calibration"]
    assert refused.action == "refuse" and "interrupted after 1 calibration shard(s): pass --resume" in refused.reason
    assert plan_run(tmp_path, ["calibration"], overwrite=True)["calibration"].action == "replace"
    # shards copied into a run directory without its data split: the split is made again and the shards continued
    fresh = plan_run(tmp_path, ["data", "calibration"], resume=True)
    assert (fresh["data"].action, fresh["calibration"].action) == ("create", "continue")
    assert plan_run(tmp_path, ["data", "calibration"])["calibration"].action == "refuse"
    # a finished part of a sharded calibration (COMPLETE, shards, no record) is kept under --resume, not removed
    (tmp_path / "calibration" / COMPLETE).write_text("12.0 s\n")
    assert dir_state(tmp_path / "calibration") == K
    assert plan_run(tmp_path, ["calibration"], resume=True)["calibration"].action == "continue"
    (tmp_path / "calibration" / "record.json").write_text("{}")
    assert dir_state(tmp_path / "calibration") == C


# ---------------------------------------------------------------- the commands that lost finished work

def test_resume_of_the_combined_stage_keeps_a_finished_calibration(tmp_path):
    cal = tmp_path / "calibration"
    cal.mkdir()
    for name, text in (("record.json", "{}"), ("paired_scores.npz", "x"), (COMPLETE, "8123.4 s\n")):
        (cal / name).write_text(text)
    with pytest.raises(LaunchError, match="calibration is complete and kept; run the train stage"):
        launch.run_stage(tmp_path, "calibrate_train", [sys.executable, "-c", "pass"], env=dict(os.environ),
                         resume=True)
    assert sorted(p.name for p in cal.iterdir()) == [COMPLETE, "paired_scores.npz", "record.json"]


def test_quickstart_resume_trains_with_the_kept_record(tmp_path, capsys):
    run = tmp_path / "run"
    # the judge path: the smoke profile's 80-token prompts are the IFBench rows, which the rules grader does not read
    assert cli.main(["quickstart", "--run-dir", str(run), "--profile", "smoke", "--judge", "local", "--no-baseline",
                     "--dry-run"]) == 0
    capsys.readouterr()
    split = launch.split_data(data=None, model_path=embedded_model_dir(), max_prompt_length=80,
                              calibration_prompts=12, seed=1)
    launch.write_data(run, split)
    _make(run, {"calibration": C, "train_setgrpo": P})
    # this calibration has no record: the dry run makes the run's own check, which refuses it after the plan
    assert cli.main(["quickstart", "--run-dir", str(run), "--profile", "smoke", "--judge", "local", "--no-baseline",
                     "--resume", "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert "record.json: no such file" in err
    assert "calibration/ (complete): keep" in out and "train_setgrpo/ (partial): replace" in out
    (cmd,) = [line for line in out.splitlines() if not line.startswith("[")]
    assert f"algorithm.setgrpo.record_path={(run / 'calibration' / 'record.json').resolve()}" in cmd
    assert "algorithm.setgrpo.record_out" not in cmd


def test_rows_without_id_are_distinct_prompts(tmp_path):
    rows = [{"question": f"Write a poem number {i} about the sea.", "rubrics": [{"criterion": "It rhymes.", "points": 1}]}
            for i in range(10)]
    rows += [{"id": "x1", "question": "Tell me a joke.", "rubrics": [{"criterion": "It is funny.", "points": 1}]},
             {"question": "write a  POEM number 3 about the sea.", "rubrics": [{"criterion": "x", "points": 1}]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    split = launch.split_data(data=path, model_path=embedded_model_dir(), max_prompt_length=128,
                              calibration_prompts=2, seed=1)
    ids = [r["extra_info"]["id"] for r in split["calibration"] + split["train"]]
    assert split["duplicates"] == 1 and len(ids) == 11 == len(set(ids))  # only the re-cased poem 3 is a duplicate
    assert sum(i.startswith("q-") and len(i) == 18 for i in ids) == 10


def _calibrated(run, complete_text: str) -> None:
    cal = run / "calibration"
    cal.mkdir(parents=True)
    point, ref, gram = make_groups(120, k=4, seed=3)
    calibrate(point, ref, gram,
              CalibrationSettings(alpha=0.2, beta=0.3, delta=0.05,
                                  on_infeasible="reject_all")).to_json(cal / "record.json")
    np.savez(cal / "paired_scores.npz", point=point.numpy(), reference=ref.numpy(), gram=gram.numpy())
    (cal / COMPLETE).write_text(complete_text)


_ANALYSIS = ["--analysis-only", "--splits", "2", "--judge", "rules", "--alpha", "0.2", "--beta", "0.3", "--delta", "0.05"]


@pytest.mark.parametrize("complete_text", ["calibrated by train_setgrpo/\n", "- s calibrated by train_setgrpo/\n"])
def test_validate_analysis_of_a_quickstart_calibration(tmp_path, complete_text):
    run = tmp_path / "run"
    _calibrated(run, complete_text)
    assert cli.main(["validate", "--run-dir", str(run), *_ANALYSIS]) == 0
    report = json.loads((run / "validation" / "validation.json").read_text())
    assert report["calibration_stage_seconds"] is None and (run / "validation" / COMPLETE).is_file()


def test_a_failed_analysis_keeps_the_old_validation(tmp_path, capsys):
    run = tmp_path / "run"
    _calibrated(run, "12.5 s\n")
    (run / "validation").mkdir()
    (run / "validation" / "validation.json").write_text('{"earlier": 1}')
    (run / "validation" / COMPLETE).write_text("3.0 s\n")
    (run / "calibration" / "paired_scores.npz").write_bytes(b"not an npz")
    assert cli.main(["validate", "--run-dir", str(run), *_ANALYSIS, "--overwrite"]) == 2
    assert "validate:" in capsys.readouterr().err
    assert (run / "validation" / "validation.json").read_text() == '{"earlier": 1}'


def test_validate_resume_keeps_a_finished_validation_and_redoes_a_partial_one(tmp_path, capsys):
    run = tmp_path / "run"
    _calibrated(run, "12.5 s\n")
    (run / "validation").mkdir()
    (run / "validation" / "validation.json").write_text('{"earlier": 1}')
    (run / "validation" / COMPLETE).write_text("3.0 s\n")
    assert cli.main(["validate", "--run-dir", str(run), *_ANALYSIS, "--resume"]) == 0
    assert "is complete, kept" in capsys.readouterr().out
    (run / "validation" / COMPLETE).unlink()
    assert cli.main(["validate", "--run-dir", str(run), *_ANALYSIS, "--resume"]) == 0
    assert "levels" in json.loads((run / "validation" / "validation.json").read_text())
    assert json.loads((run / "calibration" / "record.json").read_text())  # the calibration is untouched


# ---------------------------------------------------------------- the lock

def test_a_second_command_on_a_locked_run_directory_is_refused_with_the_holder(tmp_path, capsys):
    run = tmp_path / "run"
    _make(run, {"data": C, "calibration": P})
    with run_dir_lock(run, ["setgrpo-verl", "calibrate", "--run-dir", str(run)]):
        info = holder(run)
        assert info["pid"] == os.getpid() and info["command"].startswith("setgrpo-verl calibrate")
        assert cli.main(["calibrate", "--run-dir", str(run), "--profile", "smoke", "--resume"]) == 2
        err = capsys.readouterr().err
        assert f"in use by another command (pid {os.getpid()}" in err and "started" in err
        assert "--overwrite" not in err
    assert (run / "calibration" / "work.txt").is_file() and holder(run) is None


#: A command in its own process: takes the lock, says "held" (or the error), waits for a line on stdin, releases.
_HOLD = """
import sys
from setgrpo_verl.runner.runlock import run_dir_lock
from setgrpo_verl.rundir import LaunchError
try:
    with run_dir_lock(sys.argv[1], ["setgrpo-verl", sys.argv[2]]):
        print("held", flush=True)
        sys.stdin.readline()
except LaunchError as exc:
    print("refused:", exc, flush=True)
"""


def _command(run, name):
    return subprocess.Popen([sys.executable, "-c", _HOLD, str(run), name], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=os.getcwd(),
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_two_processes_never_hold_the_lock_at_once_and_a_dead_holders_lock_is_free(tmp_path):
    import signal
    import socket

    run = tmp_path / "run"
    run.mkdir()
    # the lock file of a command that crashed: a holder named, but no process holds the lock
    (run / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "command": "setgrpo-verl crashed",
                                             "started": "earlier"}))
    assert holder(run) is None
    first = _command(run, "first")
    assert first.stdout.readline() == "held\n"
    assert "previous command (pid 1" in first.stderr.readline()
    second = _command(run, "second")
    out, _ = second.communicate(timeout=60)
    assert out.startswith(f"refused: {run} is in use by another command (pid {first.pid}")
    assert "`setgrpo-verl first`" in out
    assert holder(run)["pid"] == first.pid
    first.communicate("\n", timeout=60)
    assert first.returncode == 0 and holder(run) is None and (run / LOCK_FILE).read_text() == ""
    # a holder killed inside the lock: its lock goes with its process, the next command takes it
    third = _command(run, "third")
    assert third.stdout.readline() == "held\n"
    third.send_signal(signal.SIGKILL)
    third.wait(timeout=60)
    assert holder(run) is None
    fourth = _command(run, "fourth")
    assert fourth.stdout.readline() == "held\n"
    _, err = fourth.communicate("\n", timeout=60)
    assert f"previous command (pid {third.pid} on {socket.gethostname()}, `setgrpo-verl third`" in err


def test_the_lock_file_is_never_deleted_so_two_takers_lock_one_file(tmp_path):
    run = tmp_path / "run"
    with run_dir_lock(run, ["setgrpo-verl", "a"]):
        inode = (run / LOCK_FILE).stat().st_ino
        with pytest.raises(LaunchError, match="in use by another command"):  # another open file, same process
            with run_dir_lock(run, ["setgrpo-verl", "b"]):
                pass
    assert (run / LOCK_FILE).stat().st_ino == inode and holder(run) is None


def test_earlier_data_splits_and_written_records_count_as_finished(tmp_path):
    data = tmp_path / "run" / "data"
    data.mkdir(parents=True)
    for name in ("calibration.parquet", "train.parquet"):
        (data / name).write_bytes(b"")
    assert dir_state(data) == "partial"  # split.json is written last
    (data / "split.json").write_text("{}")
    assert dir_state(data) == "complete"
    calibration = tmp_path / "run" / "calibration"
    calibration.mkdir()
    (calibration / "paired_scores.npz").write_bytes(b"")
    assert dir_state(calibration) == "partial"
    (calibration / "record.json").write_text("{}")  # written after the paired scores
    assert dir_state(calibration) == "complete"


# ---------------------------------------------------------------- verl's padding rows

def test_padding_rows_are_not_counted_as_verdicts():
    extra = [{"reward_extra_info": {"unparsed": 3 if i == 0 else 0, "judged": 4}} for i in range(8)]
    tags = [{"status": "success"} for _ in range(8)]
    # verl fills the batch up to its divisor with copies of the first row, tagged is_padding
    padded, padded_tags = extra + [extra[0]] * 8, tags + [{"status": "success", "is_padding": True}] * 8
    assert grading_counts({"extra_fields": extra}, tags) == (3.0, 32.0)
    assert grading_counts({"extra_fields": padded}, padded_tags) == (3.0, 32.0)
    with pytest.raises(ValueError, match="tags for a batch"):
        grading_counts({"extra_fields": padded}, tags)


def test_the_default_profile_saves_checkpoints_to_resume_from():
    """verl saves every save_freq steps and after the last step when save_freq > 0: the main job's 3 steps end in one
    checkpoint, and a longer training with the default or judge profile loses at most 4 steps to an interruption."""
    for profile in ("default", "judge"):
        values = cli.PROFILES[profile]
        every, steps = values["trainer.save_freq"], values["trainer.total_training_steps"]
        # the steps verl saves after (trainer_base.fit: global_steps % save_freq == 0, or the last step)
        saved = [s for s in range(1, steps + 1) if s % every == 0 or s == steps]
        assert saved == [3] and values["trainer.max_actor_ckpt_to_keep"] == 1
        longer = [s for s in range(1, 23) if s % every == 0 or s == 22]
        assert longer == [5, 10, 15, 20, 22] and max(b - a for a, b in zip([0] + longer, longer)) <= 5
    args = cli.build_parser().parse_args(["quickstart", "--dry-run"])
    assert "trainer.save_freq=5" in cli._plan(args).common


def test_the_default_sketch_micro_batch_fits_the_last_calibration_batch_as_verl_pads_it(tmp_path):
    from omegaconf import OmegaConf

    from setgrpo_verl.integration.config import setgrpo_config_from
    from setgrpo_verl.integration.micro_batch import check_sketch_micro_batch, sketch_micro_batch_error

    args = cli.build_parser().parse_args(["calibrate", "--run-dir", str(tmp_path / "run"), "--calib-groups", "50"])
    values = cli._plan(args).values
    cfg = OmegaConf.create({})
    for key, value in {**values, "trainer.n_gpus_per_node": 1, "trainer.nnodes": 1,
                       "algorithm.setgrpo.calibration.only": True}.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    check_sketch_micro_batch(cfg, setgrpo_config_from(cfg.algorithm))  # main_ppo's check before Ray agrees
    # 2 prompts x 4 responses in the last batch: verl pads 8 up to lcm(1 rank, 4 prompts x 4) = 16
    last = {"the last batch": 2}
    assert sketch_micro_batch_error(k=4, prompts=last, ranks=1, micro=16, source="s", multiple=16) is None
    assert "padded to" not in sketch_micro_batch_error(k=4, prompts=last, ranks=1, micro=16, source="s")
    assert "padded to 16" in sketch_micro_batch_error(k=4, prompts=last, ranks=1, micro=32, source="s", multiple=16)


def test_a_sketch_micro_batch_that_cannot_split_a_batch_is_refused_before_anything_is_written(tmp_path, capsys):
    run = tmp_path / "run"
    # 6 prompts x 3 responses = 18 per calibration batch (verl pads to a multiple of 6 x 3): 4 does not divide it
    assert cli.main(["validate", "--run-dir", str(run), "--calib-batch-size", "6", "--rollout-n", "3",
                     "--groups-per-step", "6", "--dry-run"]) == 2
    assert "micro_batch_size_per_gpu=4 does not divide" in capsys.readouterr().err and not run.exists()
