"""The fake neuron-monitor and its Prometheus exporter (tests/fakes/neuron_tools/bin): the
reports keep the documented JSON shape, a config picks groups and periods, and piped into
the exporter they become the series AWS's dashboard reads."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

BIN = Path(__file__).resolve().parents[1] / "fakes" / "neuron_tools" / "bin"
MONITOR, EXPORTER = BIN / "neuron-monitor", BIN / "neuron-monitor-prometheus.py"


def run_monitor(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(MONITOR), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def reports(config: dict | None, tmp_path: Path, n: int) -> list[dict]:
    args = []
    if config is not None:
        (tmp_path / "monitor.conf").write_text(json.dumps(config))
        args = ["-c", str(tmp_path / "monitor.conf")]
    proc = run_monitor(*args)
    try:
        return [json.loads(proc.stdout.readline()) for _ in range(n)]
    finally:
        proc.kill()
        proc.wait()


def test_a_report_has_the_documented_shape(tmp_path: Path) -> None:
    (report,) = reports(None, tmp_path, 1)  # no config: every group, and the first at once
    assert set(report) == {"neuron_runtime_data", "system_data", "instance_info",
                           "neuron_hardware_info"}
    (app,) = report["neuron_runtime_data"]
    assert {"pid", "neuron_runtime_tag", "error", "report"} <= set(app)
    assert set(app["report"]) == {"neuroncore_counters", "memory_used",
                                  "neuron_runtime_vcpu_usage", "execution_stats"}
    assert set(report["system_data"]) == {"vcpu_usage", "memory_info", "neuron_hw_counters"}
    for group in [*app["report"].values(), *report["system_data"].values()]:
        assert group["error"] == "" and group["period"] == 5.0
    cores = app["report"]["neuroncore_counters"]["neuroncores_in_use"]
    assert all(0 <= c["neuroncore_utilization"] <= 100 for c in cores.values())
    hw = report["neuron_hardware_info"]
    assert hw["neuroncore_per_device_count"] * hw["neuron_device_count"] == len(cores)
    used = app["report"]["memory_used"]["neuron_runtime_used_bytes"]
    per_core = used["usage_breakdown"]["neuroncore_memory_usage"]
    assert used["neuron_device"] == sum(sum(kinds.values()) for kinds in per_core.values())


def test_a_config_picks_groups_and_periods(tmp_path: Path) -> None:
    config = {"period": "100ms", "neuron_runtimes": [{"metrics": [
        {"type": "neuroncore_counters"}]}], "system_metrics": [{"type": "memory_info",
                                                                "period": "1h"}]}
    start = time.monotonic()
    first, second, third = reports(config, tmp_path, 3)
    assert time.monotonic() - start < 5  # 100 ms apart, not the default 5 s
    assert set(first["neuron_runtime_data"][0]["report"]) == {"neuroncore_counters"}
    assert set(first["system_data"]) == {"memory_info"}  # due at once
    assert second["system_data"] is None and third["system_data"] is None  # next in an hour
    assert set(second["neuron_runtime_data"][0]["report"]) == {"neuroncore_counters"}
    assert "instance_info" in second and "neuron_hardware_info" in second


def test_bad_options_and_configs_are_refused(tmp_path: Path) -> None:
    assert run_monitor("--port", "1").wait(30) != 0
    (tmp_path / "bad.conf").write_text(json.dumps({"system_metrics": [{"type": "gpu_usage"}]}))
    proc = run_monitor("-c", str(tmp_path / "bad.conf"))
    assert proc.wait(30) == 1 and "gpu_usage" in proc.stderr.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def exported(tmp_path: Path):
    """neuron-monitor | neuron-monitor-prometheus.py --port PORT, as the user guide runs it."""
    (tmp_path / "monitor.conf").write_text(json.dumps({"period": "200ms", "neuron_runtimes": [
        {"metrics": [{"type": t} for t in ("neuroncore_counters", "memory_used",
                                          "execution_stats")]}],
        "system_metrics": [{"type": "memory_info"}]}))
    monitor = run_monitor("-c", str(tmp_path / "monitor.conf"))
    port = free_port()
    exporter = subprocess.Popen([sys.executable, str(EXPORTER), "--port", str(port)],
                                stdin=monitor.stdout, stdout=subprocess.DEVNULL)
    monitor.stdout.close()
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        for proc in (monitor, exporter):
            proc.kill()
            proc.wait()


def scrape(url: str, until: str) -> dict[str, list]:
    deadline = time.monotonic() + 30
    while True:
        try:
            text = httpx.get(url, timeout=5).text
        except httpx.TransportError:
            text = ""
        if until in text or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_the_exporter_serves_the_series_aws_dashboard_reads(exported: str) -> None:
    families = scrape(exported, "execution_status_total")
    util = families["neuroncore_utilization_ratio"]
    assert {s.labels["neuroncore"] for s in util} == {"0", "1"}
    assert all(0 <= s.value <= 1 for s in util)  # a ratio: the report's percent / 100
    labels = util[0].labels
    assert labels["instance_type"] == "inf2.xlarge" and labels["runtime_tag"]
    assert {"instance_id", "availability_zone", "region", "subnet_id"} <= set(labels)
    memory = {s.labels["memory_location"]: s.value
              for s in families["neuron_runtime_memory_used_bytes"]}
    assert set(memory) == {"host", "neuron_device"} and memory["neuron_device"] > 0
    completed = [s for s in families["execution_status"] if s.name.endswith("_total")
                 and s.labels["status_type"] == "completed"]
    assert completed and completed[0].value > 0
    assert {s.labels["percentile"] for s in families["execution_latency_seconds"]} >= {"p50", "p99"}
    assert families["system_memory_total_bytes"][0].value > 0
    assert families["instance_info"][0].labels["instance_type"] == "inf2.xlarge"
