"""Workers' metrics under vLLM's names: what each worker records (handlers/telemetry/
recorder.py) and the one /metrics body the router makes of all of them
(handlers/telemetry/exposition.py). Several recorders in this process stand for several
workers, each writing its own files as a TorchServe worker would."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import values
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from handlers.telemetry.catalog import (
    FINISH_REASONS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    Finished,
    SpecDecode,
    buckets_1_2_5,
)
from handlers.telemetry.exposition import render
from handlers.telemetry.recorder import PrometheusRecorder

#: what TorchServe 0.12's metrics port answers (a trailing comma in every label set)
TORCHSERVE = (b'# HELP ts_inference_requests_total Torchserve prometheus counter metric with '
              b'unit: Count\n# TYPE ts_inference_requests_total counter\n'
              b'ts_inference_requests_total{model_name="a",model_version="default",'
              b'hostname="vm",} 3.0\n')


@pytest.fixture
def workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """make(model, worker, slots) -> a recorder writing into tmp_path/metrics."""
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)  # restored afterwards
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    directory = tmp_path / "metrics"

    def make(model: str, worker: str, slots: int = 4, max_length: int = 2048):
        return PrometheusRecorder(directory, model, worker, slots, max_length)

    make.directory = directory
    return make


def scrape(directory: Path | None, upstreams=()) -> dict[str, list]:
    text = render(directory, upstreams).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: list, name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def finished(reason: str = "stop", prompt: int = 5, gen: int = 9) -> Finished:
    return Finished(reason, prompt, gen, e2e_s=0.5, queue_s=0.01, prefill_s=0.05,
                    decode_s=0.44)


def test_every_series_exists_from_the_first_scrape(workers) -> None:
    workers("a", "9000")
    got = scrape(workers.directory)
    assert {s.labels["finished_reason"] for s in got["vllm:request_success"]} == set(FINISH_REASONS)
    assert all(s.value == 0 for s in got["vllm:request_success"])
    ttft = {s.labels["le"] for s in got["vllm:time_to_first_token_seconds"]
            if s.name.endswith("_bucket")}
    assert ttft == {floatToGoString(b) for b in TTFT_BUCKETS} | {"+Inf"}
    assert value(got["vllm:num_requests_running"], "vllm:num_requests_running", model_name="a") == 0
    assert value(got["inf2serve_slots"], "inf2serve_slots", model_name="a") == 4
    assert value(got["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc", model_name="a") == 0
    assert "vllm:spec_decode_num_drafts" not in got  # no speculation seen: none, as in vLLM


def test_workers_of_a_model_add_up_and_models_stay_apart(workers) -> None:
    a1, a2, b = workers("a", "9000"), workers("a", "9001"), workers("b", "9002", slots=2)
    for rec, running in ((a1, 3), (a2, 2), (b, 1)):
        rec.record("BusySlots", running)
        rec.record("WaitingRequests", 1)
    for rec in (a1, a2, a2, b):
        rec.record("TimeToFirstToken", 30.0)  # ms, as the engine observes it
        rec.record("RequestFinished", tuple(finished()))
    a2.record("RequestFinished", tuple(finished("abort", gen=2)))
    a1.record("InterTokenLatency", ((0.012, 1), (0.011, 2)))
    got = scrape(workers.directory)
    run = got["vllm:num_requests_running"]
    assert value(run, "vllm:num_requests_running", model_name="a") == 5
    assert value(got["vllm:num_requests_waiting"], "vllm:num_requests_waiting",
                 model_name="a") == 2
    usage = got["vllm:kv_cache_usage_perc"]
    assert value(usage, "vllm:kv_cache_usage_perc", model_name="a") == 5 / 8
    assert value(usage, "vllm:kv_cache_usage_perc", model_name="b") == 1 / 2
    tokens = got["vllm:generation_tokens"]
    assert value(tokens, "vllm:generation_tokens_total", model_name="a") == 9 + 9 + 9 + 2
    assert value(got["vllm:prompt_tokens"], "vllm:prompt_tokens_total", model_name="b") == 5
    success = got["vllm:request_success"]
    assert value(success, "vllm:request_success_total", model_name="a",
                 finished_reason="stop") == 3
    assert value(success, "vllm:request_success_total", model_name="a",
                 finished_reason="abort") == 1
    ttft = got["vllm:time_to_first_token_seconds"]
    assert value(ttft, "vllm:time_to_first_token_seconds_count", model_name="a") == 3
    assert value(ttft, "vllm:time_to_first_token_seconds_bucket", model_name="a", le="0.04") == 3
    assert value(ttft, "vllm:time_to_first_token_seconds_bucket", model_name="a", le="0.02") == 0
    itl = got["vllm:inter_token_latency_seconds"]
    assert value(itl, "vllm:inter_token_latency_seconds_count", model_name="a") == 3
    tpot = got["vllm:request_time_per_output_token_seconds"]
    assert value(tpot, "vllm:request_time_per_output_token_seconds_sum", model_name="b") == \
        pytest.approx(0.44 / 8)
    e2e = got["vllm:e2e_request_latency_seconds"]
    assert value(e2e, "vllm:e2e_request_latency_seconds_count", model_name="a") == 4
    assert {s.labels["le"] for s in e2e if s.name.endswith("_bucket")} >= {"0.3", "7680.0"}
    assert len({s.labels["le"] for s in e2e if s.name.endswith("_bucket")
                and s.labels["model_name"] == "a"}) == len(REQUEST_LATENCY_BUCKETS) + 1
    prompt = got["vllm:request_prompt_tokens"]
    assert len({s.labels["le"] for s in prompt if s.name.endswith("_bucket")
                and s.labels["model_name"] == "a"}) == len(buckets_1_2_5(2048)) + 1
    beats = {s.labels["worker"]: s.value
             for s in got["inf2serve_worker_heartbeat_timestamp_seconds"]}
    assert set(beats) == {"9000", "9001", "9002"} and min(beats.values()) > 1.7e9


def test_an_error_before_prefill_counts_once_with_its_latency(workers) -> None:
    rec = workers("a", "9000")
    rec.record("RequestFinished", ("error", None, None, 2.0, None, None, None))
    rec.record("RequestFinished", ("teapot", 1, 0, 0.1, 0.0, 0.1, None))  # unknown: an error
    got = scrape(workers.directory)
    assert value(got["vllm:request_success"], "vllm:request_success_total",
                 finished_reason="error") == 2
    assert value(got["vllm:e2e_request_latency_seconds"],
                 "vllm:e2e_request_latency_seconds_count") == 2
    assert value(got["vllm:request_prefill_time_seconds"],
                 "vllm:request_prefill_time_seconds_count") == 1
    assert value(got["vllm:request_decode_time_seconds"],
                 "vllm:request_decode_time_seconds_count") == 0


def test_speculation_counts_drafts_and_acceptance(workers) -> None:
    rec = workers("spec", "9000")
    rec.record("SpecDecode", tuple(SpecDecode(drafts=2, draft_tokens=8, accepted=5, emitted=7)))
    rec.record("SpecDecode", tuple(SpecDecode(drafts=1, draft_tokens=4, accepted=4, emitted=5)))
    got = scrape(workers.directory)
    for family, total in (("vllm:spec_decode_num_drafts", 3),
                          ("vllm:spec_decode_num_draft_tokens", 12),
                          ("vllm:spec_decode_num_accepted_tokens", 9),
                          ("vllm:spec_decode_num_emitted_tokens", 12)):
        assert value(got[family], family + "_total", model_name="spec") == total


def test_a_restarted_worker_continues_its_counters_not_its_load(workers) -> None:
    dead = workers("a", "9000")
    dead.record("RequestFinished", tuple(finished()))
    dead.record("BusySlots", 3)  # then it died with three requests in its slots
    again = workers("a", "9000")  # the same worker id: the same files
    again.record("RequestFinished", tuple(finished()))
    got = scrape(workers.directory)
    assert value(got["vllm:generation_tokens"], "vllm:generation_tokens_total") == 18
    assert value(got["vllm:num_requests_running"], "vllm:num_requests_running") == 0
    assert len(list(workers.directory.iterdir())) == 4  # counter, gauge sum/max, histogram


def test_upstream_exporters_are_appended_and_their_health_shown(workers) -> None:
    workers("a", "9000")
    got = scrape(workers.directory, [("torchserve", TORCHSERVE), ("neuron-monitor", None)])
    up = {s.labels["upstream"]: s.value for s in got["inf2serve_upstream_up"]}
    assert up == {"torchserve": 1.0, "neuron-monitor": 0.0}
    assert value(got["ts_inference_requests"], "ts_inference_requests_total") == 3
    alone = scrape(None, [("torchserve", TORCHSERVE)])  # no workers' directory yet
    assert set(alone) == {"inf2serve_upstream_up", "ts_inference_requests"}


def test_a_worker_id_must_be_digits(workers) -> None:
    with pytest.raises(ValueError, match="digits"):
        workers("a", "w_1")


def test_a_batch_writes_what_one_at_a_time_would(workers, tmp_path) -> None:
    """The reporter hands a worker's observations over in batches: a gauge's last value, a
    counter's sum and one increment per histogram bucket come out as one observation at a
    time would (a value on a bound lands in that bound's bucket: le is inclusive)."""
    items = [("BusySlots", 3), ("InterTokenLatency", ((0.01, 2), (0.0101, 1), (0.9, 1),
                                                       (50.0, 3))),
             ("TimeToFirstToken", 40.0), ("RequestFinished", tuple(finished())),
             ("RequestFinished", tuple(finished("stop", gen=1))), ("BusySlots", 2),
             ("SpecDecode", (2, 6, 3, 5)), ("SpecDecode", (1, 3, 3, 4))]
    workers("batched", "9000").record_all(items)
    one = workers("single", "9001")
    for name, observed in items:
        one.record(name, observed)
    got = scrape(workers.directory)
    for family, samples in got.items():
        batched = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                         if k != "model_name"))): s.value
                   for s in samples if s.labels.get("model_name") == "batched"}
        single = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                        if k != "model_name"))): s.value
                  for s in samples if s.labels.get("model_name") == "single"}
        if family == "inf2serve_worker_heartbeat_timestamp_seconds":
            continue
        assert batched.keys() == single.keys(), family
        for key in batched:
            assert batched[key] == pytest.approx(single[key]), (family, key)
    itl = got["vllm:inter_token_latency_seconds"]
    assert value(itl, "vllm:inter_token_latency_seconds_bucket", model_name="batched",
                 le="0.01") == 2
    assert value(got["vllm:num_requests_running"], "vllm:num_requests_running",
                 model_name="batched") == 2
