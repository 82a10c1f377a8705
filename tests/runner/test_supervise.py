"""Stopping a stage: a signal to the command line stops the child and everything it started, and nothing else.

The child here imitates ``main_ppo`` with its local Ray instance: it makes itself a process-group leader (as Ray's
driver does), starts grandchildren in process groups of their own (as Ray does for its processes), one of which
ignores SIGTERM, and prints a line when all are up. The real ``main_ppo`` run is in
``tests/verl_cpu/test_stop_and_resume.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from setgrpo_verl.runner.supervise import Supervisor, session_members

_CHILD = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    try:
        os.setpgrp()  # as Ray's driver does; EPERM when already a session leader
    except PermissionError:
        pass
    kids = []
    for ignore in (False, True):
        code = ("import os, signal, time\\n"
                + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" if ignore else "")
                + "time.sleep(600)")
        kids.append(subprocess.Popen([sys.executable, "-c", code], preexec_fn=os.setpgrp))
    time.sleep(0.5)
    print("UP", " ".join(str(k.pid) for k in kids), flush=True)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(15))  # Ray's driver handler: exit, but not its children
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_session_members_finds_this_session():
    assert os.getpid() in session_members(os.getsid(0))
    assert session_members(2**22 + 12345) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_command_line_stops_the_whole_child_session(tmp_path, sig):
    """A driver script runs the Supervisor in its main thread; the test signals the driver only."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import sys
        from setgrpo_verl.runner.supervise import Supervisor
        lines = []
        def on_line(text):
            print("child:", text, end="", flush=True)
        child = Supervisor([sys.executable, "-c", {_CHILD!r}], env=dict(__import__("os").environ), on_line=on_line,
                           grace=1.0, kill_after=1.0)
        status = child.run()
        print("STOPPED_BY", child.stopped_by.name if child.stopped_by else None, "STATUS", status, flush=True)
    """))
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("child: UP"), line
    kids = [int(p) for p in line.split()[2:]]
    assert all(_alive(k) for k in kids)
    sid = os.getsid(kids[0])
    assert sid != os.getsid(0) and sid != proc.pid  # the child's own session, not the driver's nor ours
    members = session_members(sid)
    assert set(kids) < set(members) and len(members) == 3
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert f"STOPPED_BY {sig.name}" in out
    assert proc.returncode == 0
    deadline = time.monotonic() + 5
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(k) for k in kids)  # the SIGTERM-ignoring one too (SIGKILL after the grace period)
    assert session_members(sid) == []


def test_a_child_that_exits_normally_leaves_nothing_behind():
    code = ("import os, subprocess, sys; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], preexec_fn=os.setpgrp); "
            "print(p.pid, flush=True)")
    lines = []
    child = Supervisor([sys.executable, "-c", code], env=dict(os.environ), on_line=lines.append, kill_after=2.0)
    assert child.run() == 0
    (pid,) = [int(x) for x in lines]
    assert child.stopped_by is None
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
