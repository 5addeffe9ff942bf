"""Report files for `inf2serve bench`: JSON (raw + summaries), a Markdown table and PNG plots.

Results are keyed by label ("continuous", "micro", "in-process", ...) so one
report compares several server setups side by side: rows are grouped by
scenario, and each label is one colour in the plots.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from archive_tools.bench_stats import MODES, BenchError, Dist, ScenarioResult

log = logging.getLogger(__name__)
Results = dict[str, list[ScenarioResult]]
JSON_NAME, MD_NAME = "bench.json", "bench.md"
COLUMNS = ("label", "scenario", "ok/sent", "errors", "TTFT p50/p90/p99 ms",
           "ITL p50/p90/p99 ms", "E2E p50/p90/p99 ms", "req/s", "out tok/s", "$/1M out tok")


def _ms(d: Dist) -> str:
    return " / ".join("-" if v is None else f"{v * 1000:.0f}" for v in (d.p50, d.p90, d.p99))


def _rows(results: Results) -> list[tuple[str, ...]]:
    """Table rows, grouped by scenario so the labels of one scenario sit together."""
    flat = [r for runs in results.values() for r in runs]
    flat.sort(key=lambda r: (MODES.index(r.scenario.mode), r.scenario.level))
    rows = []
    for r in flat:
        s = r.summary
        errors = ", ".join(f"{k}×{v}" for k, v in s.errors_by_kind.items())
        cost = s.cost_per_1m_output_tokens
        rows.append((r.label, r.scenario.name, f"{s.ok}/{s.requests}",
                     f"{s.errors} ({errors})" if s.errors else "0", _ms(s.ttft), _ms(s.itl),
                     _ms(s.e2e), f"{s.requests_per_s:.2f}", f"{s.output_tokens_per_s:.1f}",
                     "-" if cost is None else f"{cost:.2f}"))
    return rows


def markdown_table(results: Results) -> str:
    """One Markdown table of every scenario of every label."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(results)]
    return "\n".join(lines) + "\n"


LATENCY_COLUMNS = COLUMNS[:2] + COLUMNS[4:7]
LOAD_COLUMNS = COLUMNS[:4] + COLUMNS[7:]
WIDE = 140  # the one-table layout needs about this many columns


def summary_tables(results: Results, width: int) -> list:
    """The report as rich tables: one wide table, or at narrower terminals a latency table
    and a load table with the same rows (each fits 80 columns without folding a cell)."""
    from rich.table import Table

    rows = _rows(results)
    layouts = ([("inf2serve bench", COLUMNS)] if width >= WIDE else
               [("inf2serve bench: latency (ms, p50 / p90 / p99)", LATENCY_COLUMNS),
                ("inf2serve bench: load", LOAD_COLUMNS)])
    tables = []
    for title, cols in layouts:
        table = Table(title=title, title_justify="left", pad_edge=False)
        for col in cols:
            header = col.replace(" p50/p90/p99 ms", "") if width < WIDE else col
            text = col in ("label", "scenario", "errors")  # may wrap; numbers never do
            table.add_column(header, no_wrap=not text, overflow="fold",
                             justify="left" if text else "right")
        for row in rows:
            table.add_row(*(row[COLUMNS.index(c)] for c in cols))
        tables.append(table)
    return tables


def print_summary(results: Results, console=None) -> None:
    """The report table(s) on the terminal (rich), laid out for its width."""
    from rich.console import Console

    console = console or Console()
    for table in summary_tables(results, console.width):
        console.print(table)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _series(results: Results, mode: str) -> dict[str, list[ScenarioResult]]:
    out = {label: sorted((r for r in runs if r.scenario.mode == mode),
                         key=lambda r: r.scenario.level) for label, runs in results.items()}
    return {label: runs for label, runs in out.items() if runs}


