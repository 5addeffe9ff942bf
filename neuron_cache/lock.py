"""An inter-process lock on a file (fcntl.flock): released by the kernel when the holder dies.

A crashed compile never leaves a stale lock behind, which is why this is flock and
not an "exists" marker file. The holder writes its pid into the file so a waiter
can say who it is waiting for.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path
from types import TracebackType

from neuron_cache.errors import CacheError

log = logging.getLogger(__name__)


def try_lock(path: Path) -> int | None:
    """Open and lock `path` without blocking; the fd (keep it open to hold) or None if taken."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def holder(path: Path) -> str:
    """The pid written by the current (or last) holder, for messages."""
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def unlock(fd: int) -> None:
    """Release and close; the file stays (deleting it would race with a waiter's open)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class FileLock:
    """Exclusive lock held for a `with` block; waits (polling) and logs who holds it."""

    def __init__(self, path: Path, *, timeout_s: float | None = None, poll_s: float = 0.2,
                 log_every_s: float = 30.0) -> None:
        self.path = Path(path)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.log_every_s = log_every_s
        self._fd: int | None = None

    def acquire(self) -> None:
        start = last_log = time.monotonic()
        while (fd := try_lock(self.path)) is None:
            now = time.monotonic()
            if self.timeout_s is not None and now - start >= self.timeout_s:
                raise CacheError(
                    f"{self.path}: still locked by pid {holder(self.path)} after "
                    f"{self.timeout_s:.0f}s; another worker is compiling this entry. Wait for "
                    "it, or stop that process if it is stuck")
            if now - last_log >= self.log_every_s or last_log == start:
                log.info("waiting for %s (held by pid %s, %.0fs so far)", self.path,
                         holder(self.path), now - start)
                last_log = now
            time.sleep(self.poll_s)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            unlock(fd)

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
