"""Report files for `inf2serve bench`: JSON summaries, raw records, a Markdown table, PNG plots.

Results are keyed by label ("continuous", "micro", "in-process", ...) so one
report compares several server setups side by side: rows are grouped by
scenario, and each label is one colour in the plots. Each label belongs to a
family (what it measures: a model on CPU, a synthetic device, ...); every family
gets its own figures, since one axis cannot show seconds of CPU latency and
milliseconds of a synthetic device at once.

bench.json holds what the tables and plots need (per-scenario summaries, meta,
families), small enough to commit; every request's record goes to
raw/records.json next to it, which the plots never read, so `redraw` can rebuild
bench.md and the PNGs from a committed bench.json alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from archive_tools.bench_stats import MODES, BenchError, Dist, Scenario, ScenarioResult, Summary

log = logging.getLogger(__name__)
Results = dict[str, list[ScenarioResult]]
JSON_NAME, MD_NAME = "bench.json", "bench.md"
RECORDS_PATH = Path("raw") / "records.json"  # relative to the report directory
DEFAULT_FAMILY = "served"
#: titles of the families a report may hold; meta["families"][name]["title"] overrides
FAMILY_TITLES = {"served": "served model",
                 "device": "synthetic device (fixed decode step, no model compute)"}
WIDE_RANGE = 10  # an axis whose values span more than this factor is drawn log-scaled
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


def group_by_family(results: Results, families: dict[str, str] | None) -> dict[str, Results]:
    """Labels grouped by family (a label without one is DEFAULT_FAMILY), in first-seen order:
    each group is plotted on its own figures."""
    out: dict[str, Results] = {}
    for label, runs in results.items():
        if runs:
            out.setdefault((families or {}).get(label, DEFAULT_FAMILY), {})[label] = runs
    return out


def _series(results: Results, mode: str) -> dict[str, list[ScenarioResult]]:
    """Each label's runs of one sweep, by level. A sync run joins the concurrency sweep as
    one stream (it is one closed-loop stream) unless the label measured c=1 itself, so a
    single concurrency level still gets a line from 1."""
    out = {}
    for label, runs in results.items():
        picked = [r for r in runs if r.scenario.mode == mode]
        if mode == "concurrency" and picked and all(r.scenario.level != 1 for r in picked):
            picked += [r for r in runs if r.scenario.mode == "sync"][:1]
        if picked:
            out[label] = sorted(picked, key=lambda r: r.scenario.level)
    return out


def is_wide(values: list[float | None]) -> bool:
    """True when the positive values span more than WIDE_RANGE: a linear axis would press
    the small ones flat against zero."""
    vals = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    return bool(vals) and max(vals) > WIDE_RANGE * min(vals)


def _scale(ax, which: str, values: list[float | None]) -> None:
    """Log scale with plain-number ticks for a wide range; else linear from zero, so slopes
    are not exaggerated."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis = ax.yaxis if which == "y" else ax.xaxis
    if is_wide(values):
        (ax.set_yscale if which == "y" else ax.set_xscale)("log")
        if which == "y":
            axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    elif which == "y":
        ax.set_ylim(bottom=0)


def _levels_axis(ax, series: dict[str, list[ScenarioResult]], xlabel: str) -> None:
    """The x axis at the measured levels (log when they span more than WIDE_RANGE)."""
    levels = sorted({r.scenario.level for runs in series.values() for r in runs})
    _scale(ax, "x", levels)
    ax.set_xticks(levels, [f"{v:g}" for v in levels])
    ax.set_xlabel(xlabel)


def streams_label(series: dict[str, list[ScenarioResult]]) -> str:
    """The concurrency axis' name; says so where a sync run stands in for one stream."""
    sync = any(r.scenario.mode == "sync" for runs in series.values() for r in runs)
    return "concurrent streams" + (" (1 = sync run)" if sync else "")


def _single_level(series: dict[str, list[ScenarioResult]]) -> float | None:
    """The one level every series of a sweep was measured at, or None: a sweep of one
    level is drawn per setup (categories), since a line through one point shows nothing."""
    levels = {r.scenario.level for runs in series.values() for r in runs}
    return levels.pop() if len(levels) == 1 else None