def _axes(ax, series: dict[str, list[ScenarioResult]], **labels: str) -> None:
    """Ticks at the measured levels and a zero baseline, so slopes are not exaggerated."""
    ax.set(**labels)
    ax.set_xticks(sorted({r.scenario.level for runs in series.values() for r in runs}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def caption(series: dict[str, list[ScenarioResult]], meta: dict) -> str:
    """What a plot shows, under it: model, date and how many requests each point is."""
    ok = [r.summary.ok for runs in series.values() for r in runs]
    n = f"{min(ok)}" if min(ok) == max(ok) else f"{min(ok)}-{max(ok)}"
    parts = [f"model {meta.get('model') or '?'}", str(meta.get("created", "?")),
             f"{n} successful requests per point"]
    if meta.get("max_new_tokens"):
        parts.append(f"{meta['max_new_tokens']} new tokens per request")
    return ", ".join(parts)


def _caption(fig, text: str) -> None:
    fig.text(0.5, 0.01, text, ha="center", va="bottom", fontsize="small", color="0.3")
    fig.tight_layout(rect=(0, 0.05, 1, 1))


def _latency_plot(plt, series: dict[str, list[ScenarioResult]], xlabel: str, path: Path,
                  note: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    styles = (("p50", "-", "o"), ("p90", "--", "s"), ("p99", ":", "^"))
    for ax, metric, title in ((axes[0], "ttft", "time to first token"),
                              (axes[1], "itl", "inter-token latency"),
                              (axes[2], "e2e", "end-to-end latency")):
        for n, (label, runs) in enumerate(series.items()):
            xs = [r.scenario.level for r in runs]
            for q, ls, marker in styles:
                ys = [getattr(getattr(r.summary, metric), q) for r in runs]
                ys = [float("nan") if y is None else y * 1000 for y in ys]
                ax.plot(xs, ys, linestyle=ls, marker=marker, color=f"C{n}", label=f"{label} {q}")
        _axes(ax, series, title=title, xlabel=xlabel, ylabel="ms")
    axes[2].legend(fontsize="small")
    _caption(fig, note)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _throughput_plot(plt, series: dict[str, list[ScenarioResult]], path: Path,
                     note: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for n, (label, runs) in enumerate(series.items()):
        xs = [r.scenario.level for r in runs]
        axes[0].plot(xs, [r.summary.output_tokens_per_s for r in runs], "o-", color=f"C{n}",
                     label=label)
        axes[1].plot(xs, [r.summary.requests_per_s for r in runs], "o-", color=f"C{n}",
                     label=label)
    for ax, ylabel in ((axes[0], "output tokens/s"), (axes[1], "requests/s")):
        _axes(ax, series, title=f"{ylabel} vs concurrency", xlabel="concurrency", ylabel=ylabel)
    axes[0].legend(fontsize="small")
    _caption(fig, note)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(results: Results, out_dir: Path, meta: dict | None = None) -> list[Path]:
    """PNG plots for the sweeps present, each captioned from `meta` (model, created); none
    (with a warning) without matplotlib."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        log.warning("matplotlib is not installed, so no plots; pip install 'inf2serve[bench]'")
        return []
    matplotlib.use("Agg")  # files only, never a window; safe under make and CI
    import matplotlib.pyplot as plt

    written, meta = [], meta or {}
    conc, rate = _series(results, "concurrency"), _series(results, "rate")
    if conc:
        written.append(out_dir / "latency_vs_concurrency.png")
        _latency_plot(plt, conc, "concurrent requests", written[-1], caption(conc, meta))
        written.append(out_dir / "throughput_vs_concurrency.png")
        _throughput_plot(plt, conc, written[-1], caption(conc, meta))
    if rate:
        written.append(out_dir / "latency_vs_rate.png")
        _latency_plot(plt, rate, "offered rate (requests/s, Poisson)", written[-1],
                      caption(rate, meta))
    return written


def write_report(results: Results, out_dir: str | Path, meta: dict | None = None) -> list[Path]:
    """Write bench.json, bench.md and the plots into `out_dir`; return the paths written."""
    if not any(results.values()):
        raise BenchError("no scenario results to report; run at least one scenario")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), **(meta or {})}
    if not meta.get("model") and (m := re.search(r"/predictions/([^/]+)", meta.get("url") or "")):
        meta["model"] = m.group(1)
    doc = {"meta": meta,
           "results": {label: [r.to_dict() for r in runs] for label, runs in results.items()}}
    _write_atomic(out / JSON_NAME, json.dumps(doc, indent=1) + "\n")
    md = [f"# inf2serve bench ({meta['created']})", ""]
    md += [f"- {k}: {v}" for k, v in meta.items() if k != "created"]
    md += ["", markdown_table(results), "Latencies over successful requests; ITL is the gap "
           "between streamed lines; req/s and tok/s over each scenario's wall time.", ""]
    paths = [out / JSON_NAME, out / MD_NAME]
    plots = write_plots(results, out, meta)
    md += [f"![{p.stem}]({p.name})" for p in plots]
    _write_atomic(out / MD_NAME, "\n".join(md) + "\n")
    return paths + plots


def load_report(path: str | Path) -> Results:
    """Read a bench.json back (e.g. to merge the runs of several server setups)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text("utf-8"))
        return {label: [ScenarioResult.from_dict(r) for r in runs]
                for label, runs in doc["results"].items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"cannot read bench report {path}: {exc}; "
                         "delete it or pick another --out") from exc
