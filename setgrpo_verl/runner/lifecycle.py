"""What a command does with each directory of a run directory, decided once, before anything is written
(docs/cli.md#run-directory).

A command touches some of the run directory's directories (:data:`DEPENDS`): it writes some (``data``,
``calibration``, a training stage, ``validation``, ``report``) and reads others. :func:`plan_run` looks at each
directory's state (:func:`dir_state`) and gives it one action:

* ``create``: absent, written from scratch;
* ``keep``: ``COMPLETE`` and kept as it is (``--resume``, or the data split this command would write anyway);
* ``continue``: interrupted after a verl checkpoint (for ``calibration``: after some of its shards), continued from
  it (``--resume``);
* ``replace``: deleted and written again (``--overwrite``; an interrupted one without a checkpoint under
  ``--resume``; the report, which is always rewritten from the stages);
* ``remove``: not written by this command but derived from a directory it replaces (its results would no longer
  match), deleted;
* ``refuse``: the command stops before anything is written, with the flag that would allow it.

One rule for every directory: it is finished when it holds ``COMPLETE`` (written last), and finished or
checkpointed work is only deleted when ``--overwrite`` is given. ``--overwrite`` replaces what the command writes
and removes everything derived from it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from ..rundir import COMPLETE, FAILED, LaunchError, latest_checkpoint_step

__all__ = ["ACTIONS", "DEPENDS", "STATES", "DirPlan", "RunPlan", "calibration_shards", "dir_state", "plan_run"]

#: What each directory of a run directory is made from (its inputs among the other directories).
DEPENDS: Mapping[str, tuple[str, ...]] = {
    "data": (),
    "calibration": ("data",),
    "train_setgrpo": ("data", "calibration"),
    "train_grpo": ("data",),
    "validation": ("calibration",),
    "report": ("calibration", "train_setgrpo", "train_grpo"),
}
#: States of a directory: absent, there without ``COMPLETE`` and without a checkpoint, interrupted after a verl
#: checkpoint, finished.
STATES = ("absent", "partial", "checkpointed", "complete")
#: Actions of :func:`plan_run`, in the order the plan prints them.
ACTIONS = ("create", "keep", "continue", "replace", "remove", "refuse")
#: Directories rewritten whenever a command writes them: derived from the stages in seconds.
_DERIVED = ("report", "outcome")


#: What a finished ``data/`` holds (``split.json`` written last).
_DATA_FILES = ("calibration.parquet", "train.parquet", "split.json")


def dir_state(path: str | os.PathLike) -> str:
    """The state of one directory (one of :data:`STATES`): ``complete`` when it holds ``COMPLETE``, ``checkpointed``
    when it holds a verl checkpoint (:func:`setgrpo_verl.rundir.latest_checkpoint_step`) but no ``COMPLETE``,
    ``partial`` when it exists with neither, ``absent`` otherwise; a ``calibration/`` holding shards
    (:func:`calibration_shards`) but no record is ``checkpointed`` too, with or without ``COMPLETE`` (a finished
    part of a sharded calibration). A ``data/`` holding both parquet files and
    ``split.json`` (written last) is complete without the marker, as run directories of earlier versions are, and
    so is a ``calibration/`` holding ``record.json`` (written after the paired scores)."""
    path = Path(path)
    if not path.exists():
        return "absent"
    if (path / COMPLETE).is_file():
        if path.name == "calibration" and not (path / "record.json").is_file() and calibration_shards(path):
            # a finished part of a sharded calibration: its shards are work to keep, the record is still to build
            return "checkpointed"
        return "complete"
    if path.name == "data" and all((path / f).is_file() for f in _DATA_FILES):
        # a data split written before data/ had its own marker: split.json is written after both parquet files
        return "complete"
    if path.name == "calibration" and (path / "record.json").is_file():
        # the trainer writes the record after the paired scores: a record means a finished calibration, even when
        # main_ppo failed after writing it
        return "complete"
    if latest_checkpoint_step(path) is not None or calibration_shards(path):
        return "checkpointed"
    return "partial"


def calibration_shards(path: str | os.PathLike) -> int:
    """How many calibration shards (``shards/batch_*.npz``, one per calibrated batch) a ``calibration/`` holds."""
    path = Path(path)
    return len(list((path / "shards").glob("batch_*.npz"))) if path.name == "calibration" else 0


def _checkpoint_text(path: Path) -> str:
    """Where an interrupted directory stopped: its calibration shards or its verl checkpoint's step."""
    shards = calibration_shards(path)
    if shards:
        return f"after {shards} calibration shard(s)"
    return f"after its checkpoint of step {latest_checkpoint_step(path)}"


