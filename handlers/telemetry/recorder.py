"""A worker's side of the server's /metrics: the engine's observations recorded under
vLLM's names (`catalog`), with prometheus_client in multiprocess mode.

Every worker of every model writes its values into memory-mapped files of one directory
(INF2SERVE_METRICS_DIR, which `inf2serve serve` and the Kubernetes export set); the router
reads them all when Prometheus scrapes (`exposition`). The files are named by the worker's
id (TorchServe's worker port, which a restarted worker keeps: handlers/torchserve/metrics.py
`worker_id`), not by its pid, so a restarted worker reopens them and its counters continue
where they stopped, and a directory holds a few files per worker however often workers
restart. prometheus_client reads the directory from PROMETHEUS_MULTIPROC_DIR when a value is
created, so the recorder sets that in this process only.

One thread records (the metrics reporter's, handlers/torchserve/metrics.py), a batch at a
time: what arrived over its interval, combined first -- a gauge's last value, a counter's
sum, one increment per histogram bucket that changed -- because each update of a
memory-mapped value costs microseconds (a lock, a pid check, a write; 17-20 us measured on a
loaded 2-core VM), which per token would be a few percent of a core at 32 streams.
"""

from __future__ import annotations

import bisect
import os
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from handlers.telemetry.catalog import (
    FAMILIES,
    FINISH_REASONS,
    MODEL_LABEL,
    Finished,
    SpecDecode,
    buckets_1_2_5,
)

#: the environment variable naming the directory the workers write to
METRICS_DIR_ENV = "INF2SERVE_METRICS_DIR"
#: seconds between a worker's heartbeats (the alert waits 30 s)
HEARTBEAT_S = 5.0
#: what the workers write (the router computes the rest when it reads the files)
WRITTEN = tuple(f for f in FAMILIES if f.source == "worker")


def metrics_dir() -> Path | None:
    value = os.environ.get(METRICS_DIR_ENV)
    return Path(value) if value else None


def _use_directory(directory: Path, worker: str) -> None:
    """Multiprocess mode into `directory`, files named by `worker` (digits: the collector
    splits file names at '_')."""
    from prometheus_client import values

    if not worker.isdigit():
        raise ValueError(f"worker id {worker!r}: digits expected (a port or a pid)")
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: worker)


class PrometheusRecorder:
    """One worker's metric values, labelled with its model's name."""

    def __init__(self, directory: Path, model: str, worker: str, slots: int,
                 max_length: int) -> None:
        _use_directory(directory, worker)
        from prometheus_client import Counter, Gauge, Histogram

        self.model, self.worker = model, worker
        kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
        self._metrics: dict[str, Any] = {}
        for family in WRITTEN:
            kwargs: dict[str, Any] = {"registry": None,
                                      "labelnames": (MODEL_LABEL, *family.labels)}
            if family.kind == "histogram":
                kwargs["buckets"] = family.buckets or buckets_1_2_5(max_length)
            elif family.kind == "gauge":
                kwargs["multiprocess_mode"] = family.mode
            self._metrics[family.name] = kinds[family.kind](family.name, family.doc, **kwargs)
        # every series exists from the first scrape, at 0; speculation's only once it runs
        # (a model without a draft has none, as in vLLM)
        for family in WRITTEN:
            if family.name.startswith("vllm:spec_decode"):
                continue
            if family.name == "vllm:request_success":
                for reason in FINISH_REASONS:
                    self._child(family.name, reason)
            elif not family.labels:
                self._child(family.name)
        self._child("inf2serve_slots").set(slots)
        # a (re)started worker holds no request: a dead predecessor's load is not ours
        self._child("vllm:num_requests_running").set(0)
        self._child("vllm:num_requests_waiting").set(0)
        self._last_beat = 0.0
        self.heartbeat()

    def _child(self, name: str, *labels: str) -> Any:
        return self._metrics[name].labels(self.model, *labels)

    def heartbeat(self, now: float | None = None) -> None:
        """This worker lives: `HEARTBEAT_S` apart at most (a cheap check otherwise)."""
        now = time.time() if now is None else now
        if now - self._last_beat >= HEARTBEAT_S:
            self._last_beat = now
            self._child("inf2serve_worker_heartbeat_timestamp_seconds", self.worker).set(now)

    def record(self, name: str, value: Any) -> None:
        """One engine observation (handlers/engine/core.py names them)."""
        self.record_all([(name, value)])

    def record_all(self, items: Iterable[tuple[str, Any]]) -> None:
        """A batch of engine observations, combined before they are written."""
        batch = _Batch()
        for name, value in items:
            batch.add(name, value)
        for (family, labels), value in batch.gauges.items():
            self._child(family, *labels).set(value)
        for (family, labels), amount in batch.counters.items():
            self._child(family, *labels).inc(amount)
        for family, values in batch.histograms.items():
            _observe_all(self._child(family), values)


