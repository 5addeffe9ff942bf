import os
import time

from handlers.engine.core import Engine
from handlers.engine.scheduler import Scheduler
from handlers.torchserve.metrics import BUCKETS_MS, Histogram, MetricsReporter, worker_id
from tests.unit.fakes import CountingBackend
from tests.unit.test_engine import run, submit


def test_buckets_span_one_millisecond_to_a_minute():
    assert BUCKETS_MS[0] == 1 and BUCKETS_MS[-1] == 60_000
    assert list(BUCKETS_MS) == sorted(set(BUCKETS_MS))


def test_histogram_takes_cumulative_increments_with_every_bucket_the_first_time():
    h = Histogram()
    for value in (0.5, 1, 3, 70, 100_000):
        h.observe(value)
    first = {(suffix, le): v for suffix, le, v in h.take()}
    assert len(first) == len(BUCKETS_MS) + 3  # every bucket, +Inf, _sum, _count
    assert first[("_bucket", "1")] == 2  # le is inclusive
    assert first[("_bucket", "2.5")] == 2 and first[("_bucket", "5")] == 3
    assert first[("_bucket", "50")] == 3 and first[("_bucket", "100")] == 4
    assert first[("_bucket", "60000")] == 4 and first[("_bucket", "+Inf")] == 5
    assert first[("_sum", None)] == 100_074.5 and first[("_count", None)] == 5
    assert h.take() == []  # nothing new, nothing to add
    h.observe(20)
    assert h.take() == [("_bucket", le, 1) for le in
                        ("25", "50", "100", "250", "500", "1000", "2500", "5000", "10000",
                         "30000", "60000", "+Inf")] + [("_sum", None, 20), ("_count", None, 1)]


def test_worker_id_is_torchserve_s_worker_port():
    assert worker_id(["w.py", "--sock-type", "unix", "--sock-name", "/tmp/.ts.sock.9003"]) \
        == "9003"
    assert worker_id(["w.py", "--sock-type", "tcp", "--port", "9001"]) == "9001"
    assert worker_id(["python"]) == str(os.getpid())


def recorder():
    lines = []
    return lines, lambda name, unit, kind, value, labels: lines.append(
        (name, unit, kind, value, labels))


def test_reporter_aggregates_counters_and_sends_gauges_only_when_they_change():
    lines, emit = recorder()
    reporter = MetricsReporter(emit, "tiny", "9000")
    for value in (3, 4):
        reporter.observe("GeneratedTokens", value, "count")
    for value in (2, 1, 0):
        reporter.observe("WaitingRequests", value, "count")
    reporter.observe("TimeToFirstToken", 42.0, "ms")
    reporter.flush()
    assert ("GeneratedTokens", "count", "counter", 7, {"ModelName": "tiny"}) in lines
    assert [line for line in lines if line[0] == "WaitingRequests"] == [
        ("WaitingRequests", "count", "gauge", 0, {"ModelName": "tiny", "WorkerId": "9000"})]
    ttft = {line[4].get("le"): line[3] for line in lines if line[0] == "TimeToFirstToken_bucket"}
    assert ttft["25"] == 0 and ttft["50"] == 1 and ttft["+Inf"] == 1
    assert all(line[2] == "counter" for line in lines if line[0].startswith("TimeToFirst"))
    lines.clear()
    reporter.observe("WaitingRequests", 0, "count")
    reporter.flush()
    assert lines == []  # unchanged gauge, nothing observed


def test_reporter_thread_emits_off_the_caller_and_stops():
    lines, emit = recorder()
    reporter = MetricsReporter(emit, "tiny", "9000", interval_s=0.01).start()
    reporter.observe("EngineQueueTime", 7.0, "ms")
    reporter.stop()
    assert ("EngineQueueTime_count", "count", "counter", 1, {"ModelName": "tiny"}) in lines


class SpyRecorder:
    """Stands for handlers/telemetry/recorder.PrometheusRecorder: what it was handed."""

    def __init__(self) -> None:
        self.records: list[tuple] = []
        self.beats = 0

    def record_all(self, items) -> None:
        self.records += list(items)

    def heartbeat(self) -> None:
        self.beats += 1


def test_the_recorder_gets_every_observation_and_torchserve_only_its_own_names():
    lines, emit = recorder()
    spy = SpyRecorder()
    reporter = MetricsReporter(emit, "tiny", "9000", recorder=spy)
    finished = ("stop", 3, 4, 0.5, 0.0, 0.1, 0.4)
    reporter.observe("RequestFinished", finished, "")
    reporter.observe("InterTokenLatency", (0.01, 0.02), "s")
    reporter.observe("GeneratedTokens", 4, "count")
    reporter.flush()
    assert spy.records == [("RequestFinished", finished), ("InterTokenLatency", (0.01, 0.02)),
                           ("GeneratedTokens", 4)]
    assert [line[0] for line in lines] == ["GeneratedTokens"]  # the old names only


def test_an_idle_worker_still_beats(monkeypatch):
    import handlers.torchserve.metrics as metrics

    monkeypatch.setattr(metrics, "HEARTBEAT_S", 0.01)
    spy = SpyRecorder()
    reporter = MetricsReporter(recorder()[1], "tiny", "9000", recorder=spy).start()
    deadline = time.monotonic() + 10
    while spy.beats < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    reporter.stop()
    assert spy.beats >= 3  # with nothing observed


def test_engine_reports_waiting_and_busy_after_steps_only_on_change():
    backend = CountingBackend(batch_size=2)
    seen = []
    engine = Engine(backend, Scheduler(2), observer=lambda *a: seen.append(a))
    events: dict = {}
    for i in range(3):
        submit(engine, str(i), 100 * (i + 1), 4, events)
    engine.step()
    load = [(name, value) for name, value, _ in seen if name in ("WaitingRequests", "BusySlots")]
    assert load == [("WaitingRequests", 1), ("BusySlots", 2)]
    run(engine)
    load = [(name, value) for name, value, _ in seen if name in ("WaitingRequests", "BusySlots")]
    assert load[-2:] == [("WaitingRequests", 0), ("BusySlots", 0)]
    pairs = list(zip(load[::2], load[1::2], strict=True))
    assert all(a != b for a, b in zip(pairs, pairs[1:], strict=False))  # each one a change
