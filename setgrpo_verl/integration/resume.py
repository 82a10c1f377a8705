"""SetGRPO's part of a verl checkpoint, and the checks and file repairs of a resumed run (docs/cli.md#resuming-a-run).

verl 0.9.1 saves the actor, optimizer and dataloader state in ``<trainer.default_local_dir>/global_step_<N>/``
and, with ``trainer.resume_mode=auto`` (its default), resumes from the latest one. The SetGRPO trainer adds
``setgrpo_state.json`` to that folder, written before verl marks the checkpoint as the latest:

* ``record_sha256``: the content hash of the calibration record the checkpointed policy was trained with;
* ``monitor``: the online coverage / reversal monitor's counts (docs/algorithm.md#6-diagnostics);
* ``group_log_bytes``: the size of ``algorithm.setgrpo.group_log`` after step N's groups.

On resume, :func:`check_resume` (called by ``check_run_config`` before Ray starts) refuses another record, the
monitor continues from its counts and the group log is cut back to step N (steps after N are trained again).

Every trainer of this package (the SetGRPO trainer and the GRPO stage's) keeps the rows of verl's metrics file up to
step N across a resume itself: verl's file logger truncates the file when it opens it, so the rows are first copied
to ``<metrics file>.kept`` (:func:`keep_history`, atomically) and written back once the logger is open
(:func:`restore_history`), which then removes the copy. A resume that dies in between finds the copy on its next
start, so no row up to step N is lost however the process ends.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from ..atomic import write_atomic

__all__ = [
    "STATE_FILE",
    "check_resume",
    "check_state",
    "keep_history",
    "kept_rows",
    "metrics_file",
    "read_history",
    "read_state",
    "record_out_path",
    "record_sha256",
    "restore_history",
    "resume_folder",
    "write_state",
]

#: The suffix of the copy of a metrics file's rows that a resume keeps while verl's file logger reopens the file.
KEPT_SUFFIX = ".kept"
#: SetGRPO's file in a verl checkpoint folder.
STATE_FILE = "setgrpo_state.json"
_STATE_VERSION = 1


def record_out_path(config: Any, setgrpo: Any) -> str:
    """Where the calibration phase of this run writes (and a resumed run reads) its record: ``record_out`` or
    ``<trainer.default_local_dir>/setgrpo_calibration.json``."""
    if setgrpo.record_out:
        return os.path.expanduser(setgrpo.record_out)
    return os.path.join(config.trainer.default_local_dir, "setgrpo_calibration.json")


def record_sha256(path: str) -> str:
    """The content hash (``content_sha256``, hex) of the calibration record at ``path``.

    Raises:
        ValueError: the record does not load (see ``CalibrationRecord.from_json``).
    """
    from setgrpo_verl.core import CalibrationRecord
    from setgrpo_verl.core.record import content_sha256

    return content_sha256(CalibrationRecord.from_json(path))


def resume_folder(config: Any) -> Optional[str]:
    """The checkpoint folder verl's ``_load_checkpoint`` will resume from, or None for a fresh start.

    The same choice as verl 0.9.1 ``PPOTrainer._load_checkpoint`` (``trainer_base.py``) (``trainer.resume_mode`` ``disable`` /
    ``auto`` / ``resume_path``; relative paths against the working directory), with verl's own
    ``find_latest_ckpt_path``.
    """
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path, get_checkpoint_tracker_filename

    mode = config.trainer.get("resume_mode", "auto")
    if mode == "auto":
        folder = os.path.abspath(config.trainer.default_local_dir)
        if not os.path.exists(get_checkpoint_tracker_filename(folder)):
            return None  # a fresh start (asked first: find_latest_ckpt_path prints a line when there is no tracker)
        return find_latest_ckpt_path(folder)
    if mode == "resume_path" and isinstance(config.trainer.get("resume_from_path"), str):
        return os.path.abspath(config.trainer.resume_from_path)
    return None


def read_state(folder: str) -> Optional[dict[str, Any]]:
    """SetGRPO's state of checkpoint ``folder``, or None when the folder has none.

    Raises:
        ValueError: the file is not valid JSON or of another version.
    """
    path = os.path.join(folder, STATE_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            state = json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if state.get("version") != _STATE_VERSION:
        raise ValueError(f"{path} has version {state.get('version')!r}, this package reads {_STATE_VERSION}")
    return state


def write_state(folder: str, *, step: int, record_sha256: str, monitor: Optional[dict[str, Any]],
                group_log_bytes: Optional[int]) -> str:
    """Write SetGRPO's state of step ``step`` into checkpoint ``folder`` (atomically); returns the file's path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE)
    state = {"version": _STATE_VERSION, "step": int(step), "record_sha256": record_sha256, "monitor": monitor,
             "group_log_bytes": group_log_bytes}
    write_atomic(path, json.dumps(state, indent=2) + "\n")
    return path


