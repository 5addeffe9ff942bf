"""Whether a process id still runs, and ending a few processes: what `inf2serve stop` and
the work-dir owner checks ask of process ids.

A process that has exited stays in the process table as a zombie until its parent reaps
it, and `os.kill(pid, 0)` succeeds on a zombie. TorchServe's frontend and the OpenAI router
outlive `inf2serve serve`, so their parent is init, which reaps when it gets round to it:
1-2 s on the VMs CI runs on, which every `inf2serve stop` used to wait out for each process
it stopped, one after the other. Here a zombie counts as ended, and ours are reaped.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

_PROC = os.path.isdir("/proc/self")
POLL_S = 0.05


def running(pid: int | None) -> bool:
    """True while `pid` exists and has not exited (a zombie has)."""
    if pid is None:
        return False
    if _PROC:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]  # field 3 of proc(5)
        except FileNotFoundError:
            return False
        except (OSError, IndexError):
            pass  # unreadable: ask the kernel below
        else:
            return state not in (b"Z", b"X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's, alive
        return True
    return True


def _ended(pid: int) -> bool:
    """Whether `pid` has exited; our own child is reaped, so that it leaves no zombie. (Ours
    is asked by waitpid alone: /proc shows it a zombie a moment before waitpid can take it.)"""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # not our child: its parent (or init) reaps it
        return not running(pid)


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait up to `timeout_s` for every one of `pids` to exit; the ones still running."""
    left = list(pids)
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid in left if not _ended(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(POLL_S)


def terminate(pid: int) -> bool:
    """SIGTERM `pid`; False if it was already gone."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True


def terminate_if(pid: int, marker: bytes) -> bool:
    """SIGTERM `pid` if its command line holds `marker` (a pid file's number may belong to
    another process by now). True if it is to be waited for with `end`: signalled, or
    already exited and not reaped (a zombie's command line reads empty; ours get reaped)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if not running(pid):
        return True
    return marker in cmdline and terminate(pid)


def end(pids: Iterable[int], timeout_s: float) -> None:
    """After a SIGTERM: wait up to `timeout_s` for `pids` to exit, then SIGKILL the rest."""
    for pid in wait_gone(pids, timeout_s):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        wait_gone([pid], 5)
