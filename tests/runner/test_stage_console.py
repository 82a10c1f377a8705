"""A stage's console and its resume bookkeeping, with a stand-in for ``main_ppo`` (no verl, no Ray).

The stand-in behaves like verl's ``main_ppo`` where the command line sees it: it prints many lines (a repeated
warning, as verl's TransferQueue threads do), the SetGRPO trainer's calibration progress line, and opens verl's
file logger with ``open(path, "wb")`` (truncating it) to write one ``{"step", "data"}`` row per step, starting after
the step in ``checkpoints/latest_checkpointed_iteration.txt`` as verl's ``trainer.resume_mode=auto`` does.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest

from setgrpo_verl.runner import launch

_FAKE = textwrap.dedent("""
    import json, os, sys, time
    stage = os.path.dirname(os.environ["VERL_FILE_LOGGER_PATH"])
    tracker = os.path.join(stage, "checkpoints", "latest_checkpointed_iteration.txt")
    start = int(open(tracker).read()) if os.path.exists(tracker) else 0
    total = int(next(a.split("=")[1] for a in sys.argv if a.startswith("trainer.total_training_steps=")))
    for i in range(50):
        print("WARNING transfer_queue: thread is not the main thread", flush=True)
    for g in (2, 4):
        print(f"WARNING:setgrpo: SetGRPO calibration: {g} groups so far", flush=True)
    # the package's trainers keep the rows up to the checkpoint across verl's truncating file logger
    from setgrpo_verl.integration.resume import keep_history, restore_history
    path = os.environ["VERL_FILE_LOGGER_PATH"]
    rows = keep_history(path, start) if start else []
    fp = open(path, "wb", buffering=0)
    restore_history(fp, path, rows)
    for step in range(start + 1, total + 1):
        time.sleep(0.6)
        row = {"step": step, "data": {"critic/score/mean": step / 10, "timing_s/step": 0.6, "actor/pg_loss": 0.01}}
        fp.write(json.dumps(row).encode() + b"\\n")
        print(f"step:{step} - critic/score/mean:{step / 10}", flush=True)
    sys.exit(int(os.environ.get("FAKE_STATUS", "0")))
