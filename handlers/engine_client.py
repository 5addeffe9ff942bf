"""The TorchServe worker's side of the engine process: start it, relay, answer for it.

The worker keeps TorchServe's socket, the tokenizer and the HTTP framing; the engine
process (handlers/engine_process.py) holds the model. When that process dies -- SIGKILL,
the OOM killer, a Neuron runtime abort -- the pipe closes, and within one poll the
worker answers each request it had sent there with a 500 (an in-band error if the
stream had started) and starts a new one, which loads from the compile cache.
Requests arriving meanwhile wait for it, up to handler.max_queue; if it fails to load,
they get a 503 and the worker keeps retrying with a growing pause.

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
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from handlers import engine_process
from handlers.backends.base import Backend
from handlers.config import ModelConfig
from handlers.engine import Observer, deliver
from handlers.engine_process import ModelLimits
from handlers.errors import CapacityError, EngineProcessError
from handlers.neuron_cores import CoreClaim, available_cores, claim_cores
from handlers.scheduler import ErrorEvent, Event, Sequence, TextEvent
from handlers.service import EngineSpec

logger = logging.getLogger(__name__)

#: pauses between failed restarts, the last one repeating
RESTART_BACKOFF_S = (1, 2, 5, 10, 30, 60)
#: how often a reader with nothing to read checks that the process is alive; a forked
#: grandchild (a compiler) can keep the pipe open after the process itself died
POLL_S = 0.5


@dataclass(eq=False)
class _Request:
    seq: Sequence
    sent_to: int | None = None  # the engine process (incarnation) it went to; None: waiting


class EngineClient:
    """Has the engine's interface -- submit(seq), cancel(request_id), stop() -- for a
    Sequence whose model runs in the engine process; its sink gets the events."""

    def __init__(self, spec: EngineSpec, observer: Observer | None, capacity: int,
                 claim: CoreClaim | None = None) -> None:
        self.spec = spec
        self.limits: ModelLimits | None = None
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
        self._down: str | None = None  # why requests get a 503 now (a restart failed)
        self._stopping = threading.Event()

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

    # -- the engine's interface -------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        with self._lock:
            if self._down is not None:
                raise CapacityError(f"the model process is down ({self._down}) and is being "
                                    "restarted; retry later", retry_after_s=5)
            if len(self._requests) >= self._capacity:
                raise CapacityError(f"{len(self._requests)} requests are in flight (handler."
                                    f"batch_size + handler.max_queue = {self._capacity}); "
                                    "retry later or add workers")
            request = self._requests[seq.request_id] = _Request(seq)
            conn = self._conn
            if conn is not None:
                request.sent_to = self._incarnation
        if conn is not None:
            self._send(conn, _submit_message(seq))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return
            if request.sent_to is None:  # still waiting for a restarted process
                del self._requests[request_id]
            conn = self._conn if request.sent_to == self._incarnation else None
        if request.sent_to is None:
            _emit(request.seq, ErrorEvent(499, "cancelled"))
        elif conn is not None:  # else the dead process's requests are being answered
            self._send(conn, ("cancel", request_id))

    def stop(self, timeout_s: float = 10) -> None:
        """Stop the engine process; requests still in flight get a 503."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        with self._lock:
            conn, proc = self._conn, self._proc
        if conn is not None:
            self._send(conn, ("stop",))
        if proc is not None:
            _stop_process(proc, timeout_s)
        with self._lock:
            left = list(self._requests.values())
            self._requests.clear()
        for request in left:
            _emit(request.seq, ErrorEvent(503, "the worker is stopping; retry the request", 1))
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
        if message is None or message[0] != "ready":
            conn.close()
            reason = _stop_process(proc)
            if message is not None and message[0] == "failed":
                _, exc, text = message
                exc.add_note(f"raised in the engine process {proc.pid}:\n{text}")
                raise exc
            raise EngineProcessError(f"the engine process {proc.pid} {reason} before the "
                                     "model was loaded; its log lines are above")
        with self._lock:
            self._incarnation += 1
            self._proc, self._conn, self.limits, self.pid = proc, conn, message[1], proc.pid
            waiting = [r for r in self._requests.values() if r.sent_to is None]
            for request in waiting:
                request.sent_to = self._incarnation
        for request in waiting:
            self._send(conn, _submit_message(request.seq))

    def _supervise(self) -> None:
        """Relay the engine process's messages; answer for it and restart it when it dies."""
        while not self._stopping.is_set():
            with self._lock:
                conn, proc = self._conn, self._proc
            message = _receive(conn, proc)
            if message is not None:
                try:
                    self._deliver(message)
                except Exception:  # this thread must outlive anything a message can cause
                    logger.exception("relaying a message of the engine process failed")
            elif not self._stopping.is_set():
                self._died(proc)
                self._restart()

    def _deliver(self, message: tuple) -> None:
        """A step's events to their requests: one wake-up per event loop, not per event."""
        _, events, observations = message
        out = []
        with self._lock:
            for item in events:
                request = self._requests.get(item[0])
                if request is None:
                    continue
                if len(item) == 3:  # a TextEvent's fields (engine_process.Outbox)
                    event = TextEvent(item[1], item[2])
                else:  # the request's last event
                    event = item[1]
                    del self._requests[item[0]]
                out.append((request.seq, event))
        deliver(out)
        for observation in observations:
            self._observe(*observation)

    def _died(self, proc: BaseProcess) -> None:
        reason = _stop_process(proc)
        with self._lock:
            lost = [r for r in self._requests.values() if r.sent_to == self._incarnation]
            for request in lost:
                del self._requests[request.seq.request_id]
            self._conn.close()
            self._conn = None
        logger.error("engine process %d %s: answering its %d request(s) and restarting it",
                     proc.pid, reason, len(lost))
        message = f"the model process {reason}; it is being restarted, retry the request"
        for request in lost:
            _emit(request.seq, ErrorEvent(500, message))
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
                    self._down = f"{type(exc).__name__}: {exc}"
                    waiting = [r for r in self._requests.values() if r.sent_to is None]
                    for request in waiting:
                        del self._requests[request.seq.request_id]
                for request in waiting:
                    _emit(request.seq, ErrorEvent(503, f"the model could not be reloaded "
                                                  f"({self._down}); retry later", pause))
                self._stopping.wait(pause)
                with self._lock:
                    self._down = None
                continue
            logger.info("engine process %d restarted in %.1fs", self.pid,
                        time.monotonic() - started)
            return

    def _send(self, conn: Connection, message: tuple) -> None:
        with self._send_lock:
            try:
                conn.send(message)
            except OSError:  # the process died: the reader answers for it
                pass


def _submit_message(seq: Sequence) -> tuple:
    return ("submit", seq.request_id, seq.prompt_ids, seq.max_new_tokens, seq.sampling,
            seq.stop, seq.arrived_at, seq.deadline)  # time.monotonic(): one clock per host


def _receive(conn: Connection, proc: BaseProcess, timeout_s: float | None = None
             ) -> tuple | None:
    """The next message, or None once the process is gone (or `timeout_s` passed)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        ready = conn.poll(POLL_S)
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


def _emit(seq: Sequence, event: Event) -> None:
    try:
        seq.sink(event)
    except Exception:  # a broken sink must not stop other requests
        logger.exception("sink of request %s failed", seq.request_id)
