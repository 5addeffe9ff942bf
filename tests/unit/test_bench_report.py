"""bench_report: several labels side by side in the table, the plots and the JSON."""

from __future__ import annotations

import json

import pytest

from archive_tools.bench_report import load_report, markdown_table, write_report
from archive_tools.bench_stats import BenchError, RequestRecord, Scenario, ScenarioResult


def _result(label: str, mode: str, level: float, speed: float) -> ScenarioResult:
    records = [RequestRecord(index=i, scheduled_s=0, start_s=0, status=200, ttft_s=0.05 * speed,
                             e2e_s=0.5 * speed, itl_s=[0.01 * speed] * 3, prompt_tokens=30,
                             completion_tokens=4, finish_reason="length") for i in range(4)]
    return ScenarioResult(label, Scenario(mode, level, requests=4), records, 1.0 * speed, 1.0)


def _results() -> dict[str, list[ScenarioResult]]:
    return {label: [_result(label, "sync", 1, speed)]
            + [_result(label, "concurrency", c, speed) for c in (1, 5)]
            + [_result(label, "rate", r, speed) for r in (0.5, 2)]
            for label, speed in (("continuous", 1.0), ("micro", 2.0))}


def test_markdown_groups_labels_by_scenario():
    lines = markdown_table(_results()).splitlines()
    assert lines[0].startswith("| label | scenario |") and len(lines) == 2 + 10
    rows = [line.split(" | ")[:2] for line in lines[2:]]
    assert rows[:4] == [["| continuous", "sync"], ["| micro", "sync"],
                        ["| continuous", "c=1"], ["| micro", "c=1"]]
    assert "| micro | c=5 | 4/4 | 0 | 100 / 100 / 100 |" in lines[7]


def test_write_report_and_load_back(tmp_path):
    paths = write_report(_results(), tmp_path, {"url": "http://127.0.0.1:1/predictions/m"})
    assert {p.name for p in paths} == {"bench.json", "bench.md", "latency_vs_concurrency.png",
                                       "throughput_vs_concurrency.png", "latency_vs_rate.png"}
    assert all(p.stat().st_size > 0 for p in paths)
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["meta"]["url"].startswith("http://127.0.0.1") and "created" in doc["meta"]
    assert len(doc["results"]["micro"][0]["records"]) == 4
    back = load_report(tmp_path / "bench.json")
    assert [r.summary for r in back["micro"]] == [r.summary for r in _results()["micro"]]
    assert "![latency_vs_rate](latency_vs_rate.png)" in (tmp_path / "bench.md").read_text()


def test_write_report_only_plots_present_sweeps(tmp_path):
    only_sync = {"x": [_result("x", "sync", 1, 1.0)]}
    assert {p.name for p in write_report(only_sync, tmp_path)} == {"bench.json", "bench.md"}


def test_report_errors_are_one_line(tmp_path):
    with pytest.raises(BenchError, match="no scenario results"):
        write_report({"x": []}, tmp_path)
    (tmp_path / "bench.json").write_text("{not json")
    with pytest.raises(BenchError, match="cannot read bench report .*pick another --out"):
        load_report(tmp_path / "bench.json")
