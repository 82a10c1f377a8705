"""Whole-file writes that are never seen half done (docs/cli.md#run-directory).

Every file the package writes whole (records, paired scores, calibration shards, the data split, markers, merge
outputs, reports) is written to a temporary file in its own directory, flushed to disk (``fsync``), renamed over its
name (``os.replace``, atomic on POSIX file systems) and then its directory is flushed, so that the rename itself
survives a crash. A reader sees the old file or the new one, never a part; a write cut off leaves a hidden
``.<name>.<random>.tmp`` behind and the old file untouched. Append-only logs are not written this way.

A leaf module: it imports nothing of the package.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path
from typing import IO, Iterator

__all__ = ["atomic_file", "fsync_dir", "replace_durably", "temp_name", "write_atomic"]


def temp_name(path: str | os.PathLike) -> Path:
    """A fresh temporary name next to ``path``: ``.<name>.<16 hex digits>.tmp`` in the same directory (so that the
    rename stays on one file system), hidden from globs such as ``batch_*.npz``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush ``directory``'s entries (a rename or a new file in it) to disk.

    Raises:
        OSError: the directory cannot be opened or flushed (a file system that cannot flush a directory,
            ``EINVAL``, is accepted: it gives no stronger guarantee to ask for).
    """
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", *, encoding: str | None = None) -> Iterator[IO]:
    """Open a temporary file next to ``path`` for writing; when the block ends without an exception it is flushed to
    disk and renamed to ``path`` (replacing it), and the directory is flushed. On an exception the temporary file is
    removed and ``path`` is left as it was. The parent directory must exist.

    Args:
        path: the file to write whole.
        mode: ``"wb"`` (bytes) or ``"w"`` (text).
        encoding: the text encoding (``"w"`` only; default UTF-8).

    Raises:
        ValueError: a mode other than ``"w"`` or ``"wb"``.
        OSError: the file system refused a step (the temporary file is removed).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file mode {mode!r}: only 'w' and 'wb' write a file whole")
    path = Path(path)
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open(path, "w")
    try:
        with os.fdopen(fd, mode, **({"encoding": encoding or "utf-8"} if mode == "w" else {})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) as the whole of ``path`` with :func:`atomic_file`; returns the path."""
    with atomic_file(path, "w" if isinstance(data, str) else "wb") as fh:
        fh.write(data)
    return Path(path)


def replace_durably(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename ``src`` to ``dst`` (``os.replace``) and flush the directories of both, so that the rename survives a
    crash.

    Raises:
        OSError: the rename or a flush failed.
    """
    os.replace(src, dst)
    for directory in {Path(dst).resolve().parent, Path(src).resolve().parent}:
        fsync_dir(directory)
