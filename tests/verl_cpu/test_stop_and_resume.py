"""Stopping and resuming real ``main_ppo`` runs of the command line (tiny random Llama, function grader).

What must hold: SIGTERM to ``setgrpo-verl`` once its ``main_ppo`` has started the local Ray instance stops
``main_ppo`` and every process of that Ray instance, and ``FAILED`` says why. A ``train`` run stopped after its
checkpoint of step 1 and resumed with ``--resume`` ends with the metrics history, group log and monitor counts of
an uninterrupted 2-step run; resuming it with another record is refused before Ray, naming both hashes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from setgrpo_verl.integration.resume import read_state
from setgrpo_verl.runner.supervise import session_members

from .conftest import REWARD_PY, read_metrics, tail

# a module's first test may wait for the verl runs of its chain (serial_main_ppo, tests/conftest.py), which
# pytest-timeout counts: its limit covers that wait as well as the module's own runs
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000), pytest.mark.usefixtures("serial_main_ppo")]

_FLAGS = ["--rollout-n", "3", "--groups-per-step", "3", "--calib-groups", "6", "--calib-batch-size",
          "6", "--max-prompt-length", "128", "--max-response-length", "8", "--alpha", "0.5", "--beta", "0.9",
          "--delta", "0.3", "--tau-grid", "0.0,0.3", "--on-infeasible", "reject_all"]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    if int(fh.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_sigterm_stops_main_ppo_and_its_ray_instance(tiny_model, reward_file, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "setgrpo_verl", "calibrate", "--run-dir", str(run), "--model", str(tiny_model),
           "--judge", "function", "--reward-function", str(reward_file), *_FLAGS]
    with open(tmp_path / "cli.log", "w") as out:
        cli = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        log = run / "calibration" / "main_ppo.log"
        _wait_for(lambda: log.is_file() and "Started a local Ray instance" in log.read_text(), 300, "Ray to start")
        (main_ppo,) = _children(cli.pid)
        assert "verl.trainer.main_ppo" in _cmdline(main_ppo)
        assert os.getsid(main_ppo) == main_ppo  # its own session
        # the raylet's command line, once its exec is complete (a process just forked still shows its parent's)
        raylet = _wait_for(lambda: [p for p in session_members(main_ppo)
                                    if "raylet" in _cmdline(p) and "--session_dir=" in _cmdline(p)], 60, "raylet")
        session_dir = next(a.split("=", 1)[1] for a in _cmdline(raylet[0]).split() if a.startswith("--session_dir="))
        members = session_members(main_ppo)
        assert len(members) >= 3, [_cmdline(p) for p in members]  # main_ppo, GCS, raylet, ...
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if cli.poll() is None:
            cli.kill()
    assert session_members(main_ppo) == []
    assert not [p for p in members if _cmdline(p)], "processes of the stopped run survive"
    survivors = [int(e) for e in os.listdir("/proc") if e.isdigit() and session_dir in _cmdline(int(e))]
    assert survivors == [], [_cmdline(p) for p in survivors]
    failed = (run / "calibration" / "FAILED").read_text()
    assert "stopped by SIGTERM" in failed and "Ray instance" in failed
    assert not (run / "calibration" / "COMPLETE").exists()
    assert "stopped by SIGTERM" in Path(tmp_path / "cli.log").read_text()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "setgrpo_verl", *args], capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def calibrated(tiny_model, reward_file, tmp_path_factory):
    run = tmp_path_factory.mktemp("resume") / "calibrated"
    common = ["--model", str(tiny_model), "--judge", "function", "--reward-function", str(reward_file), *_FLAGS,
              "--steps", "2"]
    proc = _cli("calibrate", "--run-dir", str(run), *common)
    assert proc.returncode == 0, tail(proc)
    return run, common


def _copy_calibration(run: Path, to: Path) -> Path:
    for part in ("data", "calibration"):
        shutil.copytree(run / part, to / part)
    return to


def _groups(stage: Path) -> list[dict]:
    return [json.loads(x) for x in (stage / "groups.jsonl").read_text().splitlines()]


def _live(groups: list[dict]) -> int:
    return sum(g["status"] != "degenerate" for g in groups)


def test_stopped_train_resumes_like_an_uninterrupted_run(calibrated, tmp_path):
    from setgrpo_verl.core import CalibrationRecord, calibrate

    run, common = calibrated
    straight = _copy_calibration(run, tmp_path / "straight")
    proc = _cli("train", "--run-dir", str(straight), *common, "trainer.save_freq=1")
    assert proc.returncode == 0, tail(proc)

    stopped = _copy_calibration(run, tmp_path / "stopped")
    stage = stopped / "train_setgrpo"
    cmd = [sys.executable, "-m", "setgrpo_verl", "train", "--run-dir", str(stopped), *common, "trainer.save_freq=1"]
    with open(tmp_path / "stopped.log", "w") as out:
        cli = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        tracker = stage / "checkpoints" / "latest_checkpointed_iteration.txt"
        _wait_for(lambda: tracker.is_file() and tracker.read_text().strip() == "1", 600, "the checkpoint of step 1")
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if cli.poll() is None:
            cli.kill()
    assert tracker.read_text().strip() == "1", "step 2 finished before the signal: the run was not interrupted"
    step1_rows = [g for g in _groups(stage) if g["step"] == 1]
    assert "latest checkpoint is step 1" in (stage / "FAILED").read_text()
    refused = _cli("train", "--run-dir", str(stopped), *common, "trainer.save_freq=1")
    assert refused.returncode == 2 and "--resume" in refused.stderr

    # another record (a re-fit of the same paired scores): refused before Ray, naming both hashes
    original = CalibrationRecord.from_json(stopped / "calibration" / "record.json")
    import numpy as np
    import torch

    z = np.load(stopped / "calibration" / "paired_scores.npz")
    refit = calibrate(torch.from_numpy(z["point"]), torch.from_numpy(z["reference"]), torch.from_numpy(z["gram"]),
                      original.settings, split_seed=original.split_seed + 1,
                      metadata={"loss_agg_mode": original.loss_agg_mode, "sketch": original.sketch,
                                "grader": original.grader, "policy": original.policy,
                                "training": original.training})
    refit.to_json(tmp_path / "refit.json")
    hashes = [r.to_dict()["content_sha256"] for r in (original, refit)]
    assert hashes[0] != hashes[1]
    logged = len((stage / "main_ppo.log").read_text())
    other = _cli("train", "--run-dir", str(stopped), "--resume", "--record", str(tmp_path / "refit.json"), *common,
                 "trainer.save_freq=1")
    assert other.returncode == 2
    assert all(h in other.stderr for h in hashes), other.stderr[-3000:]
    assert "Started a local Ray instance" not in (stage / "main_ppo.log").read_text()[logged:]

    resumed = _cli("train", "--run-dir", str(stopped), "--resume", *common, "trainer.save_freq=1")
    assert resumed.returncode == 0, tail(resumed)
    assert (stage / "COMPLETE").is_file() and not (stage / "FAILED").exists()
    assert "Resuming from" in (stage / "main_ppo.log").read_text()

    # the whole history, once per step, as in the uninterrupted run
    keys = {}
    for name, root in (("straight", straight), ("stopped", stopped)):
        rows = read_metrics(root / "train_setgrpo" / "metrics.jsonl")
        keys[name] = [(m["training/global_step"], "timing_s/step" in m, "setgrpo/calibration/q_alpha" in m)
                      for m in rows]
    assert keys["stopped"] == keys["straight"]
    assert [m for m in keys["stopped"] if m[1]] == [(1, True, False), (2, True, False)]
    groups = {name: _groups(root / "train_setgrpo") for name, root in (("straight", straight), ("stopped", stopped))}
    assert [(g["step"], g["group"]) for g in groups["stopped"]] == [(s, g) for s in (1, 2) for g in range(3)]
    assert [(g["step"], g["group"]) for g in groups["straight"]] == [(s, g) for s in (1, 2) for g in range(3)]
    # monitor counts at the end cover both steps (not only the one after the resume), as uninterrupted
    for name, root in (("straight", straight), ("stopped", stopped)):
        state = read_state(str(root / "train_setgrpo" / "checkpoints" / "global_step_2"))
        step1 = read_state(str(root / "train_setgrpo" / "checkpoints" / "global_step_1"))
        assert state["record_sha256"] == hashes[0]
        assert step1["monitor"]["seen"] == _live([g for g in groups[name] if g["step"] == 1]) > 0
        assert state["monitor"]["seen"] == _live(groups[name]), name
        last = [m for m in read_metrics(root / "train_setgrpo" / "metrics.jsonl") if "timing_s/step" in m][-1]
        assert last["setgrpo/online_coverage_cum"] == pytest.approx(
            state["monitor"]["covered"] / state["monitor"]["seen"])
    # step 1 was not trained again: its rows are those written before the signal (the rollouts of two runs with the
    # same seeds differ on the CPU backend, so the uninterrupted run's values are not the comparison)
    assert groups["stopped"][:3] == step1_rows


def test_a_calibration_stopped_after_its_first_shard_resumes_from_it(tiny_model, tmp_path):
    """SIGTERM once the first calibration batch's shard is written; ``--resume`` calibrates the other batches only:
    the first shard is in the final paired scores unchanged, and the record names every prompt once."""
    import numpy as np

    from setgrpo_verl.core import CalibrationRecord

    run = tmp_path / "run"
    shards = run / "calibration" / "shards"
    release = tmp_path / "release"
    # REWARD_PY's scores, held once the first shard exists until the test creates ``release``: the signal then
    # always arrives while the second batch is rolled out and scored, however fast the machine finishes a batch
    gated = tmp_path / "gated_reward.py"
    gated.write_text(REWARD_PY.replace("def compute_score(", "def _score(") + f"""
