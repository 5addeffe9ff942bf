"""Worker metrics for TorchServe 0.12's Prometheus endpoint, aggregated off the engine thread.

TorchServe 0.12 builds every histogram with the Prometheus client's default buckets,
0.005 to 10, and has no setting to change them (pytorch/serve@v0.12.0:frontend/server/
src/main/java/org/pytorch/serve/metrics/format/prometheous/PrometheusHistogram.java:14-20),
so every millisecond value landed in +Inf. A histogram here is therefore exported
as the series a Prometheus histogram consists of, each a TorchServe counter:
NAME_bucket{le="..."} (cumulative, 1 ms to 60 s), NAME_sum and NAME_count, which is
what `histogram_quantile` reads. Gauges carry a WorkerId label, because a gauge is
set, not added, and each worker of a model sets its own.

The engine thread only calls `observe` (a queue put). A daemon thread aggregates what
arrived over `interval_s` and emits one counter increment per changed series, so a
burst of requests costs a few metric lines, not a few per request.

These TorchServe names are deprecated: the server's metrics under vLLM's names
(handlers/telemetry) are recorded by the same thread, into the directory the router's
/metrics reads (docs/monitoring.md), and the thread beats a heartbeat there every few
seconds while the worker lives. The names above go in the next release.
"""

from __future__ import annotations

import bisect
import logging
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from handlers.telemetry.recorder import HEARTBEAT_S, PrometheusRecorder, metrics_dir

logger = logging.getLogger(__name__)

#: bucket upper bounds, ms: 1 ms to 60 s
BUCKETS_MS = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)
#: what each name the engine observes is exported as
KINDS = {"TimeToFirstToken": "histogram", "EngineQueueTime": "histogram",
         "GeneratedTokens": "counter", "DeviceTokens": "counter", "WaitingRequests": "gauge",
         "BusySlots": "gauge"}

#: emit(name, unit, kind ("counter" | "gauge"), value, labels)
Emit = Callable[[str, str, str, float, dict[str, str]], None]


def _le(bound: float) -> str:
    return format(bound, "g")


class Histogram:
    """Observations since the last `take`, as increments of cumulative bucket counters."""

    def __init__(self, buckets: Sequence[float] = BUCKETS_MS) -> None:
        self.bounds = tuple(buckets)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._fresh = True

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1  # le is inclusive
        self._sum += value

    def take(self) -> list[tuple[str, str | None, float]]:
        """(suffix, le, increment) for every series that changed; on the first call every
        bucket, zeros included, so each series exists from the first scrape."""
        out: list[tuple[str, str | None, float]] = []
        running = 0
        for i, count in enumerate(self._counts):
            running += count
            if running or self._fresh:
                le = _le(self.bounds[i]) if i < len(self.bounds) else "+Inf"
                out.append(("_bucket", le, running))
        if running or self._fresh:
            out += [("_sum", None, self._sum), ("_count", None, running)]
        self._counts = [0] * len(self._counts)
        self._sum, self._fresh = 0.0, False
        return out


#: a worker that took a dead one's socket over is that worker (handlers/torchserve/takeover.py)
WORKER_ID_ENV = "INF2SERVE_WORKER_ID"


def worker_id(argv: Sequence[str] | None = None) -> str:
    """The TorchServe worker's port (`--sock-name .../.ts.sock.9000` or `--port 9000`), which
    a restarted worker keeps (WorkerLifeCycle.java:169-172, WorkerThread.java:540-555), or
    the one a worker that took the socket over was given (WORKER_ID_ENV); the process id
    where there is none."""
    if argv is None and os.environ.get(WORKER_ID_ENV):
        return os.environ[WORKER_ID_ENV]
    argv = sys.argv if argv is None else argv
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag in ("--sock-name", "--port"):
            found = re.search(r"(\d+)$", value)
            if found:
                return found.group(1)
    return str(os.getpid())


def recorder_for(model: str, worker: str, slots: int, max_length: int
                 ) -> PrometheusRecorder | None:
    """The worker's recorder of vLLM-named metrics, where the server collects them
    (INF2SERVE_METRICS_DIR); None without one, or if it cannot start (logged: metrics must
    never stop a worker from serving)."""
    directory = metrics_dir()
    if directory is None:
        return None
    try:
        return PrometheusRecorder(directory, model, worker, slots, max_length)
    except Exception:
        logger.exception("the metrics of %s cannot be recorded in %s", model, directory)
        return None


class MetricsReporter:
    """The engine's observer: `observe` queues, a daemon thread aggregates and emits."""

    def __init__(self, emit: Emit, model: str, worker: str, interval_s: float = 0.5,
                 recorder: PrometheusRecorder | None = None) -> None:
        self._emit, self.interval_s, self.recorder = emit, interval_s, recorder
        self._labels = {"ModelName": model}
        self._gauge_labels = {"ModelName": model, "WorkerId": worker}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._histograms: dict[str, Histogram] = {}
        self._gauges: dict[str, float] = {}
        self._thread: threading.Thread | None = None

    def observe(self, name: str, value: Any, unit: str) -> None:
        self._queue.put((name, value, unit))

    def start(self) -> MetricsReporter:
        self._thread = threading.Thread(target=self._run, name="inf2serve-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                self._beat()
                continue
            time.sleep(self.interval_s)  # let a burst gather
            try:
                if not self.flush([first]):
                    return
            except Exception:  # metrics must never take the worker down
                logger.exception("emitting metrics failed")
            self._beat()

    def _beat(self) -> None:
        if self.recorder is not None:
            try:
                self.recorder.heartbeat()
            except Exception:
                logger.exception("the metrics heartbeat failed")

    def flush(self, items: list | None = None) -> bool:
        """Aggregate `items` and whatever is queued, emit; False once stop was asked."""
        items = list(items or [])
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        counters: dict[tuple[str, str], float] = {}
        gauges: dict[str, float] = {}
        if self.recorder is not None:  # one batch: each write costs microseconds
            self.recorder.record_all((item[0], item[1]) for item in items if item is not None)
        for item in items:
            if item is None:
                continue
            name, value, unit = item
            kind = KINDS.get(name)  # None: a name only the recorder knows
            if kind is None:
                continue
            if kind == "histogram":
                self._histograms.setdefault(name, Histogram()).observe(value)
            elif kind == "gauge":
                gauges[name] = value
            else:
                counters[(name, unit)] = counters.get((name, unit), 0) + value
        for name, histogram in self._histograms.items():
            for suffix, le, value in histogram.take():
                labels = self._labels if le is None else {**self._labels, "le": le}
                self._emit(name + suffix, "count" if suffix == "_count" else "ms", "counter",
                           value, labels)
        for (name, unit), value in counters.items():
            self._emit(name, unit, "counter", value, self._labels)
        for name, value in gauges.items():
            if self._gauges.get(name) != value:
                self._gauges[name] = value
                self._emit(name, "count", "gauge", value, self._gauge_labels)
        return None not in items
