"""bench_stats: percentiles, summaries and scenario checks on known data."""

from __future__ import annotations

import random
import statistics

import pytest

from archive_tools.bench_stats import (
    BenchError,
    Dist,
    RequestRecord,
    Scenario,
    ScenarioResult,
    cost_per_million,
    percentile,
    summarize,
)


def test_percentile_known_values():
    data = [float(x) for x in range(1, 11)]  # 1..10
    assert percentile(data, 0) == 1.0
    assert percentile(data, 50) == pytest.approx(5.5)
    assert percentile(data, 90) == pytest.approx(9.1)
    assert percentile(data, 99) == pytest.approx(9.91)
    assert percentile(data, 100) == 10.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0  # unsorted input


def test_percentile_matches_statistics_inclusive_method():
    rng = random.Random(7)
    data = [rng.expovariate(1.0) for _ in range(101)]
    expected = statistics.quantiles(data, n=100, method="inclusive")
    for q in (1, 25, 50, 90, 99):
        assert percentile(data, q) == pytest.approx(expected[q - 1])


def test_percentile_rejects_out_of_range_q():
    with pytest.raises(ValueError, match="outside 0..100"):
        percentile([1.0], 101)


def _ok(i: int, ttft: float, e2e: float, itl: list[float], tokens: int) -> RequestRecord:
    return RequestRecord(index=i, scheduled_s=0.0, start_s=0.0, status=200, ttft_s=ttft,
                         e2e_s=e2e, itl_s=itl, prompt_tokens=30, completion_tokens=tokens,
                         finish_reason="length")


def _records() -> list[RequestRecord]:
    return [
        _ok(0, 0.1, 1.0, [0.1, 0.3], 10),
        _ok(1, 0.3, 2.0, [0.2], 20),
        RequestRecord(index=2, scheduled_s=0, start_s=0, status=503, e2e_s=0.01,
                      error_kind="503", error="full"),
        RequestRecord(index=3, scheduled_s=0, start_s=0, status=400, e2e_s=0.01,
                      error_kind="400", error="bad"),
    ]


def test_summarize_known_data():
    s = summarize(_records(), wall_s=2.0, price_per_hour=3.6)
    assert (s.requests, s.ok, s.errors) == (4, 2, 2)
    assert s.errors_by_kind == {"400": 1, "503": 1}
    assert s.ttft.p50 == pytest.approx(0.2) and s.ttft.count == 2  # errors excluded
    assert s.e2e.p90 == pytest.approx(1.9)
    assert s.itl.count == 3 and s.itl.p50 == pytest.approx(0.2)  # pooled gaps 0.1, 0.2, 0.3
    assert s.itl_request_mean.mean == pytest.approx(0.2)  # means 0.2 and 0.2
    assert s.output_tokens == 30
    assert s.output_tokens_per_s == pytest.approx(15.0)
    assert s.requests_per_s == pytest.approx(1.0)
    # 3.6 $/h = 0.001 $/s; 15 tok/s -> 1M tokens take 66,667 s -> $66.67
    assert s.cost_per_1m_output_tokens == pytest.approx(66.6667, rel=1e-4)


def test_summarize_all_failed_has_no_latencies():
    s = summarize(_records()[2:], wall_s=1.0, price_per_hour=1.0)
    assert s.ok == 0 and s.ttft == Dist(None, None, None, None, 0)
    assert s.output_tokens_per_s == 0 and s.cost_per_1m_output_tokens is None


def test_cost_per_million():
    assert cost_per_million(100.0, None) is None
    assert cost_per_million(0.0, 1.0) is None
    assert cost_per_million(1e6 / 3600, 2.0) == pytest.approx(2.0)


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "burst", "level": 1, "requests": 1}, "choose one of"),
    ({"mode": "rate", "level": 0, "requests": 1}, "must be > 0"),
    ({"mode": "concurrency", "level": 2.5, "requests": 1}, "whole number"),
    ({"mode": "sync", "level": 1}, "exactly one"),
    ({"mode": "sync", "level": 1, "requests": 3, "duration_s": 1.0}, "exactly one"),
    ({"mode": "sync", "level": 1, "requests": 0}, ">= 1"),
])
def test_scenario_rejects_bad_shapes(kwargs, match):
    with pytest.raises(BenchError, match=match):
        Scenario(**kwargs)


def test_scenario_names_and_roundtrip():
    assert Scenario("sync", 1, requests=1).name == "sync"
    assert Scenario("concurrency", 5, requests=1).name == "c=5"
    assert Scenario("rate", 0.5, duration_s=3).name == "rate=0.5/s"
    result = ScenarioResult("micro", Scenario("concurrency", 5, requests=4), _records(), 2.0, 3.6)
    back = ScenarioResult.from_dict(result.to_dict())
    assert back.summary == result.summary and back.scenario == result.scenario


