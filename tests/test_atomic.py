"""Whole-file writes (setgrpo_verl.atomic): a file the package writes whole is there old or new, never a part, and the
rename reaches the disk (the directory is flushed after it)."""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from pathlib import Path

import pytest

import setgrpo_verl
from setgrpo_verl import atomic
from setgrpo_verl.atomic import atomic_file, replace_durably, write_atomic

PKG = Path(setgrpo_verl.__file__).parent


def _trace(monkeypatch) -> list[tuple[str, str]]:
    """Record every fsync (of a file or a directory) and rename, in order."""
    events = []
    fsync, replace = os.fsync, os.replace

    def traced_fsync(fd):
        events.append(("fsync", "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"))
        fsync(fd)

    def traced_replace(src, dst):
        events.append(("replace", Path(dst).name))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", traced_fsync)
    monkeypatch.setattr(os, "replace", traced_replace)
    return events


def test_a_whole_file_write_is_flushed_renamed_and_its_directory_flushed(tmp_path, monkeypatch):
    events = _trace(monkeypatch)
    path = write_atomic(tmp_path / "record.json", "{}\n")
    assert path.read_text() == "{}\n"
    assert events == [("fsync", "file"), ("replace", "record.json"), ("fsync", "dir")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # as open(path, "w") makes it


def test_a_write_cut_off_leaves_the_old_file_and_no_temporary_file(tmp_path):
    path = write_atomic(tmp_path / "paired_scores.npz", b"old")
    with pytest.raises(RuntimeError, match="stopped"):
        with atomic_file(path) as fh:
            fh.write(b"half of the new")
            raise RuntimeError("stopped")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["paired_scores.npz"]


def test_a_rename_aside_flushes_the_directory(tmp_path, monkeypatch):
    (tmp_path / "batch_000001.npz").write_bytes(b"torn")
    events = _trace(monkeypatch)
    replace_durably(tmp_path / "batch_000001.npz", tmp_path / "batch_000001.npz.torn")
    assert events == [("replace", "batch_000001.npz.torn"), ("fsync", "dir")]
    assert (tmp_path / "batch_000001.npz.torn").read_bytes() == b"torn"


def _writers(tmp_path):
    """Each whole-file writer of the package and the file it writes."""
    from setgrpo_verl.core.shards import load_shards, record_from_shards, shard_name, write_calibration, write_shard
    from setgrpo_verl.grading import write_verl_parquet
    from setgrpo_verl.integration.resume import write_state
    from setgrpo_verl.rundir import mark_complete
    from setgrpo_verl.runner.datasplit import write_data

    from .core.test_shards import _shards

    shards = _shards()
    for s in shards:
        write_shard(tmp_path / "src", s)
    read, _ = load_shards(tmp_path / "src")
    record, paired = record_from_shards([(tmp_path / "src" / shard_name(b), s) for b, s in read.items()])
    rows = [{"prompt": [{"role": "user", "content": "q"}], "extra_info": {"id": "a"}}]
    split = {"calibration": rows, "train": rows, "source": "test", "settings": {}}
    return {
        "shard": (lambda: write_shard(tmp_path, dataclasses.replace(shards[0], created_at="later")),
                  tmp_path / shard_name(0)),
        "record": (lambda: record.to_json(tmp_path / "record.json"), tmp_path / "record.json"),
        "paired scores": (lambda: write_calibration(record, paired, tmp_path / "record.json"),
                          tmp_path / "paired_scores.npz"),
        "parquet": (lambda: write_verl_parquet(rows, tmp_path / "rows.parquet"), tmp_path / "rows.parquet"),
        "data split": (lambda: write_data(tmp_path, split), tmp_path / "data" / "calibration.parquet"),
        "marker": (lambda: mark_complete(tmp_path, 1.0), tmp_path / "COMPLETE"),
        "checkpoint state": (lambda: write_state(str(tmp_path), step=1, record_sha256="0", monitor=None,
                                                 group_log_bytes=None), tmp_path / "setgrpo_state.json"),
    }


@pytest.mark.parametrize("name", ["shard", "record", "paired scores", "parquet", "data split", "marker",
                                  "checkpoint state"])
def test_every_whole_file_writer_leaves_the_old_file_when_stopped_before_its_rename(tmp_path, monkeypatch, name):
    write, path = _writers(tmp_path)[name]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"the finished file of before")

    def stop(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", stop)
    with pytest.raises(OSError, match="No space left"):
        write()
    assert path.read_bytes() == b"the finished file of before"
    assert [p.name for p in path.parent.glob(".*.tmp")] == []


#: Whole-file writes outside setgrpo_verl.atomic: verl's streamed log of a stage (appended to on resume).
_STREAMED = {("runner/stages.py", 'open(log_path, "a" if append else "w"')}
_WRITES = re.compile(r"\.write_text\(|\.write_bytes\(|open\([^)]*[\"']w|np\.savez\w*\((?!fh)|json\.dump\((?!.*\bfh\b)"
                     r"|torch\.save\(|\.to_parquet\((?!fh)|savefig\((?!fh)|os\.(?:replace|rename)\(")


def test_every_whole_file_write_of_the_package_goes_through_the_atomic_write():
    found = set()
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG))
        if rel == "atomic.py":
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if _WRITES.search(line) and not line.lstrip().startswith("#"):
                found.add((rel, line.strip()))
    assert {(rel, line) for rel, line in found if not any(rel == f and s in line for f, s in _STREAMED)} == set()
