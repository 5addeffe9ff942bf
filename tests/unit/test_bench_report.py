"""bench_report: several labels side by side in the table, the plots and the JSON; one set
of figures per family; summaries in bench.json, per-request records in raw/records.json."""

from __future__ import annotations

import json

import pytest

from archive_tools.bench_report import (
    build_figures,
    caption,
    group_by_family,
    load_report,
    markdown_table,
    read_report,
    redraw,
    summary_tables,
    write_report,
)
from archive_tools.bench_stats import BenchError, RequestRecord, Scenario, ScenarioResult

PLOTS = {"latency_vs_concurrency_served.png", "throughput_vs_concurrency_served.png",
         "latency_vs_rate_served.png"}


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


def _device(label: str, step_s: float) -> list[ScenarioResult]:
    """A synthetic device's sweep over 1-64 streams: ms latencies, throughput that grows
    with the streams (64x from 1 to 64)."""
    out = []
    for c in (1, 8, 32, 64):
        records = [RequestRecord(index=i, scheduled_s=0, start_s=0, status=200,
                                 ttft_s=0.001 * c, e2e_s=128 * step_s, itl_s=[step_s] * 3,
                                 prompt_tokens=30, completion_tokens=128,
                                 finish_reason="length") for i in range(4)]
        out.append(ScenarioResult(label, Scenario("concurrency", c, requests=4), records,
                                  128 * step_s / c))
    return out


def _mixed() -> tuple[dict[str, list[ScenarioResult]], dict[str, str]]:
    results = {**_results(), "device-10ms": _device("device-10ms", 0.01),
               "device-5ms": _device("device-5ms", 0.005)}
    return results, {"continuous": "cpu", "micro": "cpu", "device-10ms": "device",
                     "device-5ms": "device"}


def _close(figures: dict) -> None:
    import matplotlib.pyplot as plt

    for fig in figures.values():
        plt.close(fig)


def test_write_report_keeps_records_out_of_bench_json(tmp_path):
    paths = write_report(_results(), tmp_path, {"url": "http://127.0.0.1:1/predictions/m"})
    assert {p.relative_to(tmp_path).as_posix() for p in paths} == {
        "bench.json", "bench.md", "raw/records.json", *PLOTS}
    assert all(p.stat().st_size > 0 for p in paths)
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["meta"]["url"].startswith("http://127.0.0.1") and "created" in doc["meta"]
    assert doc["records"] == "raw/records.json"
    assert all("records" not in r and r["summary"]["requests"] == 4 and r["family"] == "served"
               for runs in doc["results"].values() for r in runs)
    raw = json.loads((tmp_path / "raw" / "records.json").read_text())
    assert raw["created"] == doc["meta"]["created"]
    assert [len(r["records"]) for r in raw["results"]["micro"]] == [4] * 5
    back = load_report(tmp_path / "bench.json")  # records come back from the raw file
    assert [r.summary for r in back["micro"]] == [r.summary for r in _results()["micro"]]
    assert [len(r.records) for r in back["micro"]] == [4] * 5
    md = (tmp_path / "bench.md").read_text()
    assert "![latency_vs_rate_served](latency_vs_rate_served.png)" in md
    assert "raw/records.json" in md


def test_raw_records_of_another_run_are_not_attached(tmp_path):
    write_report(_results(), tmp_path)
    raw = tmp_path / "raw" / "records.json"
    doc = json.loads(raw.read_text())
    raw.write_text(json.dumps({**doc, "created": "another run"}))
    back = load_report(tmp_path / "bench.json")
    assert all(r.records == [] for r in back["micro"])
    assert [r.summary for r in back["micro"]] == [r.summary for r in _results()["micro"]]


def test_a_report_with_inline_records_still_loads(tmp_path):
    """bench.json from before the split kept every record inline."""
    results = _results()
    doc = {"meta": {"created": "then"},
           "results": {k: [r.to_dict() for r in v] for k, v in results.items()}}
    (tmp_path / "bench.json").write_text(json.dumps(doc))
    back, meta, families = read_report(tmp_path / "bench.json")
    assert meta == {"created": "then"} and set(families.values()) == {"served"}
    assert [len(r.records) for r in back["micro"]] == [4] * 5