def caption(series: dict[str, list[ScenarioResult]], meta: dict, info: dict | None = None) -> str:
    """What a plot shows, under it: model, date and how many requests each point is. `info`
    (a family's entry of meta["families"]) names the family's own model and new tokens."""
    info = info or {}
    ok = [r.summary.ok for runs in series.values() for r in runs]
    n = f"{min(ok)}" if min(ok) == max(ok) else f"{min(ok)}-{max(ok)}"
    parts = [f"model {info.get('model') or meta.get('model') or '?'}",
             str(meta.get("created", "?")), f"{n} successful requests per point"]
    if tokens := info.get("new_tokens") or meta.get("max_new_tokens"):
        parts.append(f"{tokens} new tokens per request")
    return ", ".join(parts)


QUANTILES = (("p50", "-", "o"), ("p90", "--", "s"), ("p99", ":", "^"))
LATENCIES = (("ttft", "time to first token"), ("itl", "inter-token latency"),
             ("e2e", "end-to-end latency"))


def _to_ms(value: float | None) -> float:
    """Seconds to ms for plotting; a missing value is a gap in the line (NaN)."""
    return float("nan") if value is None else value * 1000


def _latency_panel(ax, series: dict[str, list[ScenarioResult]], metric: str) -> list[float]:
    """p50/p90/p99 of one latency per setup: lines over the levels, or for a single level
    one column per setup with its p50..p99 range. Returns the values drawn (ms)."""
    drawn = []
    single = _single_level(series) is not None
    for n, runs in enumerate(series.values()):
        dists = [getattr(r.summary, metric) for r in runs]
        xs = [n] * len(runs) if single else [r.scenario.level for r in runs]
        for q, ls, marker in QUANTILES:
            ys = [_to_ms(getattr(d, q)) for d in dists]
            drawn += ys
            ax.plot(xs, ys, linestyle="none" if single else ls, marker=marker, color=f"C{n}")
        if single:
            ys = [y for d in dists for y in (_to_ms(d.p50), _to_ms(d.p99)) if not math.isnan(y)]
            if ys:
                ax.vlines(n, min(ys), max(ys), color=f"C{n}", alpha=0.5)
    return drawn


def _legend(fig, labels: list[str], quantiles: bool) -> None:
    """One legend for the figure, right of the panels: colour = setup, line/marker = quantile.
    Outside every axes, so it never covers a point."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=f"C{n}", linewidth=4, label=label)
               for n, label in enumerate(labels)]
    if quantiles:
        handles += [Line2D([], [], color="0.35", linestyle=ls, marker=m, label=q)
                    for q, ls, m in QUANTILES]
    fig.legend(handles=handles, loc="outside right upper", fontsize="small", frameon=False)


def _figure(plt, panels: int, title: str, note: str):
    """A titled figure of `panels` side by side, its caption under everything."""
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels + 1.5, 4.8), layout="constrained",
                             squeeze=False)
    fig.suptitle(title, fontweight="bold")
    fig.supxlabel(note, fontsize="small", color="0.3")
    return fig, list(axes[0])


def latency_figure(plt, series: dict[str, list[ScenarioResult]], title: str, xlabel: str,
                   note: str):
    """TTFT, ITL and E2E percentiles per setup, one panel each (each its own scale)."""
    fig, axes = _figure(plt, 3, title, note)
    level = _single_level(series)
    for ax, (metric, name) in zip(axes, LATENCIES, strict=True):
        drawn = _latency_panel(ax, series, metric)
        _scale(ax, "y", drawn)
        ax.set(title=name, ylabel="ms" + (" (log scale)" if is_wide(drawn) else ""))
        if level is None:
            _levels_axis(ax, series, xlabel)
        else:
            ax.set_xticks(range(len(series)), list(series), rotation=15)
            ax.set_xlim(-0.6, len(series) - 0.4)
            ax.set_xlabel(f"{xlabel}: {level:g} (p50..p99 per setup)")
        ax.grid(alpha=0.3, which="major")
    _legend(fig, list(series), quantiles=True)
    return fig


def throughput_figure(plt, series: dict[str, list[ScenarioResult]], title: str, note: str):
    """Output tokens/s and requests/s against concurrency, one line per setup."""
    fig, axes = _figure(plt, 2, title, note)
    getters: tuple[tuple[str, Callable[[Summary], float]], ...] = (
        ("output tokens/s", lambda s: s.output_tokens_per_s),
        ("requests/s", lambda s: s.requests_per_s))
    for ax, (ylabel, get) in zip(axes, getters, strict=True):
        drawn = []
        for n, runs in enumerate(series.values()):
            ys = [get(r.summary) for r in runs]
            drawn += ys
            ax.plot([r.scenario.level for r in runs], ys, "o-", color=f"C{n}")
        _scale(ax, "y", drawn)
        ax.set(title=ylabel, ylabel=ylabel + (" (log scale)" if is_wide(drawn) else ""))
        _levels_axis(ax, series, streams_label(series))
        ax.grid(alpha=0.3, which="major")
    _legend(fig, list(series), quantiles=False)
    return fig


def family_info(meta: dict, family: str) -> dict:
    """A family's title, model and new tokens: meta["families"][family], else defaults."""
    info = dict((meta.get("families") or {}).get(family) or {})
    info.setdefault("title", FAMILY_TITLES.get(family, family))
    return info


