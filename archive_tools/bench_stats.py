"""Records, scenarios and summaries for `inf2serve bench`, in pure Python.

Free of numpy, HTTP and I/O so that every number in a report can be checked on
known data in milliseconds. Percentiles use linear interpolation between the
closest ranks (Hyndman & Fan type 7, numpy's default), so they match what a
reader computes by hand or with `numpy.percentile`.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import cached_property

from handlers.errors import Inf2ServeError

MODES = ("sync", "concurrency", "rate")


class BenchError(Inf2ServeError):
    """A benchmark cannot run as asked (bad URL, token, prompts or scenario)."""


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no data."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside 0..100")
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass(frozen=True)
class Dist:
    """p50/p90/p99 and mean of one latency, in seconds (None when nothing was measured)."""

    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None
    count: int

    @classmethod
    def of(cls, values: list[float]) -> Dist:
        return cls(percentile(values, 50), percentile(values, 90), percentile(values, 99),
                   statistics.fmean(values) if values else None, len(values))


@dataclass
class RequestRecord:
    """What one request did; times are seconds, offsets are from the scenario start."""

    index: int
    scheduled_s: float  # when it was due (open loop) or handed to a worker (closed loop)
    start_s: float  # when it was actually sent
    status: int  # HTTP status; 0 when no response arrived (connect error, timeout)
    ttft_s: float | None = None  # until the first non-empty text line
    e2e_s: float | None = None  # until the last byte, or until the error
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive text lines
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error_kind: str | None = None  # "503", "400", "stream_error", "timeout", ...; None = ok
    error: str | None = None  # the server's message or the exception, for the JSON report
    stream: int | None = None  # the closed-loop stream (client) that sent it; None: open loop

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def itl_mean_s(self) -> float | None:
        return statistics.fmean(self.itl_s) if self.itl_s else None


@dataclass(frozen=True)
class Scenario:
    """One load shape: `level` is the concurrency (sync: 1) or the arrival rate in req/s.

    Exactly one bound: `requests` (how many to send) or `duration_s` (stop sending then).
    """

    mode: str
    level: float
    requests: int | None = None
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise BenchError(f"mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if not self.level > 0:
            raise BenchError(f"{self.mode} level {self.level} must be > 0")
        if self.mode == "concurrency" and self.level != int(self.level):
            raise BenchError(f"concurrency {self.level} must be a whole number")
        if (self.requests is None) == (self.duration_s is None):
            raise BenchError("give exactly one of --requests N or --duration S")
        if self.requests is not None and self.requests < 1:
            raise BenchError(f"--requests {self.requests} must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise BenchError(f"--duration {self.duration_s} must be > 0 seconds")

    @property
    def name(self) -> str:
        if self.mode == "sync":
            return "sync"
        if self.mode == "concurrency":
            return f"c={int(self.level)}"
        return f"rate={self.level:g}/s"


@dataclass(frozen=True)
class Summary:
    """The per-scenario numbers of the report table."""

    requests: int
    ok: int
    errors: int
    errors_by_kind: dict[str, int]
    ttft: Dist
    itl: Dist  # all line gaps of all successful requests pooled
    itl_request_mean: Dist  # distribution of each request's mean gap
    e2e: Dist
    wall_s: float
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    cost_per_1m_output_tokens: float | None


def cost_per_million(output_tokens_per_s: float, price_per_hour: float | None) -> float | None:
    """USD per 1M output tokens when the instance costs `price_per_hour` and runs at this rate."""
    if price_per_hour is None or output_tokens_per_s <= 0:
        return None
    return price_per_hour / 3600 / output_tokens_per_s * 1e6


def host_efficiency(output_tokens_per_s: float, streams: int, step_ms: float) -> float:
    """Served tokens/s over what a device of this decode step allows: `streams` rows, one
    token each per step (the device-bound limit, streams / step time)."""
    if not streams > 0 or not step_ms > 0:
        raise BenchError(f"host efficiency needs streams > 0 and a step > 0 ms, got {streams} "
                         f"and {step_ms}")
    return output_tokens_per_s * step_ms / 1000 / streams


def busy_tokens_per_s(records: list[RequestRecord]) -> float:
    """Closed-loop streams' tokens/s while each had work, summed: every stream's generated
    tokens over the time from its first request's send to its last one's end.

    A closed loop hands out a fixed number of requests; once the last is handed out, the
    streams end one by one and the device runs ever fewer rows until the last request ends.
    When requests take different times (speculative decoding's accepted drafts vary per
    row), that drain is a request's length long and counts against the whole run's
    tokens/s, though no host work is in it. A stream's own time still holds everything the
    host costs it: the idle gap between its requests, every late step. On a device whose
    step does not get shorter with fewer rows (the synthetic device's speculation cells),
    the sum is what the streams would get with work never running out. 0.0 without
    records from a closed loop."""
    spans: dict[int, list[float]] = {}
    tokens: dict[int, int] = {}
    for r in records:
        if r.stream is None or not r.ok or r.e2e_s is None:
            continue
        span = spans.setdefault(r.stream, [r.start_s, r.start_s + r.e2e_s])
        span[0], span[1] = min(span[0], r.start_s), max(span[1], r.start_s + r.e2e_s)
        tokens[r.stream] = tokens.get(r.stream, 0) + (r.completion_tokens or 0)
    return sum(tokens[s] / (end - start) for s, (start, end) in spans.items() if end > start)


def summarize(records: list[RequestRecord], wall_s: float,
              price_per_hour: float | None = None) -> Summary:
    """Latency percentiles over successful requests; throughput over the scenario's wall time."""
    good = [r for r in records if r.ok]
    tokens = sum(r.completion_tokens or 0 for r in good)
    rps = len(good) / wall_s if wall_s > 0 else 0.0
    tps = tokens / wall_s if wall_s > 0 else 0.0
    return Summary(
        requests=len(records), ok=len(good), errors=len(records) - len(good),
        errors_by_kind=dict(sorted(Counter(r.error_kind for r in records if not r.ok).items())),
        ttft=Dist.of([r.ttft_s for r in good if r.ttft_s is not None]),
        itl=Dist.of([gap for r in good for gap in r.itl_s]),
        itl_request_mean=Dist.of([r.itl_mean_s for r in good if r.itl_mean_s is not None]),
        e2e=Dist.of([r.e2e_s for r in good if r.e2e_s is not None]),
        wall_s=wall_s, requests_per_s=rps, output_tokens=tokens, output_tokens_per_s=tps,
        cost_per_1m_output_tokens=cost_per_million(tps, price_per_hour),
    )


@dataclass
class ScenarioResult:
    """Raw records of one scenario run; the summary is derived, so it never disagrees."""

    label: str
    scenario: Scenario
    records: list[RequestRecord]
    wall_s: float
    price_per_hour: float | None = None

    @cached_property
    def summary(self) -> Summary:
        return summarize(self.records, self.wall_s, self.price_per_hour)

    def to_dict(self) -> dict:
        return {"label": self.label, "scenario": asdict(self.scenario),
                "scenario_name": self.scenario.name, "wall_s": self.wall_s,
                "price_per_hour": self.price_per_hour, "summary": asdict(self.summary),
                "records": [asdict(r) for r in self.records]}

    @classmethod
    def from_dict(cls, data: dict) -> ScenarioResult:
        return cls(label=data["label"], scenario=Scenario(**data["scenario"]),
                   records=[RequestRecord(**r) for r in data["records"]],
                   wall_s=data["wall_s"], price_per_hour=data.get("price_per_hour"))
