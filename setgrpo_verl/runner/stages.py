"""Run one verl ``main_ppo`` command as a stage of a run directory (docs/cli.md#run-directory): its directory,
``command.sh``, ``main_ppo.log``, ``metrics.jsonl`` and the ``COMPLETE`` / ``FAILED`` marker written last.

The process runs under :class:`setgrpo_verl.runner.supervise.Supervisor` (stopped with its Ray instance on a stop
signal) and is shown by :class:`setgrpo_verl.runner.console.StageConsole`.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from .lifecycle import RunPlan, calibration_shards, plan_run
from ..atomic import write_atomic
from ..rundir import FAILED, STAGES, LaunchError, latest_checkpoint_step, mark_complete

__all__ = ["run_stage", "stage_writes"]

#: The raylet's periodic report of workers that died without being asked to (Ray 2.x, printed on the driver as
#: ``(raylet) N Workers (tasks / actors) killed due to memory pressure (OOM), M Workers crashed due to other
#: reasons at node ...``). verl does not restart its workers, and a run that lost one can wait on it without end.
_WORKER_DEATHS = re.compile(r"(\d+) Workers \(tasks / actors\) killed due to memory pressure \(OOM\), "
                            r"(\d+) Workers crashed due to other reasons")


def stage_writes(stage: str) -> list[str]:
    """The run-directory parts a stage writes (:data:`setgrpo_verl.runner.lifecycle.DEPENDS` keys): its own directory
    and, for ``calibrate_train``, ``calibration/``."""
    return [STAGES[stage]] + (["calibration"] if stage == "calibrate_train" else [])


def run_stage(
    run_dir: str | os.PathLike,
    stage: str,
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    overwrite: bool = False,
    resume: bool = False,
    plan: RunPlan | None = None,
    verbose: bool = False,
    stop_grace: float = 30.0,
    directory: str | None = None,
    argv: Sequence[str] | None = None,
) -> Path:
    """Run one verl command as a stage of ``run_dir``; returns the stage directory (docs/cli.md#run-directory).

    Writes ``command.sh`` first (the exact command line, environment variables included), writes verl's output to
    ``main_ppo.log`` (and streams it when ``verbose``; else shows progress bars and one line per step, see
    :mod:`setgrpo_verl.runner.console`), points verl's file logger at ``metrics.jsonl``, and writes ``COMPLETE`` only
    when verl exits with status 0 (else ``FAILED`` with the exit status and the log's tail).

    ``main_ppo`` runs in a session of its own (:class:`setgrpo_verl.runner.supervise.Supervisor`): on SIGINT, SIGTERM or
    SIGHUP it and the local Ray instance it started are stopped (docs/cli.md#stopping-a-run), nothing of that
    session is left running, and ``FAILED`` says which signal stopped it and at which checkpoint to resume. When
    the raylet reports workers of the run killed for memory or crashed, the stage is stopped the same way rather
    than left waiting on them.

    What happens to the stage's directory is ``plan``'s decision (:func:`~setgrpo_verl.runner.lifecycle.plan_run`;
    without one, the plan of this stage alone under ``overwrite`` / ``resume``): a kept (``COMPLETE``) stage is not run
    again, a continued one resumes from its latest verl checkpoint (``trainer.resume_mode=auto``, verl's default), a
    created or replaced one starts from an empty directory; a continued ``calibration/`` (shards, no record)
    calibrates only the batches without a shard (docs/record.md#calibration-shards). ``argv``: the command line
    that runs the stage (``setgrpo-verl ...``), from which a failure's message gives the exact command that
    continues (:func:`~setgrpo_verl.runner.supervise.resume_command`). ``directory`` names the stage's
    part of ``plan`` (default the stage's own, :data:`~setgrpo_verl.rundir.STAGES`; ``compare`` runs each arm and seed
    as a ``grpo`` or ``train`` stage in ``compare/<arm>_s<seed>``). ``calibrate_train`` marks
    ``calibration/`` complete as soon as its record exists, however the process ends, so that a resumed run trains
    with that record.

    Raises:
        LaunchError: the plan refuses the stage's directory (the message names the flag), ``calibrate_train`` with
            a kept ``calibration/`` (train with its record instead), or verl exited with a
            non-zero status (the message quotes the last error line of the log; where Ray lost an actor or its
            raylet, it says what most likely happened, with the run's peak memory and the machine's), or Ray lost
            workers of the run (the message says how many, why, and where to resume); each names what was kept
            and the command that continues.
        SystemExit: with status 128 + the signal number, after a stop signal stopped the stage.
    """
    run_dir = Path(run_dir)
    directory = directory or STAGES[stage]
    if plan is None:
        plan = plan_run(run_dir, stage_writes(stage), overwrite=overwrite, resume=resume)
        plan.check()
    if plan.action(directory) == "keep":
        print(f"[setgrpo-verl] {stage}: {run_dir / directory} is complete, kept", flush=True)
        return run_dir / directory
    calibration = run_dir / STAGES["calibrate"]
    stage_dir, continued = _prepare_dirs(plan, stage, directory, calibration)
    resumed_from = latest_checkpoint_step(stage_dir) if continued else None
    env = _stage_env(env, stage_dir)
    metrics = Path(env["VERL_FILE_LOGGER_PATH"])
    log_path = _announce(stage, stage_dir, command, env, continued, resumed_from, verbose)
    try:
        child, status, elapsed, tail = _supervise(stage, command, env, metrics, log_path, append=continued,
                                                  verbose=verbose, grace=stop_grace)
    finally:
        if stage == "calibrate_train" and (calibration / "record.json").is_file():
            mark_complete(calibration, note=f"calibrated by {stage_dir.name}/")
    _check_exit(stage, stage_dir, calibration, child, status, elapsed, tail, log_path, verbose, argv)
    if stage == "calibrate_train" and not (calibration / "record.json").is_file():
        raise LaunchError(f"{stage}: verl exited normally but wrote no record to {calibration}/record.json")
    mark_complete(stage_dir, elapsed)
    print(f"[setgrpo-verl] {stage}: done in {elapsed:.0f} s", flush=True)
    return stage_dir


def _prepare_dirs(plan: RunPlan, stage: str, directory: str, calibration: Path) -> tuple[Path, bool]:
    """Carry out ``plan`` for the stage's directory (and, for ``calibrate_train``, ``calibration/``, refused when
    kept); returns the stage directory and whether the stage continues earlier work."""
    if stage == "calibrate_train":
        if plan.action("calibration") not in ("create", "replace", "continue"):
            raise LaunchError(f"{stage}: {calibration} is {plan['calibration'].state} and kept; run the train stage "
                              "with its record instead of calibrating again")
        plan.prepare("calibration")
    stage_dir = plan.prepare(directory)
    continued = plan.action(directory) == "continue" or (stage == "calibrate_train"
                                                             and plan.action("calibration") == "continue")
    return stage_dir, continued


def _stage_env(env: Mapping[str, str], stage_dir: Path) -> dict[str, str]:
    """``env`` with verl's file logger pointed at the stage's ``metrics.jsonl`` and verl's local trackers writing into
    the stage directory (tensorboard: ``TENSORBOARD_DIR``, else ``./tensorboard_log/...``; mlflow:
    ``MLFLOW_TRACKING_URI``, else ``/tmp/mlruns.db``; trackio: ``TRACKIO_DIR``, else the Hugging Face cache)."""
    env = dict(env)
    env["VERL_FILE_LOGGER_PATH"] = str((stage_dir / "metrics.jsonl").resolve())
    for key, where in (("TENSORBOARD_DIR", "tensorboard"), ("WANDB_DIR", ""), ("SWANLAB_LOG_DIR", "swanlog"),
                       ("TRACKIO_DIR", "trackio")):
        env.setdefault(key, str((stage_dir / where).resolve()))
    env.setdefault("MLFLOW_TRACKING_URI", "sqlite:///" + str((stage_dir / "mlruns.db").resolve()))
    return env


def _announce(stage: str, stage_dir: Path, command: Sequence[str], env: Mapping[str, str], continued: bool,
              resumed_from: int | None, verbose: bool) -> Path:
    """Write the stage's ``command.sh`` and print how it starts; returns the path of its ``main_ppo.log``."""
    shown_env = {k: env[k] for k in ("VERL_PLATFORM", "VERL_FILE_LOGGER_PATH") if k in env}
    line = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in shown_env.items()), *map(shlex.quote, command)])
    write_atomic(stage_dir / "command.sh", "#!/usr/bin/env bash\n" + line + "\n")
    log_path = stage_dir / "main_ppo.log"
    start = ("resuming after its checkpoint of step " + str(resumed_from) if resumed_from is not None
             else "continuing the calibration from its shards with" if continued else "starting")
    if verbose:
        print(f"[setgrpo-verl] {stage}: {line}", flush=True)
    print(f"[setgrpo-verl] {stage}: {start} verl's main_ppo (command: {stage_dir / 'command.sh'}, log: {log_path})",
          flush=True)
    return log_path


def _supervise(stage: str, command: Sequence[str], env: Mapping[str, str], metrics: Path, log_path: Path, *,
               append: bool, verbose: bool, grace: float) -> tuple:
    """Run ``command`` in a session of its own, its output in ``log_path`` and on the stage's console, stopped
    as on a stop signal when the raylet reports lost workers of the run.

    Returns:
        The :class:`~setgrpo_verl.runner.supervise.Supervisor`, the exit status, the seconds it ran and the last
        lines of its output.
    """
    from .console import StageConsole
    from .supervise import Supervisor

    t0 = time.perf_counter()
    with open(log_path, "a" if append else "w", encoding="utf-8") as log:
        console = StageConsole(stage, command, metrics, log, verbose=verbose)

        def on_line(text: str) -> None:
            console.line(text)
            died = _worker_deaths(text)
            if died:
                child.stop(died)

        child = Supervisor(command, env=env, on_line=on_line, grace=grace)
        try:
            status = child.run(poll=console.poll)
        finally:
            console.close()
    return child, status, time.perf_counter() - t0, console.tail


def _check_exit(stage: str, stage_dir: Path, calibration: Path, child, status: int, elapsed: float,
                tail: Sequence[str], log_path: Path, verbose: bool, argv: Sequence[str] | None = None) -> None:
    """Write ``FAILED`` and raise unless ``main_ppo`` exited with status 0 on its own: lost workers or a stop signal
    (saying where a rerun continues) or verl's own error (quoting the log's last error line; for a lost Ray actor
    or raylet, what most likely happened)."""
    from .supervise import machine_memory, ray_loss, resume_command

    step, shards = latest_checkpoint_step(stage_dir), calibration_shards(calibration)
    again = resume_command(argv)
    rerun = f"continue with: {again}" if again else "rerun with --resume"
    where = (f"its latest checkpoint is step {step} (kept): {rerun} to continue from there" if step is not None
             else f"it wrote {shards} calibration shard(s) (kept): {rerun} to calibrate only the batches without one"
             if shards and not (calibration / "record.json").is_file()
             else f"it saved no checkpoint: {rerun} (or --overwrite) to start it over")
    if child.stop_reason is not None:
        reason = (f"{child.stop_reason}; main_ppo and the Ray instance it started were stopped after {elapsed:.0f} s "
                  f"instead of waiting on the lost workers; {where}")
        write_atomic(stage_dir / FAILED, reason + "\n")
        raise LaunchError(f"{stage}: {reason} (full log: {log_path})")
    if child.stopped_by is not None:
        reason = (f"stopped by {child.stopped_by.name} after {elapsed:.0f} s; main_ppo and the Ray instance it started "
                  f"were stopped; {where}")
        write_atomic(stage_dir / FAILED, reason + "\n")
        print(f"[setgrpo-verl] {stage}: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(128 + int(child.stopped_by))
    if status != 0:
        lost = ray_loss([*_log_end(log_path), *tail], getattr(child, "peak_rss", 0), machine_memory())
        if lost is not None:
            reason = f"main_ppo exited with status {status} after {elapsed:.0f} s: {lost}; {where}"
            write_atomic(stage_dir / FAILED, reason + "\n")
            raise LaunchError(f"{stage}: {reason} (full log: {log_path})")
        reason = _last_error(tail)
        write_atomic(stage_dir / FAILED, f"main_ppo exited with status {status} after {elapsed:.0f} s: {reason}\n")
        if not verbose:  # the log was not shown: its end says what went wrong
            sys.stderr.write("".join(t + "\n" for t in tail[-15:]))
        raise LaunchError(f"{stage}: verl's main_ppo exited with status {status}: {reason} (full log: {log_path})")


def _log_end(path: Path, size: int = 256 * 1024) -> list[str]:
    """The lines of the last ``size`` bytes of the log at ``path`` ([] when it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - size))
            return fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def _worker_deaths(line: str) -> str | None:
    """What the raylet's report in ``line`` says of workers that died unasked (see ``_WORKER_DEATHS``), or None
    when the line is no such report or counts no death."""
    match = _WORKER_DEATHS.search(line)
    if match is None:
        return None
    oom, crashed = int(match.group(1)), int(match.group(2))
    if oom == 0 and crashed == 0:
        return None
    what = " and ".join(part for part in (
        f"{oom} killed by Ray's memory monitor (the node ran out of memory: stop other jobs on it or "
        "lower the run's memory use)" if oom else "",
        f"{crashed} crashed (the raylet's log under the Ray session directory says why)" if crashed else "",
    ) if part)
    return f"Ray reported worker processes of this run lost: {what}"


def _last_error(lines: Sequence[str]) -> str:
    for text in reversed(lines):
        stripped = text.strip()
        if stripped and ("Error" in stripped or "error" in stripped or "Exception" in stripped):
            return stripped[-1500:]
    return next((t.strip()[-1500:] for t in reversed(lines) if t.strip()), "no output")
