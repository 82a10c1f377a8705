"""Run one child command in a session of its own and stop all of it on SIGINT / SIGTERM (docs/cli.md#stopping-a-run).

verl's ``main_ppo`` starts a local Ray instance (GCS server, raylet, dashboard agents, one worker process per actor)
and makes itself a process-group leader, so a signal sent to the command line's own process group never reaches
it. :class:`Supervisor` therefore starts the child with ``start_new_session=True`` and keeps its session id: every
process the child and Ray start stays in that session (Ray moves processes into process groups of their own, never
into new sessions), which is how the supervisor finds them without matching process names.

Stopping goes in three rounds: SIGTERM to the child only, which lets Ray's own SIGTERM handler in the driver exit
and shut down the Ray instance it started (``ray.shutdown``); after ``grace`` seconds SIGTERM to every process left
in the session; ``kill_after`` seconds later SIGKILL to whatever still runs. A second signal skips to the last round.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

__all__ = ["STOP_SIGNALS", "Supervisor", "machine_memory", "ray_loss", "resume_command", "session_members",
           "session_rss"]

#: Signals that stop a supervised child and everything it started.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def session_members(sid: int) -> list[int]:
    """Process ids of the live (not zombie) processes in session ``sid``, from ``/proc/<pid>/stat`` (Linux).

    Returns:
        Sorted pids; empty when ``/proc`` is not available.
    """
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:  # the process ended meanwhile
            continue
        # "pid (comm) state ppid pgrp session ...": comm may contain spaces and parentheses, so split after the last ")"
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 3 and fields[0] != b"Z" and int(fields[3]) == sid:
            pids.append(int(entry))
    return sorted(pids)


def session_rss(pids: Sequence[int]) -> int:
    """Resident memory of the processes ``pids`` together, in bytes (``/proc/<pid>/statm``; pages shared between
    them counted in each, so an upper bound); 0 where ``/proc`` is not available."""
    total, page = 0, os.sysconf("SC_PAGE_SIZE")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", "rb") as fh:
                total += int(fh.read().split()[1]) * page
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
    return total


def machine_memory() -> int:
    """The machine's physical memory in bytes (``SC_PHYS_PAGES``), 0 when unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


#: What Ray prints when it lost an actor, a worker or its raylet (Ray 2.x): the driver's exception or log line.
_RAY_LOSS = re.compile(r"ActorUnavailableError|ActorDiedError|RayActorError|WorkerCrashedError|NodeDiedError|"
                       r"Raylet is terminated|ray\.exceptions\.OutOfMemoryError|The actor died unexpectedly|"
                       r"raylet died|Task was killed due to the node running low on memory")


def ray_loss(lines: Sequence[str], peak: int, total: int) -> str | None:
    """What most likely happened when ``main_ppo``'s output (``lines``) says Ray lost an actor, a worker or its
    raylet (:data:`_RAY_LOSS`), or None when it does not: the machine ran out of memory (Ray's memory monitor or the
    kernel's out-of-memory killer end the largest process, and an actor or raylet lost that way shows as these
    errors), with the run's peak resident memory ``peak`` and the machine's ``total`` (bytes, 0 when unknown)."""
    hit = next((m.group(0) for line in reversed(lines) if (m := _RAY_LOSS.search(line))), None)
    if hit is None:
        return None
    gib = 2 ** 30
    sizes = (f" (this run's processes peaked at {peak / gib:.1f} GiB resident"
             + (f" of the machine's {total / gib:.1f} GiB" if total else "") + ")") if peak else (
        f" (the machine has {total / gib:.1f} GiB)" if total else "")
    return (f"Ray lost a process of this run ({hit}): most likely the machine ran out of memory{sizes} and Ray's "
            "memory monitor or the kernel's out-of-memory killer ended it (`dmesg` or the raylet's log under the Ray "
            "session directory says which); stop other jobs on the machine, or lower the run's memory use (a "
            "smaller --profile, fewer --actor-ranks or a shorter --max-response-length) before continuing")


