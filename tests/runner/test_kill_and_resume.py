"""A ``compare`` run directory survives a kill at any point followed by ``--resume`` with the same flags: nothing
kept is lost, nothing kept runs again, and the analysis equals that of an uninterrupted run (docs/cli.md#compare).

``main_ppo`` is a stand-in that follows verl 0.9.1's ``fit`` loop (``trainer/ppo/v1/trainer_base.py`` 412-520) where
the run directory sees it: the file logger opens the metrics file with ``open(path, "wb")``; a validation before
training when ``trainer.val_before_train``; then per step: the step, the checkpoint (its folder first, the tracker
``latest_checkpointed_iteration.txt`` last), the validation, and the step's metrics row last. Like the package's
trainers it keeps the rows up to its checkpoint across the truncating logger
(:func:`~setgrpo_verl.integration.resume.keep_history`). At the phase named by ``KILL_AT`` it stops and waits, and the
test SIGKILLs the command line and everything it started (the out-of-memory killer, a host losing power), then
resumes. No Ray, no model: seconds per phase.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from setgrpo_verl.rundir import COMPLETE
from setgrpo_verl.runner.supervise import session_members

_STANDIN = textwrap.dedent("""
    import json, os, sys, time, types
    import setgrpo_verl
    # the package's resume bookkeeping without importing its verl integration (seconds of imports per start)
    package = types.ModuleType('setgrpo_verl.integration')
    package.__path__ = [os.path.join(os.path.dirname(setgrpo_verl.__file__), 'integration')]
    sys.modules['setgrpo_verl.integration'] = package
    from setgrpo_verl.integration.resume import keep_history, restore_history
    o = dict(a.lstrip('+').split('=', 1) for a in sys.argv[1:] if '=' in a)
    root = o['trainer.default_local_dir']
    tracker = os.path.join(root, 'latest_checkpointed_iteration.txt')
    start = int(open(tracker).read()) if os.path.exists(tracker) else 0
    total, every = int(o['trainer.total_training_steps']), int(o['trainer.test_freq'])
    path = os.environ['VERL_FILE_LOGGER_PATH']
    trace = open(os.environ['TRACE_FILE'], 'a')
    def phase(name):  # the test kills everything while this phase runs
        if name == os.environ.get('KILL_AT'):
            open(os.environ['PHASE_FILE'], 'w').write(name)
            time.sleep(600)
    def done(name):
        trace.write(name + '\\n'); trace.flush()
    rows = keep_history(path, start) if start else []
    fp = open(path, 'wb')  # verl's FileLogger
    phase(f'open{start}')
    key = 'val-aux/rubrichub/truth_score/mean@1'
    def log(step, data):
        fp.write(json.dumps({'step': step, 'data': data}).encode() + b'\\n'); fp.flush()
    def validate(step):
        phase(f'validate{step}'); done(f'validate{step}')
        return {key: 0.5 + 0.02 * step - 0.001 * int(o['data.seed'])}
    if o['trainer.val_before_train'] == 'true':
        restore_history(fp, path, rows); rows = []
        log(start, validate(start))
    restore_history(fp, path, rows)
    for step in range(start + 1, total + 1):
        phase(f'step{step}'); done(f'step{step}')
        due = step % every == 0 or step == total
        if due:
            os.makedirs(os.path.join(root, f'global_step_{step}'), exist_ok=True)
            phase(f'checkpoint{step}')
            with open(tracker + '.tmp', 'w') as fh:
                fh.write(str(step))
            os.replace(tracker + '.tmp', tracker); done(f'checkpoint{step}')
        data = {'timing_s/step': 30.0, 'setgrpo/grading/calls_per_step': 32.0}
        if due:
            data.update(validate(step)); data['timing_s/testing'] = 5.0
        log(step, data)
""")

# the command line with main_ppo replaced by the stand-in; under KILL_AT=analysis it stops in the analysis, after
# outcome/ was prepared and before it is written
_CLI = textwrap.dedent("""
    import os, sys, time
    from setgrpo_verl.runner import cli, launch
    from setgrpo_verl.report import outcome
    standin = open(os.environ['STANDIN_FILE']).read()
    launch.main_ppo_command = lambda overrides, config_name='setgrpo_trainer': [
        sys.executable, '-c', standin, 'verl.trainer.main_ppo', '--config-name', config_name, *overrides]
    if os.environ.get('KILL_AT') == 'analysis':
        def write_outcome(out, *args, **kwargs):
            (out / 'outcome.txt').write_text('half written')
            open(os.environ['PHASE_FILE'], 'w').write('analysis')
            time.sleep(600)
        outcome.write_outcome = write_outcome
    sys.exit(cli.main(sys.argv[1:]))
