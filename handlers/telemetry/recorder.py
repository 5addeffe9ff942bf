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

One thread calls `record` (the metrics reporter's); each call updates a few memory-mapped
floats under prometheus_client's lock, microseconds.
"""

from __future__ import annotations

import os
import time
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
        if name == "RequestFinished":
            self._finished(Finished(*value))
        elif name == "InterTokenLatency":
            itl = self._child("vllm:inter_token_latency_seconds")
            for seconds in value:
                itl.observe(seconds)
        elif name == "TimeToFirstToken":
            self._child("vllm:time_to_first_token_seconds").observe(value / 1000)
        elif name == "WaitingRequests":
            self._child("vllm:num_requests_waiting").set(value)
        elif name == "BusySlots":
            self._child("vllm:num_requests_running").set(value)
        elif name == "SpecDecode":
            spec = SpecDecode(*value)
            for family, amount in (("vllm:spec_decode_num_drafts", spec.drafts),
                                   ("vllm:spec_decode_num_draft_tokens", spec.draft_tokens),
                                   ("vllm:spec_decode_num_accepted_tokens", spec.accepted),
                                   ("vllm:spec_decode_num_emitted_tokens", spec.emitted)):
                self._child(family).inc(amount)

    def _finished(self, done: Finished) -> None:
        reason = done.reason if done.reason in FINISH_REASONS else "error"
        self._child("vllm:request_success", reason).inc()
        if done.prompt_tokens is not None:
            self._child("vllm:prompt_tokens").inc(done.prompt_tokens)
            self._child("vllm:request_prompt_tokens").observe(done.prompt_tokens)
        if done.generation_tokens is not None:
            self._child("vllm:generation_tokens").inc(done.generation_tokens)
            self._child("vllm:request_generation_tokens").observe(done.generation_tokens)
        for family, seconds in self._intervals(done):
            self._child(family).observe(seconds)

    @staticmethod
    def _intervals(done: Finished) -> Iterable[tuple[str, float]]:
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
