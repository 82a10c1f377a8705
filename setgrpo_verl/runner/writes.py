"""A command's writes that fail for want of room or of permission (docs/cli.md#run-directory): one ``error:`` line
naming the path, what was being written and the fix, instead of a library's traceback, and no partial file left.

A full disk (``ENOSPC``), a full quota (``EDQUOT``), a read-only file system (``EROFS``) and a directory this user
may not write (``EACCES``, ``EPERM``) are the file-system errors a user can fix; any other ``OSError`` is a defect
and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional, Sequence

from ..rundir import LaunchError

__all__ = ["USER_FIXABLE", "free_bytes", "write_error", "writable", "writing"]

_NO_ROOM = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}
#: errno values of a write that the user can fix (room, quota, permission).
USER_FIXABLE = frozenset(_NO_ROOM | _NOT_WRITABLE)


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent."""
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike) -> Optional[int]:
    """Free bytes for this user on the file system of ``path`` (or of its nearest existing parent); None when it
    cannot be read."""
    try:
        return shutil.disk_usage(_existing(Path(path))).free
    except OSError:
        return None


def writable(path: str | os.PathLike) -> bool:
    """Whether this user can create files in the directory ``path`` (False on a read-only mount)."""
    return os.access(_existing(Path(path)), os.W_OK)


def write_error(exc: OSError, path: str | os.PathLike | None, what: str) -> str:
    """The message of a write that failed with a :data:`USER_FIXABLE` error: the path (the error's own file when it
    names one), what was being written, why, and the fix (free space / another directory / permissions).

    Args:
        exc: the ``OSError`` (``exc.errno`` in :data:`USER_FIXABLE`).
        path: where the command was writing (None: the error's file).
        what: what was being written, for people (``"the data split"``).
    """
    target = exc.filename or path or "a file"
    reason = exc.strerror or os.strerror(exc.errno or 0)
    if exc.errno in _NO_ROOM:
        free = free_bytes(target if exc.filename else path or ".")
        room = f", {free / 2**20:.1f} MiB free there" if free is not None else ""
        return (f"cannot write {what} to {target}: {reason} (errno {errno.errorcode.get(exc.errno, exc.errno)}{room}); "
                "free space (or raise the quota) on that file system, or use a run "
                "directory on another one, and run the command again")
    return (f"cannot write {what} to {target}: {reason}: the directory is not writable for this user (a read-only "
            "mount or another owner); run the command on a writable copy, or write elsewhere (report --out DIR, "
            "compare --analysis-only --out DIR)")


@contextlib.contextmanager
def writing(path: str | os.PathLike, what: str, *, remove: Sequence[str | os.PathLike] = ()) -> Iterator[None]:
    """Turn a :data:`USER_FIXABLE` ``OSError`` raised inside the block into a :class:`LaunchError`
    (:func:`write_error`), after removing ``remove`` (the block's partial files or directories, best effort).

    Args:
        path: where the block writes (named when the error names no file).
        what: what it writes, for people.
        remove: files or directories the block may leave half-written.

    Raises:
        LaunchError: the block's write failed for want of room or permission.
    """
    try:
        yield
    except OSError as exc:
        if exc.errno not in USER_FIXABLE:
            raise
        for partial in map(Path, remove):
            if partial.is_dir() and not partial.is_symlink():
                shutil.rmtree(partial, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    partial.unlink()
        removed = "; its partial files were removed" if remove else ""
        raise LaunchError(write_error(exc, path, what) + removed) from None
