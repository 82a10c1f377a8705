"""The layout of a run directory and its shared types (docs/cli.md#run-directory): the stage directories, the
markers a finished or failed stage holds, the error every launch step raises, and where verl keeps a stage's
checkpoints.

A leaf module: the data split, the stage runner, the pre-flight checks and the report all read these names.
"""

from __future__ import annotations

import os
from pathlib import Path

from .atomic import write_atomic

__all__ = ["COMPLETE", "FAILED", "STAGES", "LaunchError", "complete_seconds", "latest_checkpoint_step", "mark_complete"]

#: Marker written last into a finished stage directory; its absence means "incomplete".
COMPLETE = "COMPLETE"
#: Marker of a failed stage (holds the reason).
FAILED = "FAILED"
#: Stage directory of each stage. ``calibrate_train`` is one verl process that calibrates (record and paired scores
#: in ``calibration/``) and then trains, saving the start-up of a second process.
STAGES = {"calibrate": "calibration", "train": "train_setgrpo", "calibrate_train": "train_setgrpo",
          "grpo": "train_grpo"}


class LaunchError(ValueError):
    """Bad input found before verl starts (missing file, invalid rubric row, too few prompts, bad flag) or a stage
    that failed; the message names the fix. The CLI prints it as ``error: ...`` and exits with status 2."""



def latest_checkpoint_step(stage_dir: str | os.PathLike) -> int | None:
    """The step of the latest verl checkpoint in ``<stage_dir>/checkpoints`` (verl's
    ``latest_checkpointed_iteration.txt``), or None when the stage saved none."""
    tracker = Path(stage_dir) / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        return int(tracker.read_text().strip())
    except (OSError, ValueError):
        return None


def mark_complete(path: str | os.PathLike, seconds: float | None = None, note: str = "") -> None:
    """Write ``<path>/COMPLETE`` (last, once the directory's work is finished): ``<seconds> s`` or ``- s`` where
    the directory's own time is not known, then ``note``."""
    head = "-" if seconds is None else f"{seconds:.1f}"
    write_atomic(Path(path, COMPLETE), f"{head} s{' ' + note if note else ''}\n")


def complete_seconds(path: str | os.PathLike) -> float | None:
    """The seconds a finished directory's work took (:func:`mark_complete`), None where its ``COMPLETE`` does not
    say (absent, or written for a directory whose time is not its own)."""
    try:
        head = Path(path, COMPLETE).read_text().split()
    except OSError:
        return None
    try:
        return float(head[0]) if len(head) > 1 and head[1] == "s" else None
    except ValueError:
        return None