def test_host_efficiency_against_the_device_bound_limit():
    from archive_tools.bench_stats import host_efficiency

    # 32 streams at 10 ms steps allow 3200 tokens/s
    assert host_efficiency(3200.0, 32, 10.0) == pytest.approx(1.0)
    assert host_efficiency(2624.0, 32, 10.0) == pytest.approx(0.82)
    assert host_efficiency(176.0, 1, 5.0) == pytest.approx(0.88)
    with pytest.raises(BenchError, match="step > 0 ms"):
        host_efficiency(100.0, 8, 0)


def test_device_bench_reports_the_published_presets_bf16_beside_int8():
    """`make bench-device`'s preset cells: each preset's batch-8 step is the published one,
    and the summary puts bf16 Llama-2-7B and int8 Llama-3-8B side by side."""
    from bench.device_bound import (
        PRESET_STREAMS,
        PRESETS,
        DeviceBound,
        preset_step_ms,
        summary_section,
    )

    assert preset_step_ms("llama-2-7b-tp24") == pytest.approx(12.1)
    assert preset_step_ms("llama-3-8b-int8-tp24") == pytest.approx(10.45)
    dev = DeviceBound((), (), 3, lateness={
        "target_ms": 5.0, "samples": 1, "device_step": dict.fromkeys(
            ("median_us", "mean_us", "p99_us", "max_us"), 1.0),
        "time_sleep": dict.fromkeys(("median_us", "mean_us", "p99_us", "max_us"), 1.0)})
    for p in PRESETS:
        for c in PRESET_STREAMS:
            dev.preset_cells[p, c] = [(0.9, 80.0 * c, 12.5), (0.95, 85.0 * c, 12.0),
                                      (0.8, 70.0 * c, 13.0)]
    text = summary_section(dev)
    assert "| llama-2-7b-tp24 (12.10 ms) | 80 tok/s, gap 12.50 ms, efficiency **0.900**" in text
    assert "| llama-3-8b-int8-tp24 (10.45 ms) |" in text
    assert dev.meta()["presets"]["llama-3-8b-int8-tp24 x 8"]["step_ms"] == 10.45


def test_device_bench_reports_speculation_beside_the_plain_step():
    from bench.device_bound import SPEC_STREAMS, DeviceBound, speculation_bound, summary_section

    assert speculation_bound(False) == (10.0, 1.0)
    call_ms, per_call = speculation_bound(True)
    assert call_ms == 14.0 and per_call == pytest.approx(2.77, abs=0.01)  # k 4, acceptance 0.7
    dev = DeviceBound((), (), 1, lateness={
        "target_ms": 5.0, "samples": 1, "device_step": dict.fromkeys(
            ("median_us", "mean_us", "p99_us", "max_us"), 1.0),
        "time_sleep": dict.fromkeys(("median_us", "mean_us", "p99_us", "max_us"), 1.0)})
    for c in SPEC_STREAMS:
        dev.spec_cells[False, c] = [(0.97, 97.0 * c, 10.3, 10.1, 12.0, 1.0, 0.975)]
        dev.spec_cells[True, c] = [(0.88, 180.0 * c, 5.5, 14.2, 16.0, 0.98, 0.95)]
    text = summary_section(dev)
    assert "| off | 97 tok/s, **10.30 ms/token**, gap 10.1 / 12.0 ms" in text
    assert "efficiency 0.970, while busy **0.975**" in text
    assert "| on | 180 tok/s, **5.50 ms/token**" in text and "delivered/produced **0.980**" in text
    assert "efficiency 0.880, while busy **0.950**" in text


def test_busy_throughput_leaves_out_the_closed_loops_drain():
    """Two streams of two 100-token requests: stream 0 is done at 2 s, stream 1 at 4 s
    (its second request took 3 s). The run: 400 tokens in 4 s; each stream while busy:
    200 / 2 + 200 / 4 = 150 tokens/s. Open-loop or failed records count for nothing."""
    from archive_tools.bench_stats import busy_tokens_per_s

    def rec(stream, start, e2e, **kw):
        return RequestRecord(index=0, scheduled_s=start, start_s=start, status=200,
                             e2e_s=e2e, completion_tokens=100, stream=stream, **kw)

    records = [rec(0, 0.0, 1.0), rec(0, 1.0, 1.0), rec(1, 0.0, 1.0), rec(1, 1.0, 3.0),
               rec(None, 0.0, 0.5), rec(1, 4.0, 1.0, error_kind="503")]
    assert busy_tokens_per_s(records) == pytest.approx(150.0)
    assert busy_tokens_per_s([rec(None, 0.0, 1.0)]) == 0.0
