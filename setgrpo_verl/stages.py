"""Run one verl ``main_ppo`` command as a stage of a run directory (docs/cli.md#run-directory): its directory,
``command.sh``, ``main_ppo.log``, ``metrics.jsonl`` and the ``COMPLETE`` / ``FAILED`` marker written last.

The process runs under :class:`setgrpo_verl.supervise.Supervisor` (stopped with its Ray instance on a stop
signal) and is shown by :class:`setgrpo_verl.console.StageConsole`.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from .rundir import COMPLETE, FAILED, STAGES, LaunchError, latest_checkpoint_step

__all__ = ["check_stage_dirs", "run_stage"]

def check_stage_dirs(run_dir: str | os.PathLike, stages: Sequence[str], *, overwrite: bool, resume: bool = False) -> None:
    """Refuse, before anything is written, stage directories that already exist (``--overwrite`` replaces them;
    with ``--resume`` :func:`run_stage` keeps complete stages and continues interrupted ones).

    ``calibrate_train`` also writes ``calibration/``.

    Raises:
        LaunchError: the first existing stage directory, with the fix.
    """
    if overwrite or resume:
        return
    dirs = []
    for stage in stages:
        dirs += [STAGES[stage]] + ([STAGES["calibrate"]] if stage == "calibrate_train" else [])
    for name in dict.fromkeys(dirs):
        path = Path(run_dir) / name
        if path.exists():
            raise LaunchError(f"{path} already exists; {_existing_stage_hint(path)}")



def _existing_stage_hint(path: Path) -> str:
    """What to do about an existing stage directory: replace a complete one, resume or restart an interrupted one."""
    if (path / COMPLETE).exists():
        return "pass --overwrite to replace it or choose another --run-dir"
    step = latest_checkpoint_step(path)
    if step is not None:
        return (f"it was interrupted after its checkpoint of step {step}: pass --resume to continue from there, "
                "--overwrite to start it over, or choose another --run-dir")
    return "it is incomplete and has no checkpoint: pass --overwrite (or --resume) to start it over"


def _stage_dir(run_dir: Path, stage: str, *, overwrite: bool, resume: bool = False) -> Path:
    """The stage's directory, created empty; with ``resume`` an interrupted stage's directory is kept when it holds
    a verl checkpoint to resume from (else it is started over), its ``FAILED`` marker removed."""
    path = run_dir / STAGES[stage]
    if path.exists():
        step = latest_checkpoint_step(path)
        if resume and step is not None and not (path / COMPLETE).exists():
            (path / FAILED).unlink(missing_ok=True)
            return path
        if not overwrite and not resume:
            raise LaunchError(f"{path} already exists; {_existing_stage_hint(path)}")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def run_stage(
    run_dir: str | os.PathLike,
    stage: str,
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    overwrite: bool = False,
    resume: bool = False,
    verbose: bool = False,
    stop_grace: float = 30.0,
) -> Path:
    """Run one verl command as a stage of ``run_dir``; returns the stage directory (docs/cli.md#run-directory).

    Writes ``command.sh`` first (the exact command line, environment variables included), writes verl's output to
    ``main_ppo.log`` (and streams it when ``verbose``; else shows progress bars and one line per step, see
    :mod:`setgrpo_verl.console`), points verl's file logger at ``metrics.jsonl``, and writes ``COMPLETE`` only
    when verl exits with status 0 (else ``FAILED`` with the exit status and the log's tail).

    ``main_ppo`` runs in a session of its own (:class:`setgrpo_verl.supervise.Supervisor`): on SIGINT, SIGTERM or
    SIGHUP it and the local Ray instance it started are stopped (docs/cli.md#stopping-a-run), nothing of that
    session is left running, and ``FAILED`` says which signal stopped it and at which checkpoint to resume.

    With ``resume``, a ``COMPLETE`` stage is kept and not run again, and an interrupted one continues from its latest
    verl checkpoint (``trainer.resume_mode=auto``, verl's default); one without a checkpoint starts over.

    Raises:
        LaunchError: the stage directory exists without ``overwrite`` or ``resume``, or verl exited with a
            non-zero status (the message quotes the last error line of the log).
        SystemExit: with status 128 + the signal number, after a stop signal stopped the stage.
    """
    from .console import StageConsole
    from .supervise import Supervisor

    run_dir = Path(run_dir)
    if resume and (run_dir / STAGES[stage] / COMPLETE).is_file():
        print(f"[setgrpo-verl] {stage}: {run_dir / STAGES[stage]} is complete, kept", flush=True)
        return run_dir / STAGES[stage]
    stage_dir = _stage_dir(run_dir, stage, overwrite=overwrite, resume=resume)
    resumed_from = latest_checkpoint_step(stage_dir)
    calibration = run_dir / STAGES["calibrate"]
    if stage == "calibrate_train":  # its record goes to calibration/, marked complete once the record exists
        if resumed_from is None:
            calibration = _stage_dir(run_dir, "calibrate", overwrite=overwrite, resume=resume)
        elif not (calibration / "record.json").is_file():
            raise LaunchError(f"{stage_dir} has a checkpoint but {calibration}/record.json, the record it was trained "
                              "with, is missing: pass --overwrite to start over")
    env = dict(env)
    metrics = (stage_dir / "metrics.jsonl").resolve()
    env["VERL_FILE_LOGGER_PATH"] = str(metrics)
    # verl's trackers write where these say (tensorboard: TENSORBOARD_DIR, else ./tensorboard_log/...): in the stage
    for key, where in (("TENSORBOARD_DIR", "tensorboard"), ("WANDB_DIR", ""), ("SWANLAB_LOG_DIR", "swanlog")):
        env.setdefault(key, str((stage_dir / where).resolve()))
    shown_env = {k: env[k] for k in ("VERL_PLATFORM", "VERL_FILE_LOGGER_PATH") if k in env}
    line = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in shown_env.items()), *map(shlex.quote, command)])
    (stage_dir / "command.sh").write_text("#!/usr/bin/env bash\n" + line + "\n")
    log_path = stage_dir / "main_ppo.log"
    start = "resuming after its checkpoint of step " + str(resumed_from) if resumed_from is not None else "starting"
    if verbose:
        print(f"[setgrpo-verl] {stage}: {line}", flush=True)
    print(f"[setgrpo-verl] {stage}: {start} verl's main_ppo (command: {stage_dir / 'command.sh'}, log: {log_path})",
          flush=True)
    history: list[bytes] = []
    if resumed_from is not None:
        from .integration.resume import read_history

        history = read_history(str(metrics), resumed_from)
    t0 = time.perf_counter()
    with open(log_path, "a" if resumed_from is not None else "w", encoding="utf-8") as log:
        console = StageConsole(stage, command, metrics, log, verbose=verbose)
        child = Supervisor(command, env=env, on_line=console.line, grace=stop_grace)
        try:
            status = child.run(poll=console.poll)
        finally:
            console.close()
    elapsed = time.perf_counter() - t0
    _keep_history(metrics, history)
    if child.stopped_by is not None:
        step = latest_checkpoint_step(stage_dir)
        where = (f"its latest checkpoint is step {step}: rerun with --resume to continue from there" if step is not None
                 else "it saved no checkpoint: rerun (with --overwrite or --resume) to start it over")
        reason = (f"stopped by {child.stopped_by.name} after {elapsed:.0f} s; main_ppo and the Ray instance it started "
                  f"were stopped; {where}")
        (stage_dir / FAILED).write_text(reason + "\n")
        print(f"[setgrpo-verl] {stage}: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(128 + int(child.stopped_by))
    if status != 0:
        reason = _last_error(console.tail)
        (stage_dir / FAILED).write_text(f"main_ppo exited with status {status} after {elapsed:.0f} s: {reason}\n")
        if not verbose:  # the log was not shown: its end says what went wrong
            sys.stderr.write("".join(t + "\n" for t in console.tail[-15:]))
        raise LaunchError(f"{stage}: verl's main_ppo exited with status {status}: {reason} (full log: {log_path})")
    (stage_dir / COMPLETE).write_text(f"{elapsed:.1f} s\n")
    if stage == "calibrate_train":
        if not (calibration / "record.json").is_file():
            raise LaunchError(f"{stage}: verl exited normally but wrote no record to {calibration}/record.json")
        (calibration / COMPLETE).write_text(f"calibrated by {stage_dir.name}/\n")
    print(f"[setgrpo-verl] {stage}: done in {elapsed:.0f} s", flush=True)
    return stage_dir


def _keep_history(metrics: Path, history: Sequence[bytes]) -> None:
    """Put back the metric rows up to the resumed checkpoint's step that verl's file logger dropped when it opened
    the file again (the SetGRPO trainer puts them back itself; verl's stock trainer, the GRPO stage, does not)."""
    if not history:
        return
    current = metrics.read_bytes() if metrics.is_file() else b""
    present = set(current.splitlines(keepends=True))
    missing = [line for line in history if line not in present]
    if missing:
        metrics.write_bytes(b"".join(missing) + current)


def _last_error(lines: Sequence[str]) -> str:
    for text in reversed(lines):
        stripped = text.strip()
        if stripped and ("Error" in stripped or "error" in stripped or "Exception" in stripped):
            return stripped[-1500:]
    return next((t.strip()[-1500:] for t in reversed(lines) if t.strip()), "no output")
