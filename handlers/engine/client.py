"""The TorchServe worker's side of the engine process: start it, relay, answer for it.

The worker keeps TorchServe's socket, the tokenizer and the HTTP framing; the engine
process (handlers/engine/process.py) holds the model. When that process dies -- SIGKILL,
the OOM killer, a Neuron runtime abort -- the pipe closes, and within one poll the
worker answers each request it had sent there with a 500 (an in-band error if the
stream had started) and starts a new one, which loads from the compile cache.
Requests arriving meanwhile wait for it, up to handler.max_queue; if it fails to load,
they get a 503 and the worker keeps retrying with a growing pause.

A process can also stop without dying: SIGSTOP, a wedged runtime, a device call that
never returns. Its heartbeat (handlers/engine/messages.Heartbeat, every HEARTBEAT_S
from its own thread) says how long the engine has been in its current step; while the
worker has requests there, a process silent for SILENT_S, or whose step has run past
handler.step_timeout_s, is killed and handled as a death: its requests are answered
with a 500 and it restarts.

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

The worker can die too. `hand_over` gives each engine process a duplicate of TorchServe's
socket, and each request goes with its `LastWords` (set in `LAST_WORDS` around `submit`):
when the worker dies, the engine process answers for it on that socket
(handlers/engine/process.Farewell), then exits.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import signal
import socket
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import send_handle
from pathlib import Path

from handlers.backends.base import Backend
from handlers.backends.neuron_cores import CoreClaim, available_cores, claim_cores
from handlers.config import ModelConfig
from handlers.engine import process as engine_process
from handlers.engine.core import Observer, QueueSink
from handlers.engine.messages import (
    SILENT_S,
    Cancel,
    EngineRequest,
    FromEngine,
    FrontendSocket,
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
    last_words: LastWords | None = None  # sent with it, where the socket was handed over


class EngineClient:
    """The `EngineHandle` of handler.engine_process child: submit(request, sink),
    cancel(request_id), stop() for a model that runs in the engine process."""

    def __init__(self, spec: EngineSpec, observer: Observer | None, capacity: int,
                 claim: CoreClaim | None = None) -> None:
        self.spec = spec
        self.limits: ModelLimits  # the loaded model's, once `_launch` has one
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
        # the watchdog's (the supervising thread's own): when the process was last heard
        # from, and how long its engine had then been in one step
        self._heard = time.monotonic()
        self._busy_s = 0.0
        self._step_timeout_s = spec.config.handler.effective_step_timeout_s
        #: TorchServe's socket and closing message, once handed over (`hand_over`)
        self._frontend: tuple[socket.socket, bytes] | None = None

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
            entry = self._requests[request.request_id] = _Request(request, sink,
                                                                  last_words=words)
            conn = self._conn
            if conn is not None:
                entry.sent_to = self._incarnation
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
        if entry.sent_to is None:
            _emit(entry, ErrorEvent(499, "cancelled"))
        elif conn is not None:  # else the dead process's requests are being answered
            self._send(conn, Cancel(request_id))

    def hand_over(self, sock: socket.socket, closing: bytes) -> None:
        """Give this engine process, and each one after it, a duplicate of TorchServe's socket
        to the frontend: if the worker dies, the engine process answers its requests there
        (their `LastWords`, then `closing`) and closes it. Only once the worker is gone: while
        it lives, it alone writes."""
        with self._lock:
            self._frontend = (sock, closing)
            conn, proc = self._conn, self._proc
        if conn is not None:
            self._send_socket(conn, proc.pid, self._frontend)

    def stop(self, timeout_s: float = 10) -> None:
        """Stop the engine process; requests still in flight get a 503."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        with self._lock:
            conn, proc = self._conn, self._proc
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

    # -- the engine process -----------------------------------------------------------
    def _launch(self) -> None:
        """Start an engine process, wait for its model, send it the requests that waited."""
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=engine_process.main, args=(child_conn, self.spec),
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
        self._heard, self._busy_s = time.monotonic(), 0.0  # a new process: heard just now
        with self._lock:
            self._incarnation += 1
            self._proc, self._conn, self.limits, self.pid = proc, conn, message.limits, proc.pid
            waiting = [r for r in self._requests.values() if r.sent_to is None]
            for entry in waiting:
                entry.sent_to = self._incarnation
            frontend = self._frontend
        if frontend is not None:  # before the requests, so their last words are kept
            self._send_socket(conn, proc.pid, frontend)
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
                    self._heard, self._busy_s = time.monotonic(), message.busy_s
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
        """Why the engine process counts as hung, or None: only while it holds requests."""
        with self._lock:
            holding = any(r.sent_to == self._incarnation for r in self._requests.values())
        if not holding:
            return None
        silent = now - self._heard
        if silent > SILENT_S:
            return (f"sent nothing for {silent:.1f}s (stopped or wedged; a live one says so "
                    "every second)")
        if self._busy_s > self._step_timeout_s:
            return (f"spent {self._busy_s:.0f}s in one step, past handler.step_timeout_s "
                    f"{self._step_timeout_s:g}")
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
        text of this step precedes its end): one wake-up per event loop, not per event."""
        out: list[tuple[_Request, Event]] = []
        with self._lock:
            requests = self._requests
            for request_id, text, tokens in step.texts:
                entry = requests.get(request_id)
                if entry is not None:  # else answered already (the process died, a stop)
                    out.append((entry, TextEvent(text, tokens)))
            for request_id, event in step.finals:
                entry = requests.pop(request_id, None)
                if entry is not None:
                    out.append((entry, event))
        _deliver_all(out)
        for observation in step.observations:
            self._observe(*observation)

    def _died(self, proc: BaseProcess, hung: str | None = None) -> None:
        if hung is not None:  # a stopped process cannot exit: kill it, then it is a death
            logger.error("engine process %d %s: killing it", proc.pid, hung)
            proc.kill()
        reason = _stop_process(proc)
        if hung is not None:
            reason = f"hung ({hung})"
        with self._lock:
            lost = [r for r in self._requests.values() if r.sent_to == self._incarnation]
            for entry in lost:
                del self._requests[entry.request.request_id]
            self._conn.close()
            self._conn = None
        logger.error("engine process %d %s: answering its %d request(s) and restarting it",
                     proc.pid, reason, len(lost))
        message = f"the model process {reason}; it is being restarted, retry the request"
        now = time.monotonic()
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
        """The request, after its last words (one lock: nothing comes between them)."""
        with self._send_lock:
            try:
                if entry.last_words is not None:
                    conn.send(entry.last_words)
                conn.send(entry.request)
            except OSError:  # the process died: the reader answers for it
                pass

    def _send_socket(self, conn: Connection, pid: int,
                     frontend: tuple[socket.socket, bytes]) -> None:
        """`FrontendSocket`, then the socket's fd itself (SCM_RIGHTS), nothing between."""
        sock, closing = frontend
        with self._send_lock:
            try:
                conn.send(FrontendSocket(closing))
                send_handle(conn, sock.fileno(), pid)
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


def _deliver_all(items: list[tuple[_Request, Event]]) -> None:
    """Events to their requests' sinks, in order; QueueSinks grouped by event loop, so a
    step wakes each loop once (handlers/engine.deliver does the same for sequences)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[QueueSink, Event]]] = {}
    for entry, event in items:
        if isinstance(entry.sink, QueueSink):
            by_loop.setdefault(entry.sink.loop, []).append((entry.sink, event))
        else:
            _emit(entry, event)
    for loop, group in by_loop.items():
        try:
            QueueSink.put_all(loop, group)
        except RuntimeError:  # its loop is closed: nobody is left to read these
            logger.warning("dropped %d events for a closed event loop", len(group))


def _emit(entry: _Request, event: Event) -> None:
    try:
        entry.sink(event)
    except Exception:  # a broken sink must not stop other requests
        logger.exception("sink of request %s failed", entry.request.request_id)