""")


def _command(steps: int = 3) -> list[str]:
    return [sys.executable, "-c", _FAKE, f"trainer.total_training_steps={steps}",
            "algorithm.setgrpo.calibration.num_prompts=4"]


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_default_console_shows_progress_and_step_lines_and_logs_everything(tmp_path, capsys):
    stage = launch.run_stage(tmp_path, "train", _command(), env=dict(os.environ))
    out = capsys.readouterr()
    assert "transfer_queue" not in out.out + out.err  # verl's lines go to main_ppo.log only
    log = (stage / "main_ppo.log").read_text()
    assert log.count("thread is not the main thread") == 50 and "step:3" in log
    steps = [line for line in out.out.splitlines() if " step " in line]
    assert steps == [f"[setgrpo-verl] train step {s}/3: score {s / 10:.3f}, pg_loss +0.0100, step_s 1"
                     for s in (1, 2, 3)]
    assert "train: training steps" in out.err and "3/3" in out.err  # the tqdm bar, with its total
    assert "train: calibration groups" in out.err and "4/4" in out.err
    assert len(out.out.splitlines()) <= 6


def test_verbose_streams_verls_output_unchanged(tmp_path, capsys):
    launch.run_stage(tmp_path, "grpo", _command(2), env=dict(os.environ), verbose=True)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines.count("WARNING transfer_queue: thread is not the main thread") == 50
    assert "step:2 - critic/score/mean:0.2" in lines
    assert "training steps" not in out


def test_a_failed_stage_prints_the_end_of_its_log(tmp_path, capsys):
    with pytest.raises(launch.LaunchError, match="exited with status 3"):
        launch.run_stage(tmp_path, "grpo", _command(1), env=dict(os.environ, FAKE_STATUS="3"))
    assert "step:1" in capsys.readouterr().err
    assert "status 3" in (tmp_path / "train_grpo" / launch.FAILED).read_text()


def test_resume_keeps_the_stage_and_its_metrics_history(tmp_path, capsys):
    stage = tmp_path / "train_grpo"
    (stage / "checkpoints").mkdir(parents=True)
    (stage / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    old = [{"step": s, "data": {"critic/score/mean": -s, "timing_s/step": 1.0}} for s in (1, 2, 3)]
    (stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    (stage / "main_ppo.log").write_text("the first run's log\n")
    (stage / launch.FAILED).write_text("stopped by SIGTERM\n")
    with pytest.raises(launch.LaunchError, match="checkpoint of step 2: pass --resume"):
        launch.run_stage(tmp_path, "grpo", _command(4), env=dict(os.environ))
    launch.run_stage(tmp_path, "grpo", _command(4), env=dict(os.environ), resume=True)
    assert (stage / launch.COMPLETE).is_file() and not (stage / launch.FAILED).exists()
    rows = _rows(stage / "metrics.jsonl")
    # steps 1-2 from before the checkpoint, 3-4 trained after it (the interrupted step 3's row is gone)
    assert [(r["step"], r["data"]["critic/score/mean"]) for r in rows] == [(1, -1), (2, -2), (3, 0.3), (4, 0.4)]
    assert (stage / "main_ppo.log").read_text().startswith("the first run's log\n")
    assert "resuming after its checkpoint of step 2" in capsys.readouterr().out
    # a complete stage is kept as it is
    launch.run_stage(tmp_path, "grpo", ["false"], env=dict(os.environ), resume=True)
    assert "is complete, kept" in capsys.readouterr().out
    assert len(_rows(stage / "metrics.jsonl")) == 4


def test_resume_of_a_stage_without_checkpoint_starts_it_over(tmp_path):
    stage = tmp_path / "train_grpo"
    stage.mkdir()
    (stage / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {"timing_s/step": 1.0}}) + "\n")
    with pytest.raises(launch.LaunchError, match="no checkpoint: pass --overwrite"):
        launch.run_stage(tmp_path, "grpo", _command(1), env=dict(os.environ))
    launch.run_stage(tmp_path, "grpo", _command(1), env=dict(os.environ), resume=True)
    assert [r["step"] for r in _rows(stage / "metrics.jsonl")] == [1]


_RAYLET = ("(raylet) [2026-12-02 18:37:10,118 E 4121 4121] (raylet) node_manager.cc:3093: {oom} Workers (tasks / actors) "
           "killed due to memory pressure (OOM), {crashed} Workers crashed due to other reasons at node (ID: 5e1f, IP: "
           "10.0.0.2) over the last time period. To see more information about the Workers killed on this node, use "
           "`ray logs raylet.out -ip 10.0.0.2`")

# a driver whose worker was lost: a grandchild in a process group of its own (a Ray worker), the raylet's report,
# then waiting without end, as verl's agent loop did on a rollout worker that Ray had killed
_HUNG = textwrap.dedent("""
    import os, subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=os.setpgrp)
    open(os.environ["WORKER_PID_FILE"], "w").write(str(worker.pid))
    print("pending: 0, running: 16, finished: 0", flush=True)
    print(os.environ["RAYLET_LINE"], flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("oom, crashed, says", [
    (4, 0, "4 killed by Ray's memory monitor (the node ran out of memory"),
    (0, 1, "1 crashed (the raylet's log"),
])
def test_a_run_that_loses_a_ray_worker_is_stopped_not_left_waiting(tmp_path, oom, crashed, says):
    pid_file = tmp_path / "worker.pid"
    env = dict(os.environ, RAYLET_LINE=_RAYLET.format(oom=oom, crashed=crashed), WORKER_PID_FILE=str(pid_file))
    started = time.monotonic()
    with pytest.raises(launch.LaunchError) as failed:
        launch.run_stage(tmp_path, "grpo", [sys.executable, "-c", _HUNG], env=env, stop_grace=2.0)
    assert time.monotonic() - started < 60  # not the 600 s the driver would wait
    message = str(failed.value)
    assert says in message and "Ray reported worker processes of this run lost" in message
    assert "instead of waiting on the lost workers; it saved no checkpoint" in message
    failed_marker = (tmp_path / "train_grpo" / launch.FAILED).read_text()
    assert says in failed_marker and not (tmp_path / "train_grpo" / launch.COMPLETE).exists()
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{worker}") or open(f"/proc/{worker}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_raylet_report_of_no_lost_worker_does_not_stop_the_run(tmp_path):
    command = [sys.executable, "-c", f"print({_RAYLET.format(oom=0, crashed=0)!r}, flush=True)"]
    stage = launch.run_stage(tmp_path, "grpo", command, env=dict(os.environ))
    assert (stage / launch.COMPLETE).is_file()


def test_the_calibration_eta_of_a_resumed_stage_counts_only_the_groups_it_calibrates(tmp_path):
    import io

    from setgrpo_verl.runner.console import StageConsole

    clock = [1000.0]
    console = StageConsole("calibrate", ["algorithm.setgrpo.calibration.num_prompts=5446"], tmp_path / "m.jsonl",
                           io.StringIO(), out=io.StringIO())
    # 3,296 groups come from the kept shards; then one batch of 16 groups per 100 s
    console.line("WARNING:setgrpo: SetGRPO calibration: 3296 groups so far (batch_000205.npz written)\n")
    bar = console._groups_bar
    bar._time = lambda: clock[0]
    bar.start_t = bar.last_print_t = clock[0]
    for done in (3312, 3328, 3344):
        clock[0] += 100.0
        console.line(f"WARNING:setgrpo: SetGRPO calibration: {done} groups so far\n")
    meter = bar.format_dict
    assert meter["n"] == 3344 and meter["initial"] == 3296
    rate = meter["rate"] or (meter["n"] - meter["initial"]) / meter["elapsed"]
    assert rate == pytest.approx(0.16, rel=1e-6)  # groups per second: 48 groups in 300 s, not 3,344
    assert (5446 - 3344) / rate == pytest.approx(13137.5, rel=1e-6)  # the ETA in seconds, about 3.6 hours


def test_the_calibration_bar_opens_at_the_first_rollout_and_shows_the_batchs_phase(tmp_path):
    import io

    from setgrpo_verl.runner.console import StageConsole

    out = io.StringIO()
    console = StageConsole("calibrate", ["algorithm.setgrpo.calibration.num_prompts=128"], tmp_path / "m.jsonl",
                           io.StringIO(), out=out)
    console.line("WARNING:2026-12-05 17:50:34,005:SetGRPO calibration: 0 groups so far (batch 0: rollout)\n")
    bar = console._groups_bar
    assert bar is not None and bar.n == 0 and bar.total == 128 and "batch 0: rollout" in out.getvalue()
    console.line("WARNING:setgrpo: SetGRPO calibration: 0 groups so far (batch 0: sketch)\n")
    assert "batch 0: sketch" in out.getvalue() and bar.n == 0
    console.line("WARNING:setgrpo: SetGRPO calibration: 32 groups so far (batch_000000.npz written, 1 of 4 batches, "
                 "60 s, ETA 180 s)\n")
    assert bar.n == 32


def test_a_lost_ray_actor_is_named_with_memory_what_was_kept_and_the_command_that_continues(tmp_path):
    """verl exits with Ray's exception when Ray lost an actor or its raylet (most often the out-of-memory killer):
    the message says what most likely happened, with the run's peak memory and the machine's, what was kept and the
    exact command that continues."""
    stage = tmp_path / "train_grpo"
    (stage / "checkpoints").mkdir(parents=True)
    (stage / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    (stage / launch.FAILED).write_text("stopped by SIGTERM\n")
    lost = ("import time; time.sleep(1.5); print('ray.exceptions.ActorUnavailableError: The actor 5e1f is "
            "unavailable: The actor is temporarily unavailable: RpcError: RPC Error message: Socket closed', "
            "flush=True); raise SystemExit(1)")
    argv = ["setgrpo-verl", "compare", "--run-dir", str(tmp_path), "--flip-prob", "0.06", "--overwrite"]
    with pytest.raises(launch.LaunchError) as failed:
        launch.run_stage(tmp_path, "grpo", [sys.executable, "-c", lost], env=dict(os.environ), resume=True,
                         argv=argv)
    message = str(failed.value)
    assert "Ray lost a process of this run (ActorUnavailableError): most likely the machine ran out of memory " \
           "(this run's processes peaked at " in message and " GiB resident of the machine's " in message
    assert (f"its latest checkpoint is step 2 (kept): continue with: setgrpo-verl compare --run-dir {tmp_path} "
            "--flip-prob 0.06 --resume to continue from there") in message
    assert "Ray lost a process of this run" in (stage / launch.FAILED).read_text()
