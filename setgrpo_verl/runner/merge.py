"""``setgrpo-verl merge-calibration``: one record from the shard directories of the parts of a sharded calibration
(docs/record.md#calibration-shards).

Every part (``algorithm.setgrpo.calibration.shard=I/N``, or ``calibrate --shard I/N``) writes the shards of its
batches; this builds the record from all of them with :func:`setgrpo_verl.core.shards.record_from_shards`, which refuses
shards of different runs or settings, two shards of one batch (or one prompt twice) and missing batches. The record
is the one a single run over all batches writes from the same shards, byte for byte.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from ..core import CalibrationRecord, CalibrationSettings
from ..core.shards import (
    load_shards,
    pilot_source,
    record_from_shards,
    SHARD_DIR,
    shard_name,
    TornShardError,
    write_calibration,
)
from ..rundir import LaunchError
from .runlock import run_dir_lock

__all__ = ["OUTPUTS", "check_out", "merge_calibration", "shard_dirs"]


def shard_dirs(dirs: Sequence[str | os.PathLike]) -> list[Path]:
    """The shard directory of each argument: a calibration directory's ``shards/``, or a shard directory itself.

    Raises:
        LaunchError: an argument that holds no shards.
    """
    out = []
    for d in dirs:
        d = Path(d)
        found = d / SHARD_DIR if (d / SHARD_DIR).is_dir() else d
        if not found.is_dir() or not any(found.glob("batch_*.npz")):
            raise LaunchError(f"{d}: no calibration shards (batch_*.npz) in it or in its {SHARD_DIR}/")
        out.append(found)
    return out


#: What a merge writes into ``--out``.
OUTPUTS = ("record.json", "paired_scores.npz")


def check_out(out: str | os.PathLike) -> Path:
    """``--out`` as the directory a merge writes :data:`OUTPUTS` into; returns it as a Path.

    Raises:
        LaunchError: ``out`` names a file (an existing file, or a name ending in ``.json`` or ``.npz`` such as
            ``X/record.json``: give ``X``), or it holds a record or paired scores already (a merge never
            overwrites a calibration's files).
    """
    out = Path(out)
    if out.suffix in (".json", ".npz"):
        raise LaunchError(f"--out {out} names a file, but --out is the directory the merge writes record.json and "
                          f"paired_scores.npz into: give --out {out.parent}")
    if out.exists() and not out.is_dir():
        raise LaunchError(f"--out {out} is an existing file, not a directory: --out is the directory the merge writes "
                          "record.json and paired_scores.npz into; choose a new directory")
    for name in OUTPUTS:
        if (out / name).exists():
            alone = ("" if name == "record.json" or (out / "record.json").exists() else
                     " (without record.json: a calibration or merge that stopped before its record; delete it to "
                     "merge into this directory)")
            raise LaunchError(f"{out / name} exists{alone}: a merge writes a new record and its paired scores, and "
                              "never overwrites a calibration's files; choose another --out")
    return out


def merge_calibration(dirs: Sequence[str | os.PathLike], out: str | os.PathLike, *,
                      pilot: str | os.PathLike | None = None) -> CalibrationRecord:
    """Build the record of a sharded calibration from its parts' shard directories and write ``<out>/record.json``
    and ``<out>/paired_scores.npz`` (the paired scores first, as the trainer writes them), holding ``out``'s lock
    (:func:`setgrpo_verl.runner.runlock.run_dir_lock`) while it writes.

    Args:
        dirs: the parts' calibration directories (or their ``shards/``).
        out: the directory of the record (created; an existing ``record.json`` or ``paired_scores.npz`` there is
            never overwritten).
        pilot: a pilot record calibrated on other prompts: the fixed sequence's ``tau_start`` must be its
            ``tau_sel`` (:func:`setgrpo_verl.core.record.pilot_start`), and the record names it as the start's source.

    Returns:
        The record written.

    Raises:
        LaunchError: ``out`` that :func:`check_out` refuses or that cannot be created, another command holding its
            lock, no shards, a torn shard (rerun its part with ``--resume``), a shard the file system could not
            read (file and error named), shards of different runs or settings (file and field named), overlapping
            or missing batches, shards of different setgrpo-verl or verl versions, or a pilot that does not give
            this calibration's ``tau_start``.
    """
    out = check_out(out)
    sources = []
    try:
        for d in shard_dirs(dirs):
            shards, _ = load_shards(d)
            sources += [(d / shard_name(index), shard) for index, shard in shards.items()]
        source = None
        if pilot is not None:
            prompts = [p for _, s in sorted(sources, key=lambda x: x[1].index) for p in s.prompts]
            settings = CalibrationSettings.from_dict(sources[0][1].identity["settings"])
            source = pilot_source(CalibrationRecord.from_json(pilot), settings, prompts,
                                  name=f"the pilot record {pilot}")
        record, paired = record_from_shards(sources, tau_start_source=source)
    except TornShardError as exc:
        raise LaunchError(f"{exc}; rerun that part with --resume to calibrate its batch again") from None
    except (OSError, ValueError) as exc:
        raise LaunchError(str(exc)) from None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"--out {out}: the directory cannot be created ({exc.strerror}: {exc.filename}); choose "
                          "another --out") from None
    # a run's calibration/ is guarded by its run directory's lock, which calibrate and train take: taking it here
    # keeps a merge and a calibrate --overwrite of that run from writing or deleting calibration/ at once
    guarded = out.parent if out.name == "calibration" or (out.parent / "LOCK").is_file() else out
    with run_dir_lock(guarded):
        check_out(out)  # again under the lock: another merge into out may have finished meanwhile
        write_calibration(record, paired, out / "record.json")
    return record