""")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat", "rb").read()
            except OSError:
                continue
            if int(stat[stat.rfind(b")") + 2:].split()[1]) == pid:
                out.append(int(entry))
    return out


def _kill_everything(cli: subprocess.Popen) -> None:
    """SIGKILL the command line, the stand-in it started (a session of its own) and whatever those started."""
    pids = set(session_members(cli.pid))
    for child in _children(cli.pid):
        pids |= set(session_members(child)) | {child}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    cli.wait(timeout=30)


def _argv(run, resume: bool) -> list[str]:
    """``compare``: two arms, one seed, 3 steps validated and checkpointed at each."""
    return ["compare", "--run-dir", str(run), "--flip-prob", "0.06", "--arms", "grpo", "grpo_mean2", "--seeds", "0",
            "--steps", "3", "--val-every", "1", "--heldout-prompts", "6"] + (["--resume"] if resume else [])


def _env(run, tmp_path, kill_at: str = "") -> dict[str, str]:
    return {"STANDIN_FILE": str(tmp_path / "standin.py"), "TRACE_FILE": str(run.parent / "trace.txt"),
            "PHASE_FILE": str(tmp_path / "phase"), "KILL_AT": kill_at}


def _finish(run, tmp_path, monkeypatch, *, resume: bool, capsys) -> str:
    """Run ``compare`` to its end in this process (the command line's imports are done once)."""
    from setgrpo_verl.runner import cli, launch

    for key, value in _env(run, tmp_path).items():
        monkeypatch.setenv(key, value)
    standin = _STANDIN
    monkeypatch.setattr(launch, "main_ppo_command", lambda overrides, config_name="setgrpo_trainer": [
        sys.executable, "-c", standin, "verl.trainer.main_ppo", "--config-name", config_name, *overrides])
    capsys.readouterr()
    assert cli.main(_argv(run, resume)) == 0
    return capsys.readouterr().out


def _compare(run, tmp_path, kill_at: str, *, resume: bool) -> str:
    """Run ``compare`` in a process of its own and kill all of it once phase ``kill_at`` runs; returns its output."""
    phase = tmp_path / "phase"
    phase.unlink(missing_ok=True)
    env = dict(os.environ, **_env(run, tmp_path, kill_at))
    cli = subprocess.Popen([sys.executable, "-c", _CLI, *_argv(run, resume)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not phase.exists():
        assert cli.poll() is None, f"compare ended before {kill_at}: {cli.stdout.read()}"
        assert time.monotonic() < deadline, f"{kill_at} never came"
        time.sleep(0.05)
    _kill_everything(cli)
    return cli.stdout.read()


def _trace(run):
    path = run.parent / "trace.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    return lines


def _outcome(run):
    result = json.loads((run / "outcome" / "outcome.json").read_text())
    lost = {r["arm"]: r.pop("lost_steps") for r in result["arms"]}
    return result, lost


@pytest.mark.slow  # eight runs of the command line (no Ray): about 2 minutes on 2 cores
def test_a_compare_run_directory_survives_a_kill_at_every_phase(tmp_path, monkeypatch, capsys):
    (tmp_path / "standin.py").write_text(_STANDIN)
    straight = tmp_path / "straight" / "run"
    straight.parent.mkdir()
    _finish(straight, tmp_path, monkeypatch, resume=False, capsys=capsys)
    want, _ = _outcome(straight)
    once = _trace(straight)
    assert sorted(once) == sorted(([f"{p}{s}" for p in ("step", "checkpoint", "validate") for s in (1, 2, 3)]
                                   + ["validate0"]) * 2)  # two arms, each phase once

    run = tmp_path / "killed" / "run"
    run.parent.mkdir()
    grpo = run / "compare" / "grpo_s0"
    rows = lambda: [json.loads(x)["step"] for x in (grpo / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    # (phase killed, what completed work the next start must redo: only what came after the last checkpoint)
    _compare(run, tmp_path, "validate0", resume=False)
    assert _trace(run) == [] and not (grpo / "checkpoints").exists()  # nothing was kept, nothing to keep
    _compare(run, tmp_path, "step2", resume=True)
    assert _trace(run) == ["validate0", "step1", "checkpoint1", "validate1"] and rows() == [0, 1]
    _compare(run, tmp_path, "checkpoint2", resume=True)
    assert _trace(run) == ["step2"]  # step 2 again: it had no checkpoint
    assert rows() == [0, 1] and (grpo / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "1"
    _compare(run, tmp_path, "validate2", resume=True)
    assert _trace(run) == ["step2", "checkpoint2"] and rows() == [0, 1]
    _compare(run, tmp_path, "open2", resume=True)  # killed after the file logger truncated the file
    assert _trace(run) == [] and rows() == [] and (grpo / "metrics.jsonl.kept").is_file()
    _compare(run, tmp_path, "analysis", resume=True)
    # grpo makes the validation step 2 owed before step 3 and finishes, then grpo_mean2 runs whole
    assert _trace(run) == ["validate2", "step3", "checkpoint3", "validate3", "validate0"] + [
        f"{p}{s}" for s in (1, 2, 3) for p in ("step", "checkpoint", "validate")]
    assert (grpo / COMPLETE).is_file() and not (run / "outcome" / COMPLETE).exists()
    assert not (grpo / "metrics.jsonl.kept").exists()
    out = _finish(run, tmp_path, monkeypatch, resume=True, capsys=capsys)
    assert _trace(run) == [] and "is complete, kept" in out  # only the analysis ran again
    got, lost = _outcome(run)
    assert got == want
    # verl logs a step's row after its validation: the row of step 2, killed during its validation, is the one thing
    # gone; the analysis counts the step as the run's median step and names it
    assert lost == {"grpo": {"0": [2]}, "grpo_mean2": {}}
    assert rows() == [0, 1, 2, 3]