@dataclass(frozen=True)
class DirPlan:
    """One directory's decision: ``name`` (a key of :data:`DEPENDS`), its ``state``, its ``action`` and why."""

    name: str
    state: str
    action: str
    reason: str


@dataclass(frozen=True)
class RunPlan:
    """The decisions of one command on a run directory (:func:`plan_run`), in :data:`DEPENDS` order."""

    run_dir: Path
    dirs: tuple[DirPlan, ...]

    def __getitem__(self, name: str) -> DirPlan:
        for d in self.dirs:
            if d.name == name:
                return d
        raise KeyError(name)

    def __contains__(self, name: str) -> bool:
        return any(d.name == name for d in self.dirs)

    def action(self, name: str) -> str | None:
        """The action of ``name``, None when this command does not touch it."""
        return self[name].action if name in self else None

    def text(self) -> str:
        """The plan as printed by ``--dry-run``: one line per directory."""
        return "\n".join(f"[setgrpo-verl] plan: {self.run_dir / d.name}/ ({d.state}): {d.action}, {d.reason}"
                         for d in self.dirs)

    def check(self) -> None:
        """Raise the refusals, if any.

        Raises:
            LaunchError: naming each refused directory, why and the flag that would allow the command.
        """
        refused = [f"{self.run_dir / d.name} {d.reason}" for d in self.dirs if d.action == "refuse"]
        if refused:
            raise LaunchError("; ".join(refused))

    def prepare(self, name: str) -> Path:
        """Carry out ``name``'s action on disk and return its path: ``replace`` / ``remove`` delete the directory
        (``replace`` then creates it empty), ``create`` creates it, ``continue`` removes its ``FAILED`` marker,
        ``keep`` leaves it.

        Raises:
            LaunchError: the plan refuses ``name``.
        """
        d = self[name]
        path = self.run_dir / name
        if d.action == "refuse":
            raise LaunchError(f"{path} {d.reason}")
        if d.action in ("replace", "remove") and path.exists():
            shutil.rmtree(path)
        if d.action in ("replace", "create"):
            path.mkdir(parents=True, exist_ok=True)
        if d.action == "continue":
            (path / FAILED).unlink(missing_ok=True)
        return path

    def remove_derived(self) -> None:
        """Delete the directories planned ``remove`` (derived from something this command replaces)."""
        for d in self.dirs:
            if d.action == "remove":
                self.prepare(d.name)


def _hint(state: str, path: Path) -> str:
    if state == "complete":
        return "is complete: pass --resume to keep it, --overwrite to replace it, or choose another --run-dir"
    if state == "checkpointed":
        return (f"was interrupted {_checkpoint_text(path)}: pass --resume to continue from there, "
                "--overwrite to start it over, or choose another --run-dir")
    return ("is incomplete and has no checkpoint: pass --overwrite (or --resume) to start it over, or choose another "
            "--run-dir")


