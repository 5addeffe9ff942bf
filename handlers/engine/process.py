"""The engine process: scheduler, backend and model in a child of the TorchServe worker.

When a worker process dies, TorchServe 0.12's async frontend answers only the request
its worker thread was sending; every other request of that worker waits forever
(pytorch/serve@v0.12.0:frontend/server/src/main/java/org/pytorch/serve/wlm/
AsyncWorkerThread.java:144-147). So the model -- what an OOM kill or a Neuron runtime
abort takes down -- runs here, and the worker (handlers/engine/client.py) answers for it.

This side runs the same `Engine` as inline mode and talks to the worker over one
pipe, in the messages of handlers/engine/messages.py: it gets `EngineRequest`, `Cancel`
and `Stop`, and answers once `Ready` (or `LoadFailed`), then one `StepOutputs` per
engine step -- every event and metric observation of the step in one message (vLLM's
engine core batches its outputs the same way), the text events as plain fields.
Detokenization and stop strings stay with the sequence, here.

What the worker must know even while a step holds the GIL -- when the step began, how
many requests arrived -- goes on the shared board (handlers/engine/board.py), written
from the engine's own threads. This process dies with its worker (PR_SET_PDEATHSIG), so
an orphan never keeps the NeuronCores; answering the dead worker's requests is its
guardian's job (handlers/engine/guardian.py), which no step here can block. And it
watches its worker: one stopped (SIGSTOP), or live but not reading this process's
results, while requests are in flight, is killed, so that the guardian answers them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NoReturn, Protocol

from handlers.engine.board import Board
from handlers.engine.core import Engine
from handlers.engine.messages import (
    HEARTBEAT_S,
    Cancel,
    EngineRequest,
    FinalItem,
    Heartbeat,
    LoadFailed,
    Observation,
    Ready,
    StepOutputs,
    Stop,
    TextItem,
)
from handlers.engine.scheduler import ErrorEvent, Event, Sink, TextEvent
from handlers.engine.start import (
    EngineSpec,
    build_sequence,
    model_limits,
    pickled_tokenizer,
    start_engine,
)
from handlers.errors import CapacityError

logger = logging.getLogger(__name__)

#: a worker stopped (SIGSTOP) this long while it has requests is killed, so that its
#: guardian answers them (watch_worker); polled every WORKER_CHECK_S
WORKER_STOPPED_S = 2.0
WORKER_CHECK_S = 0.25
#: a live worker that has left this process's step messages unread this long, while it
#: has requests here and is not waiting on the frontend (a write in progress), is taken
#: for deadlocked and killed the same way
WORKER_UNREAD_S = 5.0
#: linux/prctl.h
_PR_SET_PDEATHSIG = 1


class WorkerBook(Protocol):
    def holds_requests(self) -> bool:
        """Requests of the worker are in flight here: a stuck worker is worth killing."""


class Outbox:
    """Events and observations of the current step; `flush` sends them as one message.

    It also keeps this process's side of the book on the worker: how many requests are in
    flight here (`holds_requests`) and how many step messages went out (`sent`)."""

    def __init__(self, conn: Connection, board: Board | None = None) -> None:
        self._conn = conn
        self._board = board
        self._lock = threading.Lock()
        self._texts: list[TextItem] = []
        self._finals: list[FinalItem] = []
        self._observations: list[Observation] = []
        self._in_flight = 0
        #: step messages sent to the worker, which counts those it takes in (`Board.taken`)
        self.sent = 0

    def sink(self, request_id: str) -> Sink:
        with self._lock:
            self._in_flight += 1

        def put(event: Event) -> None:
            if type(event) is TextEvent:
                text = (request_id, event.text, event.tokens)
                with self._lock:
                    self._texts.append(text)
            else:  # the request's last event: FinishEvent or ErrorEvent
                with self._lock:
                    self._finals.append((request_id, event))
        return put

    def holds_requests(self) -> bool:
        """Requests of a guarded worker are in flight here, or ended in step messages it has
        not taken in: killing it when it is stuck gets them answered (without a guardian,
        nobody would). A worker stopped after the engine finished its requests but before
        it read their ends held them for good, unkilled (a 250-token stream on the Neuron
        fake ends within the 2 s WORKER_STOPPED_S on a fast host)."""
        board = self._board
        if board is None or not board.guarded:
            return False
        return self._in_flight > 0 or board.taken < self.sent

    def observe(self, name: str, value: float, unit: str) -> None:
        with self._lock:
            self._observations.append((name, value, unit))

    def send(self, message: object) -> None:
        """One message now, between the step messages (under the same lock)."""
        with self._lock:
            try:
                self._conn.send(message)
                return
            except OSError:  # the worker is gone
                pass
        _worker_gone()

    def flush(self) -> None:
        with self._lock:
            if not self._texts and not self._finals and not self._observations:
                return
            message = StepOutputs(self._texts, self._finals, self._observations)
            self._texts, self._finals, self._observations = [], [], []
            try:  # under the lock: two threads flush (engine, commands); one send at a time
                self._conn.send(message)
            except OSError:  # the worker is gone
                pass
            else:
                self.sent += 1
                self._in_flight -= len(message.finals)
                return
        _worker_gone()


def _worker_gone() -> NoReturn:
    """The pipe closed: the worker died (its guardian answers for it). This process must
    not outlive it."""
    os._exit(0)


def _board_engine(board: Board) -> type[Engine]:
    """The engine, its step's start also on the board: the worker reads it there, so a step
    that holds the GIL (which starves this process's heartbeat) is told apart from a
    stopped process, and only handler.step_timeout_s bounds it."""
    cells = board.cells

    class BoardEngine(Engine):
        @property
        def busy_since(self) -> float | None:
            return self._busy_since

        @busy_since.setter
        def busy_since(self, value: float | None) -> None:
            self._busy_since = value
            cells[Board.STEP_SINCE] = value or 0.0

    return BoardEngine


def main(conn: Connection, spec: EngineSpec, board: Board | None = None,
         worker_pid: int | None = None) -> None:
    """The process's entry point: load, say ready (or why not), then serve commands."""
    # the worker's own logging: TorchServe reads its stdout into the model log
    # (pytorch/serve@v0.12.0:ts/model_service_worker.py:282)
    logging.basicConfig(stream=sys.stdout, format="%(message)s", level=spec.log_level)
    die_with_parent(worker_pid)
    board = board or Board()
    outbox = Outbox(conn, board)
    try:
        engine, tokenizer = start_engine(spec, outbox.observe, outbox.flush,
                                         _board_engine(board))
    except BaseException as exc:
        logger.exception("engine process %d: loading the model failed", os.getpid())
        conn.send(LoadFailed(_portable(exc), traceback.format_exc()))
        return
    conn.send(Ready(model_limits(engine.backend), pickled_tokenizer(tokenizer)))
    threading.Thread(target=heartbeat, args=(outbox,), name="inf2serve-heartbeat",
                     daemon=True).start()
    threading.Thread(target=watch_worker,
                     args=(outbox, os.getppid(), unread_by_worker(outbox, board)),
                     name="inf2serve-worker-watch", daemon=True).start()
    serve(conn, engine, tokenizer, outbox, board)


def die_with_parent(parent_pid: int | None) -> None:
    """SIGKILL this process when the thread that started it exits (Linux's
    PR_SET_PDEATHSIG; its parent, the worker, starts it from a thread that lives as long
    as the worker). Elsewhere, the pipe's end does it (`_worker_gone`)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError) as exc:
        logger.warning("engine process %d: it may outlive its worker: %s", os.getpid(), exc)
        return
    if parent_pid is not None and os.getppid() != parent_pid:  # it died before the prctl
        os._exit(0)


def unread_by_worker(outbox: Outbox, board: Board) -> Callable[[], int | None]:
    """For watch_worker: how many step messages the worker has taken in, while it has some
    of ours unread and is not inside a write to the frontend (then it waits on TorchServe,
    not on itself); None otherwise."""
    cells = board.cells

    def unread() -> int | None:
        taken = cells[Board.TAKEN]
        if taken >= outbox.sent or cells[Board.WRITES] != cells[Board.WRITTEN]:
            return None
        return int(taken)
    return unread


def process_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, D, T...), None when there is no such
    process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0]  # the name may hold spaces


def watch_worker(book: WorkerBook, worker_pid: int,
                 unread: Callable[[], int | None] | None = None) -> None:
    """Kill the TorchServe worker when, while requests of it are in flight here, it is
    stopped (SIGSTOP: state T) for WORKER_STOPPED_S, or it is live but has not taken in
    this process's step messages for WORKER_UNREAD_S (`unread`: what it has taken, while
    some are waiting and it is not writing to the frontend; a deadlocked event loop, a
    thread that holds its GIL for good). Its death then takes the usual path: its guardian
    answers its requests, this process dies with it. Its own thread, reading /proc and the
    board only: the step and heartbeat threads block once a stuck worker's pipe is full. A
    worker that is busy or idle is never T; one that is stopped while idle is left alone
    (someone may be debugging it)."""
    stopped_since: float | None = None
    unread_mark: int | None = None
    unread_since = 0.0
    while True:
        time.sleep(WORKER_CHECK_S)
        state = process_state(worker_pid)
        if state is None:
            return  # gone: the pipe's end tells serve()
        now = time.monotonic()
        holds = book.holds_requests()
        mark = unread() if unread is not None and holds else None
        if mark is None or mark != unread_mark:
            unread_mark, unread_since = mark, now
        elif now - unread_since >= WORKER_UNREAD_S:
            _kill_worker(worker_pid, f"has left this process's results unread for "
                                     f"{now - unread_since:.1f}s with requests in flight "
                                     "(deadlocked?)")
            return
        if state != "T" or not holds:
            stopped_since = None
            continue
        stopped_since = stopped_since or now
        if now - stopped_since >= WORKER_STOPPED_S:
            _kill_worker(worker_pid, f"has been stopped for {now - stopped_since:.1f}s with "
                                     "requests in flight")
            return


def _kill_worker(worker_pid: int, why: str) -> None:
    logger.error("engine process %d: the TorchServe worker %d %s; killing it so that its "
                 "guardian answers them", os.getpid(), worker_pid, why)
    try:
        os.kill(worker_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def heartbeat(outbox: Outbox) -> None:
    """Tell the worker every HEARTBEAT_S that this process lives. Its own thread: a stopped
    process falls silent (a step that holds the GIL does too, but the board says it is in
    a step: handlers/engine/client.py)."""
    while True:
        time.sleep(HEARTBEAT_S)
        outbox.send(Heartbeat())


def serve(conn: Connection, engine: Engine, tokenizer, outbox: Outbox,
          board: Board | None = None) -> None:
    """Apply the worker's commands until it says stop or goes away."""
    cells = (board or Board()).cells
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the worker died: this process must not outlive it
            _worker_gone()
        match message:
            case EngineRequest():
                cells[Board.RECEIVED] += 1  # before anything of it can happen
                sink = outbox.sink(message.request_id)
                try:
                    engine.submit(build_sequence(message, sink, tokenizer))
                except CapacityError as exc:
                    sink(ErrorEvent(503, str(exc), exc.retry_after_s))
            case Cancel():
                engine.cancel(message.request_id)
            case Stop():
                engine.stop()
                return
            case _:
                logger.error("engine process: ignored a message of type %s from the worker",
                             type(message).__name__)
        if not conn.poll():  # answers to commands (503s, cancels) go out once none are queued
            outbox.flush()


def _portable(exc: BaseException) -> BaseException:
    """The exception itself if it survives pickling (the worker re-raises it), else its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
