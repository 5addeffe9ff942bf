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

When the worker itself dies, this process answers for it (`Farewell`): the worker hands
it a duplicate of TorchServe's socket and, with each request, the TorchServe messages
that answer it with a 500; once the pipe closes they go out, and the socket is closed.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from pathlib import Path
from typing import NoReturn

from handlers.engine.core import Engine
from handlers.engine.messages import (
    HEARTBEAT_S,
    Cancel,
    EngineRequest,
    FinalItem,
    FrontendSocket,
    Heartbeat,
    LastWords,
    LoadFailed,
    Observation,
    Ready,
    StepOutputs,
    Stop,
    TextItem,
)
from handlers.engine.scheduler import ErrorEvent, Event, Sink, TextEvent
from handlers.engine.start import EngineSpec, build_sequence, model_limits, start_engine
from handlers.errors import CapacityError

logger = logging.getLogger(__name__)

#: how long the last words may take to write: a frontend that reads nothing gets no more
SAY_TIMEOUT_S = 2.0
#: a worker stopped (SIGSTOP) this long while it has requests is killed, so that this
#: process answers them (watch_worker); polled every WORKER_CHECK_S
WORKER_STOPPED_S = 2.0
WORKER_CHECK_S = 0.25


class Farewell:
    """What this process says on TorchServe's socket when the worker dies.

    A TorchServe 0.12 frontend notices a worker's death only when the worker's socket
    closes, and then answers none of the requests it had sent there: they stay in its
    in-flight map (pytorch/serve@v0.12.0:frontend/server/src/main/java/org/pytorch/serve/
    wlm/AsyncWorkerThread.java:129-153, :187-200). Holding a duplicate of that socket, this
    process keeps it open past the worker's death; once the pipe closes (the worker is gone,
    so nobody else writes) it writes each of its requests' `LastWords` -- the in-band error
    if some of its text reached the worker, else the whole 500 -- then the worker's
    closing message, which errors every other request in the frontend's map (one the worker
    was still preparing, or whose end it had not yet written), and closes the socket: the
    frontend restarts the worker. A request leaves the book when its last event reaches
    the pipe or the worker cancels it: after that the worker may have ended it, and the
    frontend fails on an answer for a request it no longer has (AsyncBatchAggregator.java:
    92-97) -- the closing message covers those.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held while the words go out: the process exits after
        self._sock: socket.socket | None = None
        self._closing = b""
        self._words: dict[str, LastWords] = {}
        self._spoken: set[str] = set()  # requests some of whose text reached the pipe

    def arm(self, sock: socket.socket, closing: bytes) -> None:
        with self._lock:
            old, self._sock, self._closing = self._sock, sock, closing
        if old is not None:
            old.close()

    def expect(self, words: LastWords) -> None:
        with self._lock:
            if self._sock is not None:
                self._words[words.request_id] = words

    def holds_requests(self) -> bool:
        """Armed, with requests it would answer for: a stopped worker is worth killing."""
        return self._sock is not None and bool(self._words)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._words.pop(request_id, None)
            self._spoken.discard(request_id)

    def sent(self, texts: list[TextItem], finals: list[FinalItem]) -> None:
        """A step's events reached the pipe: their text may be on the frontend's wire, and
        ended requests are the worker's to end."""
        if not self._words:
            return
        with self._lock:
            words, spoken = self._words, self._spoken
            for request_id, text, _ in texts:
                if text and request_id in words:
                    spoken.add(request_id)
            for request_id, _ in finals:
                if words.pop(request_id, None) is not None:
                    spoken.discard(request_id)

    def say(self) -> None:
        """The worker is gone: every request's last words, the closing message, the close."""
        with self._lock:
            sock, self._sock = self._sock, None
            if sock is None:
                return
            spoken = self._spoken
            answers = [w.spoken if w.spoken is not None and rid in spoken else w.silent
                       for rid, w in self._words.items()]
            try:
                sock.settimeout(SAY_TIMEOUT_S)
                sock.sendall(b"".join([*answers, self._closing]))
            except OSError as exc:  # the frontend went away too (a shutdown): nobody to tell
                logger.error("engine process %d: writing to TorchServe failed: %s",
                             os.getpid(), exc)
                return
            finally:
                try:
                    sock.shutdown(socket.SHUT_WR)  # the frontend sees the worker go now
                except OSError:
                    pass
                sock.close()
        logger.error("engine process %d: the TorchServe worker died; answered its %d "
                     "request(s) here with a 500 and the frontend's others with its closing "
                     "message, then closed its socket", os.getpid(), len(answers))


def _worker_gone(farewell: Farewell) -> NoReturn:
    """The pipe closed: the worker died (it closes it only after this process). Answer for
    it where it handed over its socket, and exit: this process must not outlive it."""
    farewell.say()
    os._exit(0)