def plan_run(
    run_dir: str | os.PathLike,
    writes: Sequence[str],
    *,
    reads: Iterable[str] = (),
    overwrite: bool = False,
    resume: bool = False,
    same_data: bool | None = None,
    depends: Mapping[str, tuple[str, ...]] = DEPENDS,
) -> RunPlan:
    """Decide, for every directory a command touches, one action (see the module text); nothing is written.

    Args:
        run_dir: the run directory.
        writes: the directories the command writes (keys of :data:`DEPENDS`).
        reads: directories it only reads; each must be ``complete`` (else refused) and is kept.
        overwrite: ``--overwrite``: replace every written directory and remove what is derived from them.
        resume: ``--resume``: keep complete directories, continue checkpointed ones, start partial ones over.
        same_data: for a written ``data``: whether the existing split holds exactly the prompts this command would
            write (None when unknown, e.g. no split there). A complete identical split is kept, a different one is
            refused without ``overwrite``.

    Returns:
        :class:`RunPlan` over ``writes``, ``reads`` and every existing directory derived from a replaced one.

    Raises:
        LaunchError: both ``overwrite`` and ``resume``, or an unknown directory name.
    """
    if overwrite and resume:
        raise LaunchError("--resume keeps the run directory's finished work and --overwrite deletes it: pass one")
    run_dir = Path(run_dir)
    unknown = [n for n in (*writes, *reads) if n not in depends]
    if unknown:
        raise LaunchError(f"unknown run directory part(s) {unknown}; choose from {sorted(depends)}")
    decided: dict[str, DirPlan] = {}
    fresh: set[str] = set()  # written from nothing this time: everything derived from them is stale

    for name in depends:  # inputs before what is made from them
        path = run_dir / name
        state = dir_state(path)
        stale = [u for u in depends[name] if u in fresh]
        if name in reads and name not in writes:
            decided[name] = _read_plan(name, state)
        elif name not in writes:
            if stale and state != "absent":
                decided[name] = _derived_plan(name, state, stale, overwrite=overwrite)
                fresh.add(name)
        else:
            action, reason = _written_action(name, state, path, stale, decided, overwrite=overwrite, resume=resume,
                                             same_data=same_data)
            decided[name] = DirPlan(name, state, action, reason)
            if action in ("create", "replace"):
                fresh.add(name)
    return RunPlan(run_dir, tuple(decided[n] for n in depends if n in decided))


def _read_plan(name: str, state: str) -> DirPlan:
    """A directory the command only reads: kept when complete, else refused."""
    if state != "complete":
        return DirPlan(name, state, "refuse", f"is incomplete (no {COMPLETE} marker; {state}) and this command needs "
                                              "it finished: rerun the command that writes it with --resume (or "
                                              "--overwrite)")
    return DirPlan(name, state, "keep", "read by this command")


def _derived_plan(name: str, state: str, stale: Sequence[str], *, overwrite: bool) -> DirPlan:
    """An existing directory the command does not write but made from ``stale`` ones it replaces: removed, or
    refused when it is finished work and ``--overwrite`` is not given."""
    if overwrite or state == "partial" or name in _DERIVED:
        return DirPlan(name, state, "remove", f"derived from the replaced {', '.join(stale)}/")
    return DirPlan(name, state, "refuse", f"is {state} and derived from {', '.join(stale)}/, which this command "
                                          "writes again: pass --overwrite to remove it with them, or choose "
                                          "another --run-dir")


def _written_action(name: str, state: str, path: Path, stale: Sequence[str], decided: Mapping[str, DirPlan], *,
                    overwrite: bool, resume: bool, same_data: bool | None) -> tuple[str, str]:
    """The action and reason for a directory the command writes (``decided``: the plans of its inputs so far);
    the first matching rule wins, so the rules' order is part of the decision."""
    if state == "absent":
        return "create", "written by this command"
    if name in _DERIVED:
        return "replace", "rewritten from the stages"
    if overwrite:
        return "replace", "--overwrite"
    if (resume and name == "calibration" and state == "checkpointed" and calibration_shards(path)
            and all(decided[u].state == "absent" for u in stale)):
        # shards copied into a fresh run directory: the split is made again, and each shard's identity (the
        # calibration prompt set) is checked against it before any rollout
        return "continue", f"continued {_checkpoint_text(path)} (checked against the new data split)"
    if stale and state in ("complete", "checkpointed"):
        return "refuse", (f"is {state} but made from {', '.join(stale)}/, which this command writes again: pass "
                          "--overwrite to replace both, or choose another --run-dir")
    if stale:
        return "replace", f"made from the rewritten {', '.join(stale)}/"
    if name == "data" and state == "complete" and same_data:
        return "keep", "already holds this split"
    if name == "data" and state == "complete" and same_data is False:
        return "refuse", ("already holds another data split: pass --overwrite to replace the run, or choose another "
                          "--run-dir")
    if resume and state == "complete":
        return "keep", "complete, kept (--resume)"
    if resume and state == "checkpointed":
        return "continue", f"continued {_checkpoint_text(path)}"
    if resume:
        return "replace", "incomplete without a checkpoint, started over (--resume)"
    return "refuse", _hint(state, path)