class _Batch:
    """Observations combined per series: gauges (last), counters (sum), histograms (values)."""

    def __init__(self) -> None:
        self.gauges: dict[tuple[str, tuple[str, ...]], float] = {}
        self.counters: dict[tuple[str, tuple[str, ...]], float] = {}
        #: family -> (value, how many times) pairs
        self.histograms: dict[str, list[tuple[float, int]]] = {}

    def count(self, family: str, amount: float, *labels: str) -> None:
        key = (family, labels)
        self.counters[key] = self.counters.get(key, 0.0) + amount

    def observe(self, family: str, value: float, times: int = 1) -> None:
        self.histograms.setdefault(family, []).append((value, times))

    def add(self, name: str, value: Any) -> None:
        if name == "RequestFinished":
            self.finished(Finished(*value))
        elif name == "InterTokenLatency":  # a step's (seconds, how many) pairs
            self.histograms.setdefault("vllm:inter_token_latency_seconds", []).extend(value)
        elif name == "TimeToFirstToken":
            self.observe("vllm:time_to_first_token_seconds", value / 1000)
        elif name == "WaitingRequests":
            self.gauges[("vllm:num_requests_waiting", ())] = value
        elif name == "BusySlots":
            self.gauges[("vllm:num_requests_running", ())] = value
        elif name == "SpecDecode":
            spec = SpecDecode(*value)
            self.count("vllm:spec_decode_num_drafts", spec.drafts)
            self.count("vllm:spec_decode_num_draft_tokens", spec.draft_tokens)
            self.count("vllm:spec_decode_num_accepted_tokens", spec.accepted)
            self.count("vllm:spec_decode_num_emitted_tokens", spec.emitted)

    def finished(self, done: Finished) -> None:
        self.count("vllm:request_success", 1,
                   done.reason if done.reason in FINISH_REASONS else "error")
        if done.prompt_tokens is not None:
            self.count("vllm:prompt_tokens", done.prompt_tokens)
            self.observe("vllm:request_prompt_tokens", done.prompt_tokens)
        if done.generation_tokens is not None:
            self.count("vllm:generation_tokens", done.generation_tokens)
            self.observe("vllm:request_generation_tokens", done.generation_tokens)
        for family, seconds in _intervals(done):
            self.observe(family, seconds)


def _observe_all(histogram: Any, values: list[tuple[float, int]]) -> None:
    """`histogram.observe(v)` n times for each (v, n), as one increment per bucket and one of
    the sum. prometheus_client keeps a histogram's buckets non-cumulative (`_buckets[i]`
    counts the values whose first bound >= v lies at i, `_upper_bounds` ending in +Inf) and
    offers no batch call, so this reaches into those attributes; a client without them is
    served one value at a time."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value, times in values:
            for _ in range(times):
                histogram.observe(value)
        return
    counts: Counter[int] = Counter()
    for value, times in values:
        counts[bisect.bisect_left(bounds, value)] += times  # le is inclusive: first bound >= v
    for index, n in counts.items():
        buckets[index].inc(n)
    total.inc(sum(value * times for value, times in values))


def _intervals(done: Finished) -> Iterable[tuple[str, float]]:
    """vLLM's per-request interval histograms a finished request has values for."""
    yield "vllm:e2e_request_latency_seconds", done.e2e_s
    if done.queue_s is not None:
        yield "vllm:request_queue_time_seconds", done.queue_s
    if done.prefill_s is not None:
        yield "vllm:request_prefill_time_seconds", done.prefill_s
        if done.decode_s is not None:
            yield "vllm:request_decode_time_seconds", done.decode_s
            yield "vllm:request_inference_time_seconds", done.prefill_s + done.decode_s
            if done.generation_tokens and done.generation_tokens > 1:
                yield ("vllm:request_time_per_output_token_seconds",
                       done.decode_s / (done.generation_tokens - 1))
