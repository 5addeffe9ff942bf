"""A few numbers the worker, its engine process and its guardian read of one another.

Messages can say nothing when the process that would send them cannot run: a step that
holds the GIL starves the engine process's heartbeat thread, a killed worker sends no
last message. So what the others must know at such times sits in one page of shared
memory (a memfd, or an unlinked temporary file where there is none), each number written
by one process only and read by the others without a lock (an aligned 8-byte store is
atomic):

- `step_since`, by the engine thread: when its current step began (time.monotonic(), one
  clock per host), 0 between steps. The worker's watchdog bounds a step by
  handler.step_timeout_s from this, and forgives a silent heartbeat while a step runs
  (handlers/engine/client.py).
- `received`, by the engine process: how many `EngineRequest`s it has read. A request the
  worker sent past that number when the process died never reached it, so it waits for the
  next one instead of failing.
- `taken`, by the worker: how many of the engine process's step messages its event loop has
  taken in. The engine process kills a worker that leaves them unread
  (handlers/engine/process.watch_worker).
- `writes` / `written`, by the worker: writes to TorchServe's socket begun and ended
  (`CountedWrites`). Unequal, the worker is inside a write: it waits on the frontend, not
  on itself, and if it dies there its message is torn (handlers/engine/guardian.py).
- `guarded`, by the worker: 1 once its guardian runs and its writes are counted. Only then
  is killing a stuck worker of use (someone answers its requests), and only then does
  `writes` say whether it waits on the frontend.
- `reading`, by the worker's reader thread: 1 from a message's first byte until its
  requests are noted with the guardian. A worker that dies there leaves the socket in the
  middle of a message (or a request nobody noted), so no other process may read on.

Standard library only: the guardian imports it.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from typing import Any

_SIZE = mmap.PAGESIZE


class Board:
    """The shared numbers; pickles to a spawned process (multiprocessing passes the fd)."""

    STEP_SINCE, RECEIVED, TAKEN, WRITES, WRITTEN, GUARDED, READING = range(7)

    def __init__(self, fd: int | None = None) -> None:
        if fd is None:
            fd = _anonymous_file()
            os.ftruncate(fd, _SIZE)
        self.fd = fd
        self._map = mmap.mmap(fd, _SIZE)
        #: the numbers, indexed by the constants above (doubles: exact to 2**53)
        self.cells = memoryview(self._map).cast("d")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing.reduction import DupFd  # only while spawning a process

        return _attach, (DupFd(self.fd),)

    @property
    def step_since(self) -> float:
        return self.cells[Board.STEP_SINCE]

    @property
    def received(self) -> int:
        return int(self.cells[Board.RECEIVED])

    @property
    def taken(self) -> int:
        return int(self.cells[Board.TAKEN])

    @property
    def guarded(self) -> bool:
        return self.cells[Board.GUARDED] == 1.0

    @property
    def written(self) -> int:
        return int(self.cells[Board.WRITTEN])

    #: Board.READING: at a message's start; inside one (read field by field: where the
    #: socket stands is unknown); or a whole message noted and then read in one go, which
    #: the guardian can tell apart (guardian.Farewell.settle)
    AT_START, INSIDE, NOTED = 0.0, 1.0, 2.0

    def reading(self) -> bool:
        """The worker is inside a message from TorchServe (or died in one) and the socket's
        place in it is unknown."""
        return self.cells[Board.READING] == Board.INSIDE

    def noted(self) -> bool:
        """The worker noted a whole message and was reading it off the socket, or had."""
        return self.cells[Board.READING] == Board.NOTED

    def writing(self) -> bool:
        """The worker is inside a write to TorchServe's socket (or died in one)."""
        cells = self.cells
        return cells[Board.WRITES] != cells[Board.WRITTEN]

    def new_engine(self) -> None:
        """Zero the engine process's numbers (by the worker, before it starts one)."""
        cells = self.cells
        cells[Board.STEP_SINCE] = cells[Board.RECEIVED] = cells[Board.TAKEN] = 0.0


def _attach(dupfd: Any) -> Board:
    return Board(dupfd.detach())


def _anonymous_file() -> int:
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None:
        return memfd_create("inf2serve-board", os.MFD_CLOEXEC)
    fd, path = tempfile.mkstemp(prefix="inf2serve-board-")
    os.unlink(path)
    return fd


class CountedWrites:
    """TorchServe's socket for the worker's writes, each counted on the board (`writes`
    before, `written` after): the guardian then knows whether a dead worker's last
    message is whole, and the engine process whether the worker waits on the frontend.
    Everything else is the socket's own."""

    def __init__(self, sock: Any, board: Board) -> None:
        self._sock = sock
        self._cells = board.cells

    def sendall(self, data: bytes) -> None:
        cells = self._cells
        cells[Board.WRITES] += 1
        self._sock.sendall(data)
        cells[Board.WRITTEN] += 1  # not on an error: that message may well be torn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)
