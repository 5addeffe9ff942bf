"""The TorchServe worker's side of the engine process: start it, relay, answer for it.

The worker keeps TorchServe's socket, the tokenizer and the HTTP framing; the engine
process (handlers/engine/process.py) holds the model. When that process dies -- SIGKILL,
the OOM killer, a Neuron runtime abort -- the pipe closes, and within one poll the
worker answers each request it had sent there with a 500 (an in-band error if the
stream had started) and starts a new one, which loads from the compile cache.
Requests arriving meanwhile wait for it, up to handler.max_queue; if it fails to load,
they get a 503 and the worker keeps retrying with a growing pause.

A process can also stop without dying: SIGSTOP, a wedged runtime, a device call that
never returns. It sends a heartbeat (handlers/engine/messages.Heartbeat) every
HEARTBEAT_S from its own thread, and puts the start of each engine step on the shared
board (handlers/engine/board.py); while the worker has requests there, a process whose
step has run past handler.step_timeout_s, or that has been silent for SILENT_S while
stopped (/proc state T) or outside a step, is killed and handled as a death: its
requests are answered with a 500 and it restarts. A step that holds the GIL silences
the heartbeat but not the board: only the step timeout bounds it.

A request sent in the moments after the process died -- before the pipe closes, which
waits for the kernel to tear the process down -- never reached it: the board counts the
requests the process read, and those past that count wait for the next process instead
of failing.

The worker keeps each request it sent as the `EngineRequest` it sent and the sink it
answers to: enough to send it again or answer for it. It builds no engine `Sequence`;
detokenizing and stop strings happen in the engine process. The messages and the handle
it implements are in handlers/engine/messages.py.

Start method `spawn`: the worker already runs threads (TorchServe's async service
has three), and a fork would copy the locks they hold; a spawned interpreter starts
clean, so torch's one OpenMP pool and the Neuron runtime are initialised in the
process that uses them, and multiprocessing passes the pickled spec, sys.path (the
archive's runtime/) and the pipe. forkserver would save the imports on a restart at
the price of a third process to supervise. The process is not daemonic: the Neuron
SDK compiles in a ProcessPoolExecutor
(aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/base.py:L60), and a
daemonic process may not have children.

NeuronCores are claimed here, by the worker, for its whole life; the engine process
runs on that block and a restart gets it back (no other worker can take it meanwhile).

The worker can die too. `hand_over` starts its guardian (handlers/engine/guardian.py), a
small process holding a duplicate of TorchServe's socket, and notes there each request's
`LastWords` (set in `LAST_WORDS` around `submit`), its first text and its end as they
reach this process, before they can reach the frontend: when the worker dies, the
guardian answers for it on that socket. The engine process dies with the worker
(handlers/engine/process.die_with_parent).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from handlers.backends.base import Backend
from handlers.backends.neuron_cores import CoreClaim, available_cores, claim_cores
from handlers.config import ModelConfig
from handlers.engine import process as engine_process
from handlers.engine.board import Board, CountedWrites
from handlers.engine.core import Observer
from handlers.engine.delivery import deliver
from handlers.engine.guardian import GuardedWrites, Guardian
from handlers.engine.messages import (
    SILENT_S,
    Cancel,
    EngineRequest,
    FromEngine,
    Heartbeat,
    LastWords,
    LoadFailed,
    ModelLimits,
    Ready,
    StepOutputs,
    Stop,
    ToEngine,
)
from handlers.engine.scheduler import ErrorEvent, Event, Sink, TextEvent
from handlers.engine.start import EngineSpec
from handlers.errors import CapacityError, EngineProcessError
from handlers.telemetry.catalog import Finished

logger = logging.getLogger(__name__)

#: pauses between failed restarts, the last one repeating
RESTART_BACKOFF_S = (1, 2, 5, 10, 30, 60)
#: how often a reader with nothing to read checks that the process is alive; a forked
#: grandchild (a compiler) can keep the pipe open after the process itself died
POLL_S = 0.5
#: the last words of the request being submitted: the TorchServe handler sets them around
#: its `submit` call (whose signature is the engine handle's), `EngineClient.submit` reads them
LAST_WORDS: ContextVar[LastWords | None] = ContextVar("inf2serve_last_words", default=None)


@dataclass(eq=False)
class _Request:
    """A request in flight: what was (or will be) sent, and where its events go."""

    request: EngineRequest
    sink: Sink
    sent_to: int | None = None  # the engine process (incarnation) it went to; None: waiting
    #: its place among the requests sent to that process (1, 2...), against Board.received
    number: int = 0
    last_words: LastWords | None = None  # noted with the guardian, where there is one
    spoken: bool = False  # the guardian knows some of its text reached this process

    @property
    def request_id(self) -> str:
        return self.request.request_id


class EngineClient:
    """The `EngineHandle` of handler.engine_process child: submit(request, sink),
    cancel(request_id), stop() for a model that runs in the engine process."""

    def __init__(self, spec: EngineSpec, observer: Observer | None, capacity: int,
                 claim: CoreClaim | None = None) -> None:
        self.spec = spec
        self.limits: ModelLimits  # the loaded model's, once `_launch` has one
        #: the first engine process's tokenizer, pickled, until `take_tokenizer`
        self._tokenizer_pickle: bytes | None = None
        self.pid: int | None = None  # the engine process's
        self._observe = observer or (lambda name, value, unit: None)
        self._capacity = capacity
        self._claim = claim
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self._incarnation = 0
        #: why requests get a 503 now (a restart failed); None while they can be taken
        self.down: str | None = None
        self._stopping = threading.Event()
        # the watchdog's (the supervising thread's own): when the process was last heard from
        self._heard = time.monotonic()
        self._step_timeout_s = spec.config.handler.effective_step_timeout_s
        #: what the engine process, this worker and its guardian read of one another
        self._board = Board()
        #: requests sent to the process on `_numbering` (both under _send_lock)
        self._sent = 0
        self._numbering: Connection | None = None
        self._taken = 0  # its step messages taken in (the supervising thread's)
        #: answers for this worker if it dies, once TorchServe's socket is handed over
        self._guardian: Guardian | None = None

    @classmethod
    def start(cls, config: ModelConfig, model_dir: Path, observer: Observer | None = None,
              make_backend: Callable[[], Backend | None] | None = None) -> EngineClient:
        """Claim NeuronCores (the Neuron backends), start the engine process and wait until the
        model is loaded; a load error is raised here, as the engine process raised it."""
        h = config.handler
        neuron = h.backend in ("neuron", "nxdi")
        claim = claim_cores(h.neuron, available_cores(h.neuron)) if neuron else None
        spec = EngineSpec(config, model_dir, claim.cores if claim else None, make_backend,
                          log_level=logging.getLogger().getEffectiveLevel())
        try:
            return cls.launch(spec, observer, h.batch_size + h.max_queue, claim)
        except BaseException:
            if claim is not None:
                claim.release()
            raise

    @classmethod
    def launch(cls, spec: EngineSpec, observer: Observer | None, capacity: int,
               claim: CoreClaim | None = None) -> EngineClient:
        """Start the engine process from `spec` and supervise it (`stop` releases `claim`)."""
        client = cls(spec, observer, capacity, claim)
        client._launch()
        threading.Thread(target=client._supervise, name="inf2serve-engine-client",
                         daemon=True).start()
        atexit.register(client.stop)
        return client

    def take_tokenizer(self) -> object | None:
        """The first engine process's tokenizer (`Ready.tokenizer`), for the worker to use
        rather than load the same one again; once. None where it did not pickle."""
        data, self._tokenizer_pickle = self._tokenizer_pickle, None
        return None if data is None else pickle.loads(data)

    # -- the engine handle -----------------------------------------------------------
    def submit(self, request: EngineRequest, sink: Sink) -> None:
        with self._lock:
            if self.down is not None:
                raise CapacityError(f"the model process is down ({self.down}) and is being "
                                    "restarted; retry later", retry_after_s=5)
            if len(self._requests) >= self._capacity:
                raise CapacityError(f"{len(self._requests)} requests are in flight (handler."
                                    f"batch_size + handler.max_queue = {self._capacity}); "
                                    "retry later or add workers")
            words = LAST_WORDS.get()
            if words is not None and words.request_id != request.request_id:
                words = None
            guardian = self._guardian if words is not None else None
            entry = self._requests[request.request_id] = _Request(
                request, sink, last_words=words if guardian is not None else None)
            conn = self._conn
            if conn is not None:
                entry.sent_to = self._incarnation
        if guardian is not None:  # before anything of it can reach the frontend
            guardian.expect(words)
        if conn is not None:
            self._send_request(conn, entry)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            entry = self._requests.get(request_id)
            if entry is None:
                return
            if entry.sent_to is None:  # still waiting for a restarted process
                del self._requests[request_id]
            conn = self._conn if entry.sent_to == self._incarnation else None
        self._forget(entry)  # the worker may end it itself now
        if entry.sent_to is None:
            _emit(entry, ErrorEvent(499, "cancelled"))
        elif conn is not None:  # else the dead process's requests are being answered
            self._send(conn, Cancel(request_id))

    def hand_over(self, sock: socket.socket, closing: bytes,
                  exact: tuple[bytes, ...] | None = None,
                  takeover: dict[str, Any] | None = None) -> CountedWrites | None:
        """Start this worker's guardian with a duplicate of TorchServe's socket to the
        frontend: if the worker dies, it answers the worker's requests there (their
        `LastWords`, then `closing`) and closes it; while the worker lives, it alone writes.
        Returns the socket to write through from now on (each write counted on the board:
        the guardian must not add to a message the worker died writing), or None where no
        guardian could start. With `exact` (the worker notes each message it reads and
        each answer's last write: a `GuardedWrites`), the guardian answers exactly the
        requests left unanswered and, with `takeover`, starts a worker on the socket
        instead of closing it (handlers/engine/guardian.py, `Farewell`)."""
        try:
            guardian = Guardian.start(sock, closing, self._board, exact,
                                      takeover if exact is not None else None)
        except OSError:
            logger.exception("starting the guardian failed: if this worker dies, nobody "
                             "answers its requests")
            return None
        writes = (CountedWrites(sock, self._board) if exact is None
                  else GuardedWrites(sock, self._board, guardian))
        with self._lock:
            self._guardian = guardian
        self._board.cells[Board.GUARDED] = 1.0
        logger.info("guardian %d started: it answers for this worker if it dies",
                    guardian.proc.pid)
        return writes

    def stop(self, timeout_s: float = 10) -> None:
        """Stop the engine process; requests still in flight get a 503."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        with self._lock:
            conn, proc, guardian = self._conn, self._proc, self._guardian
        if guardian is not None:
            guardian.stand_down()
        if conn is not None:
            self._send(conn, Stop())
        if proc is not None:
            _stop_process(proc, timeout_s)
        with self._lock:
            left = list(self._requests.values())
            self._requests.clear()
        for entry in left:
            _emit(entry, ErrorEvent(503, "the worker is stopping; retry the request", 1))
        if self._claim is not None:
            self._claim.release()

    def _forget(self, entry: _Request) -> None:
        """The request is the worker's to end: out of the guardian's book first."""
        if entry.last_words is not None:
            entry.last_words = None
            self._guardian.forget(entry.request_id)

    # -- the engine process -----------------------------------------------------------
    def _launch(self) -> None:
        """Start an engine process, wait for its model, send it the requests that waited."""
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        self._board.new_engine()  # the last process is gone: its numbers start again
        # started from a thread that lives as long as this worker (this one at first, the
        # supervising thread on restarts): the process dies with that thread
        proc = ctx.Process(target=engine_process.main,
                           args=(child_conn, self.spec, self._board, os.getpid()),
                           name="inf2serve-engine")
        proc.start()
        child_conn.close()  # else this process keeps the pipe open and never sees it close
        logger.info("engine process %d started", proc.pid)
        message = _receive(conn, proc, self.spec.config.frontend.startup_timeout)
        if not isinstance(message, Ready):
            conn.close()
            reason = _stop_process(proc)
            if isinstance(message, LoadFailed):
                # the engine's own exception, its traceback as the cause (as
                # concurrent.futures does for a worker process); `add_note` is 3.11+
                raise message.error from RemoteTraceback(
                    f"raised in the engine process {proc.pid}:\n{message.traceback}")
            raise EngineProcessError(f"the engine process {proc.pid} {reason} before the "
                                     "model was loaded; its log lines are above")
        if self._stopping.is_set():  # stopped while it loaded: it must not outlive `stop`
            self._send(conn, Stop())
            _stop_process(proc)
            conn.close()
            return
        self._heard, self._taken = time.monotonic(), 0  # a new process: heard just now
        with self._lock:
            self._incarnation += 1
            self._board.cells[Board.TAKEN] = 0.0  # after any late `_took` of the last one
            self._proc, self._conn, self.limits, self.pid = proc, conn, message.limits, proc.pid
            if self._incarnation == 1:
                self._tokenizer_pickle = message.tokenizer
            waiting = [r for r in self._requests.values() if r.sent_to is None]
            for entry in waiting:
                entry.sent_to = self._incarnation
        for entry in waiting:
            self._send_request(conn, entry)

    def _supervise(self) -> None:
        """Relay the engine process's messages; answer for it and restart it when it dies,
        or when it hangs (the watchdog: `_hung`)."""
        while not self._stopping.is_set():
            with self._lock:
                conn, proc = self._conn, self._proc
            message = _receive(conn, proc, idle=_IDLE)
            hung = None
            if message is _IDLE or type(message) is Heartbeat:
                if type(message) is Heartbeat:
                    self._heard = time.monotonic()
                hung = self._hung(time.monotonic())
                if hung is None:
                    continue
            elif message is not None:
                self._heard = time.monotonic()
                try:
                    self._deliver(message)
                except Exception:  # this thread must outlive anything a message can cause
                    logger.exception("relaying a message of the engine process failed")
                continue
            if not self._stopping.is_set():
                self._died(proc, hung)
                self._restart()

    def _hung(self, now: float) -> str | None:
        """Why the engine process counts as hung, or None: only while it holds requests.

        A step is bounded by handler.step_timeout_s alone, read from the board, which the
        engine thread writes itself: a step that holds the GIL silences the process's
        heartbeat thread, so silence counts only while the process is stopped or outside
        a step."""
        with self._lock:
            holding = any(r.sent_to == self._incarnation for r in self._requests.values())
        if not holding:
            return None
        since = self._board.step_since
        if since and now - since > self._step_timeout_s:
            return (f"spent {now - since:.0f}s in one step, past handler.step_timeout_s "
                    f"{self._step_timeout_s:g}")
        silent = now - self._heard
        if silent > SILENT_S and (not since or engine_process.process_state(self.pid) == "T"):
            return (f"sent nothing for {silent:.1f}s (stopped or wedged; a live one says so "
                    "every second)")
        return None

    def _deliver(self, message: FromEngine) -> None:
        """A message of the serving engine process: only `StepOutputs` are expected."""
        match message:
            case StepOutputs():
                self._deliver_step(message)
            case _:
                logger.error("ignored a %s message of the engine process %s",
                             type(message).__name__, self.pid)

    def _deliver_step(self, step: StepOutputs) -> None:
        """A step's events to their requests, texts before the last events (a request's
        text of this step precedes its end): one wake-up per event loop, not per event.
        The guardian hears first what changes its book: a request's first text, its end.
        Once the loop has them, the board says this step was taken in."""
        self._taken += 1
        out: list[tuple[_Request, Event]] = []
        spoken: list[tuple[str, str, int]] = []
        ended: list[tuple[str, None]] = []
        with self._lock:
            requests = self._requests
            for item in step.texts:
                entry = requests.get(item[0])
                if entry is not None:  # else answered already (the process died, a stop)
                    out.append((entry, TextEvent(item[1], item[2])))
                    if (not entry.spoken and entry.last_words is not None
                            and entry.last_words.spoken is not None and item[1]):
                        entry.spoken = True
                        spoken.append(item)
            for request_id, event in step.finals:
                entry = requests.pop(request_id, None)
                if entry is not None:
                    out.append((entry, event))
                    if entry.last_words is not None:
                        ended.append((request_id, None))
            guardian = self._guardian
        if spoken or ended:
            guardian.sent(spoken, ended)
        deliver(out, partial(self._took, self._incarnation, self._taken))
        for observation in step.observations:
            self._observe(*observation)

    def _took(self, incarnation: int, taken: int) -> None:
        """A step message's events are in the loop: the engine process sees it read."""
        if incarnation == self._incarnation:
            self._board.cells[Board.TAKEN] = taken

    def _died(self, proc: BaseProcess, hung: str | None = None) -> None:
        if hung is not None:  # a stopped process cannot exit: kill it, then it is a death
            logger.error("engine process %d %s: killing it", proc.pid, hung)
            proc.kill()
        reason = _stop_process(proc)
        if hung is not None:
            reason = f"hung ({hung})"
        received = self._board.received  # requests the process read: the others never
        with self._lock:                  # reached it, and wait for the next one
            lost, unread = [], []
            for entry in self._requests.values():
                if entry.sent_to == self._incarnation:
                    (lost if 0 < entry.number <= received else unread).append(entry)
            for entry in lost:
                del self._requests[entry.request.request_id]
            for entry in unread:
                entry.sent_to = None
            self._conn.close()
            self._conn = None
        logger.error("engine process %d %s: answering its %d request(s) and restarting it%s",
                     proc.pid, reason, len(lost), f"; {len(unread)} it never read wait for "
                     "the next one" if unread else "")
        message = f"the model process {reason}; it is being restarted, retry the request"
        now = time.monotonic()
        booked = [(e.request_id, None) for e in lost if e.last_words is not None]
        if booked:  # the worker ends them now: out of the guardian's book first
            self._guardian.sent([], booked)
        for entry in lost:
            _emit(entry, ErrorEvent(500, message))
            # its end, for the metrics: an error (what it got before is not known here)
            self._observe("RequestFinished", Finished(
                "error", None, None, now - entry.request.arrived_at, None, None, None), "")
        self._observe("WaitingRequests", 0, "count")
        self._observe("BusySlots", 0, "count")

    def _restart(self) -> None:
        for attempt in itertools.count():
            if self._stopping.is_set():
                return
            started = time.monotonic()
            try:
                self._launch()
            except Exception as exc:
                pause = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
                logger.exception("restarting the engine process failed; next attempt in %ds",
                                 pause)
                with self._lock:
                    self.down = down = f"{type(exc).__name__}: {exc}"
                    waiting = [r for r in self._requests.values() if r.sent_to is None]
                    for entry in waiting:
                        del self._requests[entry.request.request_id]
                for entry in waiting:
                    _emit(entry, ErrorEvent(503, f"the model could not be reloaded ({down}); "
                                            "retry later", pause))
                self._stopping.wait(pause)
                with self._lock:
                    self.down = None
                continue
            logger.info("engine process %d restarted in %.1fs", self.pid,
                        time.monotonic() - started)
            return

    def _send(self, conn: Connection, message: ToEngine) -> None:
        with self._send_lock:
            try:
                conn.send(message)
            except OSError:  # the process died: the reader answers for it
                pass

    def _send_request(self, conn: Connection, entry: _Request) -> None:
        """The request, numbered in the order the process reads them (`Board.received`).
        Not to a process that died meanwhile: `_died` found it unsent (number 0), and it
        waits for the next one."""
        with self._send_lock:
            if conn is not self._conn:
                return
            if conn is not self._numbering:
                self._numbering, self._sent = conn, 0
            self._sent += 1
            entry.number = self._sent
            try:
                conn.send(entry.request)
            except OSError:  # the process died: the reader answers for it
                pass


#: what `_receive(idle=_IDLE)` returns after a poll with nothing to read
_IDLE = object()


def _receive(conn: Connection, proc: BaseProcess, timeout_s: float | None = None,
             idle: object = None) -> FromEngine | None | object:
    """The next message, or None once the process is gone (or `timeout_s` passed); with
    `idle`, that object after one empty poll of POLL_S, so the caller can look around."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        ready = conn.poll(POLL_S)
        if not ready and idle is not None and proc.is_alive():
            return idle
        if ready or not proc.is_alive():
            if not ready and not conn.poll(0):
                return None
            try:
                return conn.recv()
            except (EOFError, OSError):
                return None
        if deadline is not None and time.monotonic() > deadline:
            logger.error("engine process %d sent nothing in %.0fs", proc.pid, timeout_s)
            return None


class RemoteTraceback(Exception):
    """The engine process's traceback, as text: the cause of the exception it sent."""

    def __str__(self) -> str:
        return self.args[0]


def _stop_process(proc: BaseProcess, timeout_s: float = 2) -> str:
    """Join the process (killing it if it lingers); how it ended, in words."""
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _emit(entry: _Request, event: Event) -> None:
    deliver([(entry, event)])
