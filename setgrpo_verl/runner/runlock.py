"""One command at a time per run directory (docs/cli.md#run-directory): ``<run-dir>/LOCK`` names its holder.

The lock file is created exclusively (``O_CREAT | O_EXCL``) and holds the holder's pid, its process start time,
the host, the command line and the start time as JSON. A second command on the same run directory is refused
with the holder named. A lock whose process no longer runs (no such pid on this host, or a pid now used by a
process started later) is stale: it is replaced, and the replacement is said.
"""

from __future__ import annotations

import contextlib
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


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), None where
    unknown (no such process, or no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _alive(info: dict) -> bool:
    """Whether the process of a lock's ``info`` still runs: same host, the pid exists, and (where ``/proc`` tells)
    it is the same process, not a later one that reuses the pid."""
    if info.get("host") != socket.gethostname():
        return True  # another machine's process cannot be checked from here: assume it runs
    try:
        pid = int(info["pid"])
        os.kill(pid, 0)
    except (KeyError, TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    started = info.get("process_start")
    return started is None or _process_start(pid) in (None, started)


def holder(run_dir: str | os.PathLike) -> dict | None:
    """The lock's holder ``{pid, process_start, host, command, started}`` of ``run_dir``, or None when unlocked.
    An unreadable lock file reads as ``{}`` (a holder that died while writing it)."""
    try:
        text = (Path(run_dir) / LOCK_FILE).read_text()
    except FileNotFoundError:
        return None
    try:
        info = json.loads(text)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


#: How long an empty or unparsable lock file counts as one being written (seconds), not a stale one.
_WRITE_GRACE_S = 10.0


def _age_s(path: Path) -> float | None:
    """Seconds since ``path`` was last written, or None when it is gone."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None


def _describe(info: dict) -> str:
    return (f"pid {info.get('pid')} on {info.get('host')}, `{info.get('command')}`, started "
            f"{info.get('started')}")


@contextlib.contextmanager
def run_dir_lock(run_dir: str | os.PathLike, command: Sequence[str] | None = None) -> Iterator[Path]:
    """Hold ``<run_dir>/LOCK`` while the block runs (the run directory is created when absent).

    Args:
        run_dir: the run directory.
        command: the command line named in the lock (default ``sys.argv``).

    Raises:
        LaunchError: another live process holds the lock (its pid, host, command and start time named).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    info = {"pid": os.getpid(), "process_start": _process_start(os.getpid()), "host": socket.gethostname(),
            "command": " ".join(command if command is not None else ["setgrpo-verl", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            old = holder(run_dir)
            if old is None:
                continue  # released in between
            age = _age_s(path)
            if age is None:
                continue  # released in between
            if not old and age < _WRITE_GRACE_S:  # created, not yet written: another command is taking it
                raise LaunchError(f"{run_dir} is being locked by another command right now: one command at a time "
                                  f"per run directory; wait for it to finish, then run this one again")
            if old and _alive(old):
                raise LaunchError(f"{run_dir} is in use by another command ({_describe(old)}): one command at a time "
                                  f"per run directory; wait for it to finish or stop it, then run this one again")
            print(f"[setgrpo-verl] {path}: removing a stale lock ({_describe(old) if old else 'unreadable'}; that "
                  "process no longer runs)", file=sys.stderr, flush=True)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(info) + "\n")
        break
    else:
        raise LaunchError(f"{path}: could not take the run directory's lock; retry")
    try:
        yield path
    finally:
        if holder(run_dir) == info:
            path.unlink(missing_ok=True)
