"""Stopping and resuming real ``main_ppo`` runs of the command line (tiny random Llama, function grader).

What must hold: SIGTERM to ``setgrpo-verl`` once its ``main_ppo`` has started the local Ray instance stops
``main_ppo`` and every process of that Ray instance, and ``FAILED`` says why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from setgrpo_verl.supervise import session_members

pytestmark = pytest.mark.slow

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
        raylet = _wait_for(lambda: [p for p in session_members(main_ppo) if "raylet" in _cmdline(p)], 60, "raylet")
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