import os
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    while os.path.exists({str(shards / "batch_000000.npz")!r}) and not os.path.exists({str(release)!r}):
        time.sleep(0.2)
    return _score(data_source, solution_str, ground_truth, extra_info)
""")
    # three batches of two prompts, each rolled out after the previous one's shard is written: three shards
    flags = [*_FLAGS, "--calib-batch-size", "2", "algorithm.setgrpo.calibration.chunk_batches=1"]
    common = ["--run-dir", str(run), "--model", str(tiny_model), "--judge", "function", "--reward-function",
              str(gated), *flags]
    with open(tmp_path / "stopped.log", "w") as out:
        cli = subprocess.Popen([sys.executable, "-m", "setgrpo_verl", "calibrate", *common], stdout=out,
                               stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: (shards / "batch_000000.npz").is_file(), 600, "the first calibration shard")
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if cli.poll() is None:
            cli.kill()
    assert not (run / "calibration" / "record.json").exists(), "the calibration finished before the signal"
    assert "calibration shard(s) (kept): continue with: setgrpo-verl " in (run / "calibration" / "FAILED").read_text()
    before = {p.name: p.read_bytes() for p in shards.glob("batch_*.npz")}
    assert list(before) == ["batch_000000.npz"]

    release.touch()

    resumed = _cli("calibrate", *common, "--resume")
    assert resumed.returncode == 0, tail(resumed)
    assert {p.name: p.read_bytes() for p in shards.glob("batch_*.npz") if p.name in before} == before
    assert sorted(p.name for p in shards.glob("batch_*.npz")) == [f"batch_{b:06d}.npz" for b in range(3)]
    log = (run / "calibration" / "main_ppo.log").read_text()
    assert f"{len(before)} with a shard already, {3 - len(before)} to calibrate" in log
    paired = np.load(run / "calibration" / "paired_scores.npz")
    with np.load(shards / "batch_000000.npz") as first:
        rows = first["point"].shape[0]
        np.testing.assert_array_equal(paired["point"][:rows], first["point"])
        np.testing.assert_array_equal(paired["gram"][:rows], first["gram"])
    record = CalibrationRecord.from_json(run / "calibration" / "record.json")
    ids = [p["question_sha256"] for p in record.calibration_prompts]
    assert len(ids) == 6 and len(set(ids)) == 6
    merged = _cli("merge-calibration", str(run / "calibration"), "--out", str(tmp_path / "merged"))
    assert merged.returncode == 0, tail(merged)
    assert (tmp_path / "merged" / "record.json").read_bytes() == (run / "calibration" / "record.json").read_bytes()
