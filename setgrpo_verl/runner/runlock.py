"""One command at a time per run directory (docs/cli.md#run-directory): ``<run-dir>/LOCK`` names its holder.

The lock is the operating system's (``fcntl.flock``, exclusive) on ``LOCK``, a file that is never deleted or
replaced: two commands cannot both hold it, and the lock of a command that dies goes with its process, so there is no
stale lock to take over. While it is held the file holds the holder's pid, host, command line and start time as
JSON; a clean release empties it, so a holder found in the file of a lock nobody holds ended without releasing it.

The lock covers the commands of one host. ``--shard I/N`` parts on several machines use a run directory each, and
``merge-calibration`` combines them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

from ..rundir import LaunchError

__all__ = ["LOCK_FILE", "holder", "run_dir_lock"]

#: The lock file inside a run directory.
LOCK_FILE = "LOCK"


def _read_info(fd: int) -> dict:
    """The holder written in the open lock file ``fd``: ``{}`` when it is empty or unreadable (being written)."""
    os.lseek(fd, 0, os.SEEK_SET)
    text = b""
    while chunk := os.read(fd, 65536):
        text += chunk
    try:
        info = json.loads(text.decode("utf-8"))
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _try_flock(fd: int, operation: int) -> bool:
    """Take ``operation`` (``LOCK_EX`` or ``LOCK_SH``) on ``fd`` without waiting; False when another holds it."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def holder(run_dir: str | os.PathLike) -> dict | None:
    """The holder ``{pid, host, command, started}`` of ``run_dir``'s lock, or None when nobody holds it.
    A holder that has not written the file yet reads as ``{}``."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if _try_flock(fd, fcntl.LOCK_SH):
            return None
        return _read_info(fd)
    finally:
        os.close(fd)  # closing releases a shared lock taken above


def _describe(info: dict) -> str:
    return (f"pid {info.get('pid')} on {info.get('host')}, `{info.get('command')}`, started "
            f"{info.get('started')}")


@contextlib.contextmanager
def run_dir_lock(run_dir: str | os.PathLike, command: Sequence[str] | None = None) -> Iterator[Path]:
    """Hold ``<run_dir>/LOCK`` while the block runs (the run directory and the file are created when absent).

    Args:
        run_dir: the run directory.
        command: the command line named in the lock (default ``sys.argv``).

    Raises:
        LaunchError: another process holds the lock (its pid, host, command and start time named).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _try_flock(fd, fcntl.LOCK_EX):
            old = _read_info(fd)
            raise LaunchError(f"{run_dir} is in use by another command ({_describe(old) if old else 'starting now'}): "
                              "one command at a time per run directory; wait for it to finish or stop it, then run "
                              "this one again")
        old = _read_info(fd)
        if old:
            print(f"[setgrpo-verl] {path}: the previous command ({_describe(old)}) ended without releasing the lock",
                  file=sys.stderr, flush=True)
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "command": " ".join(command if command is not None else ["setgrpo-verl", *sys.argv[1:]]),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode("utf-8"), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)  # released cleanly: the file names no holder
    finally:
        os.close(fd)  # closing the file releases the lock