def test_redraw_from_a_summaries_only_bench_json(tmp_path):
    results, families = _mixed()
    write_report(results, tmp_path, {"model": "m"}, families)
    for path in [*tmp_path.glob("*.png"), tmp_path / "bench.md"]:
        path.unlink()
    (tmp_path / "raw" / "records.json").unlink()  # as in a fresh clone: the raw file is not in git
    before = (tmp_path / "bench.json").read_bytes()
    paths = redraw(tmp_path)
    assert {p.name for p in paths} == {
        "bench.md", "latency_vs_concurrency_cpu.png", "throughput_vs_concurrency_cpu.png",
        "latency_vs_rate_cpu.png", "latency_vs_concurrency_device.png",
        "throughput_vs_concurrency_device.png"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths if p.suffix == ".png")
    assert (tmp_path / "bench.json").read_bytes() == before
    md = (tmp_path / "bench.md").read_text()
    assert "| device-5ms | c=64 |" in md and "![latency_vs_concurrency_device]" in md
    back, _, back_families = read_report(tmp_path / "bench.json")
    assert back_families == families and all(r.records == [] for r in back["continuous"])
    assert [r.summary for r in back["device-5ms"]] == [r.summary for r in results["device-5ms"]]


def test_one_family_gives_one_set_of_figures_two_give_two():
    results, families = _mixed()
    cpu_only = {k: v for k, v in results.items() if families[k] == "cpu"}
    figures = build_figures(cpu_only, families)
    assert set(figures) == {"latency_vs_concurrency_cpu.png", "throughput_vs_concurrency_cpu.png",
                            "latency_vs_rate_cpu.png"}
    _close(figures)
    assert list(group_by_family(results, families)) == ["cpu", "device"]
    figures = build_figures(results, families)
    assert set(figures) == {"latency_vs_concurrency_cpu.png", "throughput_vs_concurrency_cpu.png",
                            "latency_vs_rate_cpu.png", "latency_vs_concurrency_device.png",
                            "throughput_vs_concurrency_device.png"}
    # each family's figure holds its own labels only
    legend = figures["latency_vs_concurrency_device.png"].legends[0]
    assert [t.get_text() for t in legend.get_texts()][:2] == ["device-10ms", "device-5ms"]
    _close(figures)


def test_wide_ranges_are_drawn_on_log_axes_narrow_ones_linear():
    results, families = _mixed()
    figures = build_figures(results, families)
    ttft, itl, e2e = figures["latency_vs_concurrency_device.png"].axes[:3]
    assert ttft.get_yscale() == "log"  # 1 ms at one stream, 64 ms at 64: 64x
    assert itl.get_yscale() == e2e.get_yscale() == "linear"  # 5 and 10 ms: 2x
    assert ttft.get_xscale() == "log"  # 1 to 64 streams
    tokens, requests = figures["throughput_vs_concurrency_device.png"].axes[:2]
    assert tokens.get_yscale() == requests.get_yscale() == "log"
    cpu = figures["latency_vs_concurrency_cpu.png"].axes[0]
    assert cpu.get_xscale() == "linear"  # 1 and 5 streams
    assert cpu.get_xlabel() == "concurrent streams"  # c=1 was measured: no sync stand-in
    _close(figures)


def test_legends_sit_outside_every_panel_and_figures_are_titled():
    results, families = _mixed()
    figures = build_figures(results, families, {"created": "today"})
    for name, fig in figures.items():
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        assert all(ax.get_legend() is None for ax in fig.axes), name
        (legend,) = fig.legends
        box = legend.get_window_extent(renderer)
        assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes), name
        assert fig.get_suptitle() and "today" in fig.get_supxlabel(), name
    _close(figures)


def test_sync_joins_the_concurrency_sweep_and_a_one_level_sweep_is_per_setup():
    results, families = _mixed()
    results = {k: [r for r in v if r.scenario.level != 1 or r.scenario.mode == "sync"]
               for k, v in results.items() if families[k] == "cpu"}  # drop c=1: sync stands in
    figures = build_figures(results, families)
    ttft = figures["latency_vs_concurrency_cpu.png"].axes[0]
    assert [t.get_text() for t in ttft.get_xticklabels()] == ["1", "5"]
    assert "sync" in ttft.get_xlabel()
    only_one_rate = {k: [r for r in v if r.scenario.level != 0.5] for k, v in results.items()}
    figures2 = build_figures(only_one_rate, families)
    rate = figures2["latency_vs_rate_cpu.png"].axes[0]
    assert [t.get_text() for t in rate.get_xticklabels()] == ["continuous", "micro"]
    _close(figures)
    _close(figures2)


def test_write_report_only_plots_present_sweeps(tmp_path):
    only_sync = {"x": [_result("x", "sync", 1, 1.0)]}
    assert {p.name for p in write_report(only_sync, tmp_path)} == {
        "bench.json", "bench.md", "records.json"}


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