class Outbox:
    """Events and observations of the current step; `flush` sends them as one message."""

    def __init__(self, conn: Connection, farewell: Farewell | None = None) -> None:
        self._conn = conn
        self.farewell = farewell or Farewell()
        self._lock = threading.Lock()
        self._texts: list[TextItem] = []
        self._finals: list[FinalItem] = []
        self._observations: list[Observation] = []

    def sink(self, request_id: str) -> Sink:
        def put(event: Event) -> None:
            if type(event) is TextEvent:
                text = (request_id, event.text, event.tokens)
                with self._lock:
                    self._texts.append(text)
            else:  # the request's last event: FinishEvent or ErrorEvent
                with self._lock:
                    self._finals.append((request_id, event))
        return put

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
        _worker_gone(self.farewell)

    def flush(self) -> None:
        with self._lock:
            if not self._texts and not self._finals and not self._observations:
                return
            message = StepOutputs(self._texts, self._finals, self._observations)
            self._texts, self._finals, self._observations = [], [], []
            try:  # under the lock: two threads flush (engine, commands); one send at a time
                self._conn.send(message)
            except OSError:  # the worker is gone: nobody is left to answer but the farewell
                pass
            else:
                self.farewell.sent(message.texts, message.finals)
                return
        _worker_gone(self.farewell)


def main(conn: Connection, spec: EngineSpec) -> None:
    """The process's entry point: load, say ready (or why not), then serve commands."""
    # the worker's own logging: TorchServe reads its stdout into the model log
    # (pytorch/serve@v0.12.0:ts/model_service_worker.py:282)
    logging.basicConfig(stream=sys.stdout, format="%(message)s", level=spec.log_level)
    outbox = Outbox(conn)
    try:
        engine, tokenizer = start_engine(spec, outbox.observe, outbox.flush)
    except BaseException as exc:
        logger.exception("engine process %d: loading the model failed", os.getpid())
        conn.send(LoadFailed(_portable(exc), traceback.format_exc()))
        return
    conn.send(Ready(model_limits(engine.backend)))
    threading.Thread(target=heartbeat, args=(engine, outbox), name="inf2serve-heartbeat",
                     daemon=True).start()
    threading.Thread(target=watch_worker, args=(outbox.farewell, os.getppid()),
                     name="inf2serve-worker-watch", daemon=True).start()
    serve(conn, engine, tokenizer, outbox)


def process_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, D, T...), None when there is no such
    process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0]  # the name may hold spaces


def watch_worker(farewell: Farewell, worker_pid: int) -> None:
    """Kill the TorchServe worker when it is stopped (SIGSTOP: state T) for WORKER_STOPPED_S
    while this process would answer for its requests; the worker's death then takes the
    usual path (the pipe closes, `Farewell.say`), so its requests end with an error instead
    of hanging. Its own thread, reading /proc only: the step and heartbeat threads block
    once a stopped worker's pipe is full. A worker that is busy or idle is never T; one that
    is stopped while idle is left alone (someone may be debugging it). A worker that hangs
    while running (a deadlock) is not caught here."""
    stopped_since: float | None = None
    while True:
        time.sleep(WORKER_CHECK_S)
        state = process_state(worker_pid)
        if state is None:
            return  # gone: the pipe's end tells serve()
        if state != "T" or not farewell.holds_requests():
            stopped_since = None
            continue
        now = time.monotonic()
        stopped_since = stopped_since or now
        if now - stopped_since >= WORKER_STOPPED_S:
            logger.error("engine process %d: the TorchServe worker %d has been stopped for "
                         "%.1fs with requests in flight; killing it so that they are "
                         "answered here", os.getpid(), worker_pid, now - stopped_since)
            try:
                os.kill(worker_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


def heartbeat(engine: Engine, outbox: Outbox) -> None:
    """Tell the worker every HEARTBEAT_S that this process lives and how long the engine
    has been in its current step. Its own thread: a step that never returns, or a process
    that is stopped, is then told apart from a busy one (handlers/engine/client.py)."""
    while True:
        time.sleep(HEARTBEAT_S)
        since = engine.busy_since
        outbox.send(Heartbeat(0.0 if since is None else time.monotonic() - since))


def serve(conn: Connection, engine: Engine, tokenizer, outbox: Outbox) -> None:
    """Apply the worker's commands until it says stop or goes away."""
    farewell = outbox.farewell
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the worker died: this process must not outlive it
            _worker_gone(farewell)
        match message:
            case EngineRequest():
                sink = outbox.sink(message.request_id)
                try:
                    engine.submit(build_sequence(message, sink, tokenizer))
                except CapacityError as exc:
                    sink(ErrorEvent(503, str(exc), exc.retry_after_s))
            case Cancel():
                farewell.forget(message.request_id)  # the worker may end it itself now
                engine.cancel(message.request_id)
            case LastWords():  # for the EngineRequest that follows
                farewell.expect(message)
            case FrontendSocket():  # its fd follows on the pipe
                farewell.arm(socket.socket(fileno=recv_handle(conn)), message.closing)
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
