"""bench_report: several labels side by side in the table, the plots and the JSON."""

from __future__ import annotations

import json

import pytest

from archive_tools.bench_report import (
    caption,
    load_report,
    markdown_table,
    summary_tables,
    write_report,
)
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


@pytest.mark.parametrize("width", [80, 200])
def test_terminal_tables_fit_the_width_without_cutting_a_value(width):
    from rich.console import Console

    results = _results()
    results["inf2-continuous-tp8"] = results["continuous"]
    console = Console(width=width, record=True)
    for table in summary_tables(results, width):
        console.print(table)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width
    for value in ("1000 / 1000 / 1000", "100 / 100 / 100", "34.72", "rate=0.5/s", "4/4"):
        assert value in text, value
    assert ("TTFT p50/p90/p99 ms" in text) == (width >= 140)


def test_plot_caption_names_model_date_and_sample_count(tmp_path):
    results = _results()
    meta = {"url": "http://127.0.0.1:1/predictions/tiny-llama", "max_new_tokens": 64}
    write_report(results, tmp_path, dict(meta))
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["meta"]["model"] == "tiny-llama"
    text = caption({"x": results["micro"]}, doc["meta"])
    assert text.startswith("model tiny-llama, 20") and doc["meta"]["created"] in text
    assert "4 successful requests per point" in text and "64 new tokens" in text