def resume_command(argv: Sequence[str] | None) -> str | None:
    """The exact command that continues the run of command line ``argv`` (``setgrpo-verl ...``): the same flags,
    ``--resume`` added where missing and ``--overwrite`` (which would delete what was kept) left out; None without
    ``argv``."""
    if not argv:
        return None
    words = [w for w in argv if w != "--overwrite"]
    if "--resume" not in words:
        words.append("--resume")
    return shlex.join(words)


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Supervisor:
    """One child process in its own session, its output lines handed to a callback, stopped as a whole on a signal.

    Args:
        command: argument list of the child.
        env: its environment.
        on_line: called with every output line (stdout and stderr merged, text) from a reader thread.
        cwd: working directory of the child (default: the current one).
        grace: seconds the child gets to stop itself (and its Ray instance) after the first SIGTERM.
        kill_after: seconds between SIGTERM and SIGKILL to the processes left in the session.
    """

    def __init__(self, command: Sequence[str], *, env: Mapping[str, str], on_line: Callable[[str], None],
                 cwd: Optional[str] = None, grace: float = 30.0, kill_after: float = 5.0):
        self.command = list(command)
        self.env = dict(env)
        self.on_line = on_line
        self.cwd = cwd
        self.grace = grace
        self.kill_after = kill_after
        #: the first stop signal received (``signal.Signals``), or None
        self.stopped_by: Optional[signal.Signals] = None
        #: why :meth:`stop` stopped the child (when no signal came first), or None
        self.stop_reason: Optional[str] = None
        self._stop_at: Optional[float] = None
        self._escalated = 0
        self._proc: Optional[subprocess.Popen] = None
        #: the largest resident memory of the child's session seen while it ran (bytes, :func:`session_rss`)
        self.peak_rss = 0
        self._sampled = 0.0

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum, frame) -> None:
        proc = self._proc
        if self.stopped_by is None and self.stop_reason is None:
            self.stopped_by = signal.Signals(signum)
            self._stop_at = time.monotonic()
            if proc is not None and proc.poll() is None:
                _signal_all([proc.pid], signal.SIGTERM)
        else:  # a second signal: no more waiting
            self._stop_at = -float("inf")
            self._escalated = 1

    def stop(self, reason: str) -> None:
        """Stop the child and its session as a stop signal would (the same three rounds), recording ``reason``.

        Safe to call from the ``on_line`` callback (the reader thread) while :meth:`run` waits; a call after a
        stop signal or an earlier :meth:`stop`, or before the child started, does nothing.
        """
        proc = self._proc
        if self.stopped_by is not None or self.stop_reason is not None or proc is None:
            return
        self.stop_reason = reason
        self._stop_at = time.monotonic()
        if proc.poll() is None:
            _signal_all([proc.pid], signal.SIGTERM)

    def _escalate(self) -> None:
        """SIGTERM, then SIGKILL, to what is left of the session once the child had ``grace`` seconds."""
        assert self._proc is not None and self._stop_at is not None
        waited = time.monotonic() - self._stop_at
        if self._escalated == 0 and waited >= self.grace:
            _signal_all(session_members(self._proc.pid), signal.SIGTERM)
            self._escalated, self._stop_at = 1, time.monotonic() - self.grace
        elif self._escalated == 1 and waited >= self.grace + self.kill_after:
            _signal_all(session_members(self._proc.pid), signal.SIGKILL)
            self._escalated = 2

    def reap_session(self) -> list[int]:
        """Stop whatever the finished child left in its session: SIGTERM, then SIGKILL after ``kill_after`` s.

        Returns:
            The pids that were still running when the child had exited (empty after a clean shutdown).
        """
        assert self._proc is not None
        left = session_members(self._proc.pid)
        if left:
            _signal_all(left, signal.SIGTERM)
            deadline = time.monotonic() + self.kill_after
            while session_members(self._proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            _signal_all(session_members(self._proc.pid), signal.SIGKILL)
            deadline = time.monotonic() + self.kill_after
            while session_members(self._proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        return left

    # ------------------------------------------------------------------ run
    def run(self, poll: Optional[Callable[[], None]] = None, poll_every: float = 0.5) -> int:
        """Start the child, wait for it, then stop what it left behind; returns its exit status.

        SIGINT, SIGTERM and SIGHUP of this process are handled while the child runs (when called from the main
        thread) and restored afterwards; :attr:`stopped_by` tells whether one came. ``poll`` is called every
        ``poll_every`` seconds from this thread (e.g. to follow a metrics file).

        Raises:
            OSError: the command cannot be started.
        """
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            self._proc = subprocess.Popen(self.command, env=self.env, cwd=self.cwd, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                                          start_new_session=True)
            if self.stopped_by is not None:  # a signal came while the child was being started
                _signal_all([self._proc.pid], signal.SIGTERM)
            reader = threading.Thread(target=self._read, name="setgrpo-child-output", daemon=True)
            reader.start()
            while True:
                try:
                    status = self._proc.wait(timeout=poll_every)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if self._stop_at is not None:
                    self._escalate()
                if time.monotonic() - self._sampled >= 2.0:
                    self._sampled = time.monotonic()
                    self.peak_rss = max(self.peak_rss, session_rss(session_members(self._proc.pid)))
                if poll is not None:
                    poll()
            self.reap_session()
            reader.join(timeout=10.0)
            if poll is not None:
                poll()
            return status
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for text in self._proc.stdout:
            self.on_line(text)
