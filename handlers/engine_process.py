"""The engine process: scheduler, backend and model in a child of the TorchServe worker.

When a worker process dies, TorchServe 0.12's async frontend answers only the request
its worker thread was sending; every other request of that worker waits forever
(pytorch/serve@v0.12.0:frontend/server/src/main/java/org/pytorch/serve/wlm/
AsyncWorkerThread.java:144-147). So the model -- what an OOM kill or a Neuron runtime
abort takes down -- runs here, and the worker (handlers/engine_client.py) answers for it.

This side runs the same `Engine` as inline mode and talks to the worker over one
pipe, in pickled tuples:

  worker -> engine  ("submit", request_id, prompt_ids, max_new_tokens, sampling, stop,
                     arrived_at, deadline), ("cancel", request_id), ("stop",)
  engine -> worker  once ("ready", ModelLimits) or ("failed", exception, traceback);
                    then ("step", [(request_id, event) or (request_id, text, tokens), ...],
                    [(name, value, unit), ...])

A step message carries every event and metric observation of one engine step, so the
IPC cost is per step, not per token per sequence (vLLM's engine core batches its
outputs the same way). A TextEvent -- nearly every event -- travels as its fields:
pickling 32 frozen dataclasses and back measured ~80 us a step, their fields ~13 us.
Detokenization and stop strings stay with the sequence, here.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from handlers.errors import CapacityError
from handlers.scheduler import ErrorEvent, Event, Sequence, Sink, TextEvent

if TYPE_CHECKING:
    from handlers.service import EngineSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelLimits:
    """The loaded backend's limits, which the worker checks requests against."""

    batch_size: int
    max_length: int
    max_prompt_length: int | None


class Outbox:
    """Events and observations of the current step; `flush` sends them as one message."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._events: list[tuple[str, Event] | tuple[str, str, int]] = []
        self._observations: list[tuple[str, float, str]] = []

    def sink(self, request_id: str) -> Sink:
        def put(event: Event) -> None:
            item = ((request_id, event.text, event.tokens) if type(event) is TextEvent
                    else (request_id, event))
            with self._lock:
                self._events.append(item)
        return put

    def observe(self, name: str, value: float, unit: str) -> None:
        with self._lock:
            self._observations.append((name, value, unit))

    def flush(self) -> None:
        with self._lock:
            if not self._events and not self._observations:
                return
            message = ("step", self._events, self._observations)
            self._events, self._observations = [], []
            try:  # under the lock: two threads flush (engine, commands); one send at a time
                self._conn.send(message)
            except OSError:  # the worker is gone: nobody is left to answer
                os._exit(0)


def main(conn: Connection, spec: EngineSpec) -> None:
    """The process's entry point: load, say ready (or why not), then serve commands."""
    # the worker's own logging: TorchServe reads its stdout into the model log
    # (pytorch/serve@v0.12.0:ts/model_service_worker.py:282)
    logging.basicConfig(stream=sys.stdout, format="%(message)s", level=spec.log_level)
    from handlers.service import start_engine  # here: the worker side needs none of it

    outbox = Outbox(conn)
    try:
        engine, tokenizer = start_engine(spec, outbox.observe, outbox.flush)
    except BaseException as exc:
        logger.exception("engine process %d: loading the model failed", os.getpid())
        conn.send(("failed", _portable(exc), traceback.format_exc()))
        return
    b = engine.backend
    conn.send(("ready", ModelLimits(b.batch_size, b.max_length,
                                    getattr(b, "max_prompt_length", None))))
    serve(conn, engine, tokenizer, outbox)


def serve(conn: Connection, engine, tokenizer, outbox: Outbox) -> None:
    """Apply the worker's commands until it says stop or goes away."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the worker died: this process must not outlive it
            os._exit(0)
        kind = message[0]
        if kind == "submit":
            (_, request_id, prompt_ids, max_new_tokens, sampling, stop, arrived_at,
             deadline) = message
            sink = outbox.sink(request_id)
            seq = Sequence(request_id=request_id, prompt_ids=prompt_ids,
                           max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                           sink=sink, tokenizer=tokenizer, arrived_at=arrived_at,
                           deadline=deadline)
            try:
                engine.submit(seq)
            except CapacityError as exc:
                sink(ErrorEvent(503, str(exc), exc.retry_after_s))
        elif kind == "cancel":
            engine.cancel(message[1])
        elif kind == "stop":
            engine.stop()
            return
        if not conn.poll():  # answers to commands (503s, cancels) go out once none are queued
            outbox.flush()


def _portable(exc: BaseException) -> BaseException:
    """The exception itself if it survives pickling (the worker re-raises it), else its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
