"""The server's Prometheus metric families: vLLM's names, types, labels and meanings where
vLLM has the metric, so dashboards, alerts and autoscalers written for vLLM read this
server unchanged; `inf2serve_` names for what vLLM lacks. One source for the recorder, the
/metrics endpoint, the dashboard and docs/monitoring.md (a test holds them together).

vLLM's definitions: vllm-project/vllm@005a810b:vllm/v1/metrics/loggers.py (names, labels
`model_name`, the histograms' buckets, `build_1_2_5_buckets`), the finish reasons of
vllm/v1/engine/__init__.py:29-31 ("stop", "length", "abort", "error", "repetition"),
docs/design/metrics.md@0328b592 (`vllm:inter_token_latency_seconds`, which replaced
`vllm:time_per_output_token_seconds`; the intervals: queue = arrival to scheduled, prefill =
scheduled to first token, decode = first to last token, inference = prefill + decode) and
the speculative-decoding counters of vllm/v1/spec_decode/metrics.py@016a8587 (plus v0's
`num_emitted_tokens`). A counter's name here has no `_total`: prometheus_client adds it, as
it does for vLLM's.

Buckets keep every vLLM boundary, so a query or alert that names one (`le="2.5"`) means the
same here, and add finer ones below where this server's values fall (a CPU model's tokens
in milliseconds, a queue that is often empty).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

#: every family carries the served model's name, as vLLM's do
MODEL_LABEL = "model_name"
#: vllm:request_success's label values: vLLM's, plus "timeout" (a request's deadline passed
#: while it generated: it answers with the text it has, docs/request-api.md)
FINISH_REASONS = ("stop", "length", "abort", "error", "timeout")

_FINE = (0.001, 0.0025, 0.005, 0.0075)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = _FINE + (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1) + (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0)


class Finished(NamedTuple):
    """A request's end, as the engine observes it ("RequestFinished"): vLLM's per-request
    intervals, in seconds of one host's monotonic clock. None where the request never got
    there (an error while it waited has no prefill)."""

    reason: str  # FINISH_REASONS
    prompt_tokens: int | None
    generation_tokens: int | None  # delivered to the client
    e2e_s: float  # arrival in the worker to the end
    queue_s: float | None  # arrival to a slot
    prefill_s: float | None  # slot to the first token
    decode_s: float | None  # first token to the last


class SpecDecode(NamedTuple):
    """A speculative decode step's counts over its sequences ("SpecDecode")."""

    drafts: int  # one per sequence
    draft_tokens: int  # the draft's proposals: speculation length per sequence
    accepted: int  # proposals the target kept
    emitted: int  # tokens the step produced: accepted plus the target's own, per sequence


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's build_1_2_5_buckets), for token
    counts bounded by the model's max_length."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    doc: str
    labels: tuple[str, ...] = ()  # beside model_name
    #: seconds; None for a token-count histogram (1-2-5 up to the model's max_length)
    buckets: tuple[float, ...] | None = None
    #: prometheus_client's multiprocess mode for a gauge: how the workers' values combine
    mode: str = "sum"
    vllm: bool = True  # vLLM has this metric, with this meaning
    #: "worker": each worker records it (handlers/telemetry/recorder.py); "router": computed
    #: when /metrics is read (handlers/telemetry/exposition.py)
    source: str = "worker"
    per_model: bool = True  # labelled by model_name

    @property
    def exposed(self) -> str:
        """The name a query uses (a counter's samples end in _total)."""
        return self.name + "_total" if self.kind == "counter" else self.name


FAMILIES = (
    # load: gauges summed over a model's workers
    Family("vllm:num_requests_running", "gauge",
           "Number of requests in model execution batches (busy slots)."),
    Family("vllm:num_requests_waiting", "gauge",
           "Number of requests waiting to be processed (queued for a slot)."),
    Family("vllm:kv_cache_usage_perc", "gauge",
           "KV-cache usage: busy slots over slots, 1 means 100 percent (each slot holds one "
           "sequence's whole KV cache).", source="router"),
    # tokens and finished requests
    Family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
    Family("vllm:generation_tokens", "counter",
           "Number of generation tokens processed (those delivered to clients)."),
    Family("vllm:request_success", "counter",
           "Count of finished requests, by finish reason (stop, length, abort, error, "
           "timeout).", labels=("finished_reason",)),
    Family("vllm:request_prompt_tokens", "histogram",
           "Number of prefill tokens processed, per finished request."),
    Family("vllm:request_generation_tokens", "histogram",
           "Number of generation tokens processed, per finished request."),
    # latency
    Family("vllm:time_to_first_token_seconds", "histogram",
           "Histogram of time to first token in seconds (arrival in the worker to the first "
           "token).", buckets=TTFT_BUCKETS),
    Family("vllm:inter_token_latency_seconds", "histogram",
           "Histogram of inter-token latency in seconds (between a request's successive "
           "tokens).", buckets=TOKEN_LATENCY_BUCKETS),
    Family("vllm:request_time_per_output_token_seconds", "histogram",
           "Histogram of time per output token in seconds, per finished request (decode time "
           "over its tokens after the first).", buckets=TOKEN_LATENCY_BUCKETS),
    Family("vllm:e2e_request_latency_seconds", "histogram",
           "Histogram of e2e request latency in seconds (arrival in the worker to the last "
           "token).", buckets=REQUEST_LATENCY_BUCKETS),
    Family("vllm:request_queue_time_seconds", "histogram",
           "Histogram of time spent in WAITING phase for request (queued for a slot).",
           buckets=REQUEST_LATENCY_BUCKETS),
    Family("vllm:request_inference_time_seconds", "histogram",
           "Histogram of time spent in RUNNING phase for request (prefill and decode).",
           buckets=REQUEST_LATENCY_BUCKETS),
    Family("vllm:request_prefill_time_seconds", "histogram",
           "Histogram of time spent in PREFILL phase for request (slot to first token).",
           buckets=REQUEST_LATENCY_BUCKETS),
    Family("vllm:request_decode_time_seconds", "histogram",
           "Histogram of time spent in DECODE phase for request (first to last token).",
           buckets=REQUEST_LATENCY_BUCKETS),
    # speculative decoding (a model compiled with a draft, or the synthetic device's)
    Family("vllm:spec_decode_num_drafts", "counter",
           "Number of spec decoding drafts (one per sequence per speculative step)."),
    Family("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens."),
    Family("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens."),
    Family("vllm:spec_decode_num_emitted_tokens", "counter",
           "Number of emitted tokens (accepted plus the target's own, those a request's "
           "end dropped included)."),
    # what vLLM lacks
    Family("inf2serve_slots", "gauge",
           "Slots (sequences generating at once) of the model's running workers.", vllm=False),
    Family("inf2serve_worker_heartbeat_timestamp_seconds", "gauge",
           "When a worker last reported, in seconds since the epoch (every few seconds while "
           "it lives).", labels=("worker",), mode="max", vllm=False),
    Family("inf2serve_upstream_up", "gauge",
           "Whether an exporter beside the server answered this scrape (upstream: "
           "torchserve, neuron-monitor): 1 yes, 0 no.", labels=("upstream",), vllm=False,
           source="router", per_model=False),
)

BY_NAME = {f.name: f for f in FAMILIES}
#: every sample name a query can use, by family (histograms' _bucket/_sum/_count)
SAMPLE_NAMES = {
    f.name: ({f.name + s for s in ("_bucket", "_sum", "_count")} if f.kind == "histogram"
             else {f.exposed})
    for f in FAMILIES}