def check_resume(config: Any, setgrpo: Any) -> None:
    """Refuse, before Ray starts, to resume a checkpoint with another calibration record than it was trained with.

    The record of the run is ``algorithm.setgrpo.record_path`` or, when that is null, the record the run's own
    calibration phase wrote (:func:`record_out_path`). Nothing is checked on a fresh start.

    Raises:
        ValueError: see :func:`check_state`.
    """
    folder = resume_folder(config)
    if folder is None:
        return
    record = os.path.expanduser(setgrpo.record_path) if setgrpo.record_path else record_out_path(config, setgrpo)
    if not os.path.isfile(record):
        return  # the trainer's start-of-training check names the missing record
    check_state(folder, read_state(folder), record, record_sha256(record), setgrpo.resume_other_record)


def check_state(folder: str, state: Optional[dict[str, Any]], record: str, sha256: str, allow_other: bool) -> bool:
    """Whether checkpoint ``folder``'s SetGRPO state may be restored for a run with record ``record`` (hash
    ``sha256``): True when it was trained with that record, False when ``allow_other``
    (``algorithm.setgrpo.resume_other_record``) lets the run resume with another one or with none known.

    Raises:
        ValueError: another record (naming both hashes and the override) or no SetGRPO state in the checkpoint,
            without ``allow_other``.
    """
    override = "pass algorithm.setgrpo.resume_other_record=true to resume anyway, or trainer.resume_mode=disable"
    if state is None:
        if allow_other:
            return False
        raise ValueError(f"checkpoint {folder} has no {STATE_FILE} (not written by the SetGRPO trainer), so the "
                         f"calibration record it was trained with is unknown; {override}")
    if state["record_sha256"] == sha256:
        return True
    if allow_other:
        return False
    raise ValueError(
        f"resuming checkpoint {folder} (trained with calibration record sha256 {state['record_sha256']}) with "
        f"record {record} (sha256 {sha256}): the policy was trained under the other record; pass the original "
        f"record as algorithm.setgrpo.record_path, or {override}")


def metrics_file(config: Any) -> Optional[str]:
    """The file verl's file logger writes (verl 0.9.1 ``FileLogger``: ``VERL_FILE_LOGGER_PATH``, else
    ``<VERL_FILE_LOGGER_ROOT or .>/<project_name>/<experiment_name>.jsonl``), or None without the file logger."""
    loggers = config.trainer.get("logger", [])
    if isinstance(loggers, str):
        loggers = [loggers]
    if "file" not in list(loggers):
        return None
    path = os.getenv("VERL_FILE_LOGGER_PATH")
    if path is None:
        root = os.path.expanduser(os.getenv("VERL_FILE_LOGGER_ROOT", "."))
        path = os.path.join(root, config.trainer.project_name, f"{config.trainer.experiment_name}.jsonl")
    return os.path.abspath(path)


def read_history(path: Optional[str], upto: int) -> list[bytes]:
    """The lines of a verl metrics file (``{"step": n, "data": {...}}``) with ``step <= upto``, in order.

    Lines that are not complete JSON objects (a write cut short by the interruption) are dropped.
    """
    if path is None or not os.path.isfile(path):
        return []
    kept = []
    with open(path, "rb") as fh:
        for line in fh:
            try:
                step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                continue
            if isinstance(step, int) and step <= upto:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
    return kept


def keep_history(path: Optional[str], upto: int) -> list[bytes]:
    """Before verl's file logger opens (and truncates) the metrics file ``path`` on a resume from the checkpoint of
    step ``upto``: the rows with ``step <= upto`` of the file and of the copy ``<path>.kept`` that an earlier resume
    left when it died before writing them back (each row once, ordered by step), written to ``<path>.kept``
    atomically; returns them ([] and nothing written without a file logger or without rows).

    Raises:
        OSError: the copy cannot be written (the file logger would truncate the only copy, so the run must not
            start).
    """
    rows = kept_rows(path, upto)
    if rows:
        write_atomic(path + KEPT_SUFFIX, b"".join(rows))
    return rows


def kept_rows(path: Optional[str], upto: int) -> list[bytes]:
    """What a run wrote to the metrics file ``path`` up to step ``upto``: the rows (:func:`read_history`) of the file
    and of its copy ``<path>.kept`` (:func:`keep_history`), each once, ordered by step (a step's rows in the order
    they were written)."""
    if path is None:
        return []
    seen: set[bytes] = set()
    rows = []
    for line in read_history(path + KEPT_SUFFIX, upto) + read_history(path, upto):
        if line not in seen:
            seen.add(line)
            rows.append(line)
    rows.sort(key=lambda line: json.loads(line)["step"])  # stable: a step's rows keep their order
    return rows


def restore_history(fp: Any, path: Optional[str], rows: list[bytes]) -> None:
    """Write the rows :func:`keep_history` kept into the open metrics file ``fp`` (verl's ``FileLogger.fp``, binary,
    just opened), make them durable, then remove the copy ``<path>.kept``."""
    if not rows:
        return
    fp.write(b"".join(rows))
    fp.flush()
    os.fsync(fp.fileno())
    if path is not None:
        try:
            os.unlink(path + KEPT_SUFFIX)
        except FileNotFoundError:
            pass