def build_figures(results: Results, families: dict[str, str] | None = None,
                  meta: dict | None = None) -> dict[str, Any]:
    """Matplotlib figures by file name, one set per family and sweep present
    (latency_vs_concurrency_FAMILY.png, throughput_vs_concurrency_FAMILY.png,
    latency_vs_rate_FAMILY.png). The caller saves and closes them."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window; safe under make and CI
    import matplotlib.pyplot as plt

    meta = meta or {}
    figures = {}
    for family, members in group_by_family(results, families).items():
        info, slug = family_info(meta, family), re.sub(r"[^A-Za-z0-9_.-]+", "-", family)
        conc, rate = _series(members, "concurrency"), _series(members, "rate")
        if conc:
            note = caption(conc, meta, info)
            figures[f"latency_vs_concurrency_{slug}.png"] = latency_figure(
                plt, conc, f"Latency vs concurrency: {info['title']}",
                streams_label(conc), note)
            figures[f"throughput_vs_concurrency_{slug}.png"] = throughput_figure(
                plt, conc, f"Throughput vs concurrency: {info['title']}", note)
        if rate:
            figures[f"latency_vs_rate_{slug}.png"] = latency_figure(
                plt, rate, f"Latency vs offered load: {info['title']}",
                "offered rate (requests/s, Poisson)", caption(rate, meta, info))
    return figures


def write_plots(results: Results, out_dir: Path, meta: dict | None = None,
                families: dict[str, str] | None = None) -> list[Path]:
    """PNG plots for the families and sweeps present, each captioned from `meta`; none
    (with a warning) without matplotlib."""
    try:
        figures = build_figures(results, families, meta)
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("matplotlib"):
            raise
        log.warning("matplotlib is not installed, so no plots; pip install 'inf2serve[bench]'")
        return []
    import matplotlib.pyplot as plt

    written = []
    for name, fig in figures.items():
        written.append(out_dir / name)
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written


def _summary_dict(result: ScenarioResult, family: str) -> dict:
    """A scenario in bench.json: everything but its per-request records."""
    return {**{k: v for k, v in result.to_dict().items() if k != "records"}, "family": family}


def _markdown(results: Results, meta: dict, families: dict[str, str], plots: list[Path],
              records: bool) -> str:
    md = [f"# inf2serve bench ({meta['created']})", ""]
    md += [f"- {k}: {v}" for k, v in meta.items() if k != "created"]
    md += ["", markdown_table(results), "Latencies over successful requests; ITL is the gap "
           "between streamed lines; req/s and tok/s over each scenario's wall time.", ""]
    md += [f"Per-scenario summaries: {JSON_NAME}; every request's record: "
           + (f"{RECORDS_PATH.as_posix()} (not committed: under bench/results it is "
              "gitignored and rewritten by every run)." if records else "not kept."), ""]
    for family in group_by_family(results, families):
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", family)
        mine = [p for p in plots if p.stem.endswith(f"_{slug}")]
        if mine:
            md += [f"### {family_info(meta, family)['title']}", ""]
            md += [f"![{p.stem}]({p.name})" for p in mine] + [""]
    return "\n".join(md).rstrip("\n") + "\n"


def write_report(results: Results, out_dir: str | Path, meta: dict | None = None,
                 families: dict[str, str] | None = None) -> list[Path]:
    """Write bench.json (summaries), raw/records.json (every request, when any result has
    records), bench.md and the plots into `out_dir`; return the paths written.
    `families` maps labels to their family (default DEFAULT_FAMILY)."""
    if not any(results.values()):
        raise BenchError("no scenario results to report; run at least one scenario")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), **(meta or {})}
    if not meta.get("model") and (m := re.search(r"/predictions/([^/]+)", meta.get("url") or "")):
        meta["model"] = m.group(1)
    families = {label: (families or {}).get(label, DEFAULT_FAMILY) for label in results}
    records = any(r.records for runs in results.values() for r in runs)
    doc = {"meta": meta, "records": RECORDS_PATH.as_posix() if records else None,
           "results": {label: [_summary_dict(r, families[label]) for r in runs]
                       for label, runs in results.items()}}
    _write_atomic(out / JSON_NAME, json.dumps(doc, indent=1) + "\n")
    paths = [out / JSON_NAME]
    if records:
        raw = {"created": meta["created"], "results": {
            label: [{"scenario_name": r.scenario.name, "records": r.to_dict()["records"]}
                    for r in runs if r.records] for label, runs in results.items()}}
        (out / RECORDS_PATH).parent.mkdir(exist_ok=True)
        _write_atomic(out / RECORDS_PATH, json.dumps(raw) + "\n")
        paths.append(out / RECORDS_PATH)
    plots = write_plots(results, out, meta, families)
    _write_atomic(out / MD_NAME, _markdown(results, meta, families, plots, records))
    return paths + [out / MD_NAME] + plots


def redraw(out_dir: str | Path) -> list[Path]:
    """Rebuild bench.md and the PNG plots from `out_dir`/bench.json alone (its summaries),
    without rerunning anything; bench.json itself is left as it is."""
    out = Path(out_dir)
    results, meta, families = read_report(out / JSON_NAME, records=False)
    if not any(results.values()):
        raise BenchError(f"{out / JSON_NAME} holds no scenario results to plot")
    plots = write_plots(results, out, meta, families)
    records = (out / RECORDS_PATH).exists()
    _write_atomic(out / MD_NAME, _markdown(results, meta, families, plots, records))
    return [out / MD_NAME] + plots


def _summary_only(data: dict) -> ScenarioResult:
    """A scenario from its bench.json summary, without records: the stored summary stands
    in for the one ScenarioResult would derive from them (a cached_property, so it is set
    once here and never recomputed from the empty list)."""
    result = ScenarioResult(label=data["label"], scenario=Scenario(**data["scenario"]),
                            records=[], wall_s=data["wall_s"],
                            price_per_hour=data.get("price_per_hour"))
    s = dict(data["summary"])
    for key in ("ttft", "itl", "itl_request_mean", "e2e"):
        s[key] = Dist(**s[key])
    vars(result)["summary"] = Summary(**s)
    return result


def _raw_records(path: Path, created: str | None) -> dict[str, dict[str, list]]:
    """label -> scenario name -> records from the raw file next to a bench.json, or {} when
    there is none or it belongs to another run (its `created` differs)."""
    raw_path = path.parent / RECORDS_PATH
    if not raw_path.exists():
        return {}
    try:
        raw = json.loads(raw_path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", raw_path, exc)
        return {}
    if raw.get("created") != created:
        log.warning("ignoring %s: it is from another run than %s", raw_path, path)
        return {}
    return {label: {e["scenario_name"]: e["records"] for e in entries}
            for label, entries in raw.get("results", {}).items()}


def read_report(path: str | Path, records: bool = True
                ) -> tuple[Results, dict, dict[str, str]]:
    """A bench.json's results, meta and label -> family. With `records`, each scenario gets
    its per-request records back from raw/records.json when that file is from the same run
    (or from bench.json itself, as reports before the split kept them); without, or
    without that file, the results carry their stored summaries only."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text("utf-8"))
        meta = doc.get("meta") or {}
        raw = _raw_records(path, meta.get("created")) if records else {}
        results: Results = {}
        families: dict[str, str] = {}
        for label, runs in doc["results"].items():
            results[label] = []
            for r in runs:
                recs = r.get("records") if records else None
                if recs is None:
                    recs = raw.get(label, {}).get(r["scenario_name"])
                results[label].append(_summary_only(r) if recs is None
                                      else ScenarioResult.from_dict({**r, "records": recs}))
                families[label] = r.get("family", DEFAULT_FAMILY)
        return results, meta, families
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"cannot read bench report {path}: {exc}; "
                         "delete it or pick another --out") from exc


def load_report(path: str | Path) -> Results:
    """Read a bench.json back (e.g. to merge the runs of several server setups), with the
    records of raw/records.json where it has them."""
    return read_report(path)[0]
