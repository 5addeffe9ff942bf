"""Process ids as `inf2serve stop` waits on them: an exited process whose parent has not
reaped it (a zombie) has ended; our own are reaped; one that ignores SIGTERM is killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from archive_tools import pids


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_an_unreaped_exited_process_is_not_running() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while state(child.pid) != "Z":  # exited, not reaped: os.kill(pid, 0) still succeeds
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(child.pid, 0)
    assert not pids.running(child.pid)
    assert pids.wait_gone([child.pid], 5) == []
    assert not Path(f"/proc/{child.pid}").exists()  # and wait_gone reaped our child
    child.returncode = 0  # reaped above: Popen must not wait for it again


def test_running_and_vanished_processes() -> None:
    assert pids.running(os.getpid())
    assert not pids.running(None)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pids.running(child.pid)


def test_end_kills_what_ignores_sigterm_and_waits_for_the_rest_together() -> None:
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal("
                                 "signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
                                 "time.sleep(60)"], stdout=subprocess.PIPE)
    polite = subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE)
    for proc in (stubborn, polite):
        proc.stdout.readline()  # its handler is in place
    start = time.monotonic()
    assert pids.terminate(stubborn.pid) and pids.terminate(polite.pid)
    pids.end([stubborn.pid, polite.pid], 1)
    assert time.monotonic() - start < 10
    assert not pids.running(stubborn.pid) and not pids.running(polite.pid)
    assert not pids.terminate(polite.pid)  # gone and reaped: nothing to signal
    for proc in (stubborn, polite):
        proc.stdout.close()
        proc.returncode = 0


def test_terminate_of_a_missing_pid_is_false() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pids.terminate(child.pid)
