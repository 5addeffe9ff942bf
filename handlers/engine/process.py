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
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

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
from handlers.engine.start import EngineSpec, build_sequence, model_limits, start_engine
from handlers.errors import CapacityError

logger = logging.getLogger(__name__)


class Outbox:
    """Events and observations of the current step; `flush` sends them as one message."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
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
            except OSError:  # the worker is gone
                os._exit(0)

    def flush(self) -> None:
        with self._lock:
            if not self._texts and not self._finals and not self._observations:
                return
            message = StepOutputs(self._texts, self._finals, self._observations)
            self._texts, self._finals, self._observations = [], [], []
            try:  # under the lock: two threads flush (engine, commands); one send at a time
                self._conn.send(message)
            except OSError:  # the worker is gone: nobody is left to answer
                os._exit(0)


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
    serve(conn, engine, tokenizer, outbox)


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
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the worker died: this process must not outlive it
            os._exit(0)
        match message:
            case EngineRequest():
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
