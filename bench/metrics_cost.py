"""The device bench's "metrics" cells: host efficiency with the server's metrics on and off,
in paired rounds (docs/monitoring.md says what "on" records).

Two servers run side by side on the same synthetic device archive (10 ms steps, batch 64):
"on" as `inf2serve serve` runs it -- every worker records the engine's observations under
vLLM's names into memory-mapped files, and a scraper reads the router's /metrics as each
timed run starts and every second after, as Prometheus would but 15 times as often as the
export's PodMonitor (a run lasts 1-2 s: at one read per 15 s, or per 5 s, most runs would
hold none, so a read per run over-weights its cost) -- and "off" with no
metrics directory, so the workers record nothing of that (TorchServe's own metrics, and the
handler's old names, run in both). Each round runs both at each stream count, their order
alternating, so drift on a shared machine hits both alike; the figure is the median over
rounds of each round's on/off ratio. Never a hardware result.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from archive_tools.bench_stats import Scenario, ScenarioResult, host_efficiency
from archive_tools.loadgen import GenParams, run_scenario
from handlers.telemetry.recorder import METRICS_DIR_ENV
from tests.e2e.harness import ArchiveSpec, build_store, running_server

STEP_MS = 10.0
STREAMS = (8, 32)
BATCH = 64
NEW_TOKENS = 128
REQUESTS_PER_STREAM = 3
SCRAPE_EVERY_S = 1.0  # the PodMonitor scrapes every 15 s; here a read starts each run
MODEL = "metrics-cell"


def archive() -> ArchiveSpec:
    return ArchiveSpec(MODEL, fmt="no-archive", handler={
        "backend": "synthetic", "batching": "continuous", "batch_size": BATCH,
        "max_length": 1024, "max_new_tokens_limit": 512, "max_queue": 256, "threads": 1,
        "warmup": False,
        "synthetic": {"decode_step_ms": STEP_MS, "decode_ms_per_row": 0, "prefill_ms": [0]}})


@dataclass
class MetricsCost:
    rounds: int
    #: (on, streams) -> host efficiency per round
    efficiency: dict[tuple[bool, int], list[float]] = field(default_factory=dict)
    #: (on, streams) -> each round's result, for bench.json (the median round's is kept)
    runs: dict[tuple[bool, int], list[ScenarioResult]] = field(default_factory=dict)
    scrapes: int = 0  # /metrics reads during the "on" cells
    scrape_bytes: int = 0  # the last one's size

    def ratios(self, streams: int) -> list[float]:
        """Each round's on/off efficiency ratio."""
        return [on / off for on, off in zip(self.efficiency[True, streams],
                                            self.efficiency[False, streams], strict=True)]

    def results(self) -> dict[str, list[ScenarioResult]]:
        """label -> the median round's result of each stream count ("metrics-on", -off)."""
        out: dict[str, list[ScenarioResult]] = {}
        for (on, c), runs in sorted(self.runs.items(), key=lambda kv: kv[0][1]):
            effs = self.efficiency[on, c]
            mid = sorted(range(len(effs)), key=effs.__getitem__)[len(effs) // 2]
            out.setdefault(f"metrics-{'on' if on else 'off'}", []).append(runs[mid])
        return out

    def meta(self) -> dict:
        return {"step_ms": STEP_MS, "batch": BATCH, "new_tokens": NEW_TOKENS,
                "rounds": self.rounds, "scrape_every_s": SCRAPE_EVERY_S,
                "scrapes": self.scrapes, "scrape_bytes": self.scrape_bytes,
                "efficiency_rounds": {f"{'on' if on else 'off'} x {c}": [round(e, 4) for e in v]
                                      for (on, c), v in self.efficiency.items()},
                "on_over_off_median": {str(c): round(statistics.median(self.ratios(c)), 4)
                                       for c in STREAMS}}


class Scraper:
    """Reads a /metrics every SCRAPE_EVERY_S while running, as Prometheus would."""

    def __init__(self, url: str, cost: MetricsCost) -> None:
        self.url, self.cost = url, cost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while True:
                body = client.get(self.url).content
                self.cost.scrapes += 1
                self.cost.scrape_bytes = len(body)
                if self._stop.wait(SCRAPE_EVERY_S):
                    return


def run(checkpoint: Path, work: Path, prompts: list[str], rounds: int) -> MetricsCost:
    """`checkpoint`: config and tokenizer (the synthetic device reads no weights)."""
    out = MetricsCost(rounds)
    store = build_store(work / "metrics-cost", checkpoint, [archive()])
    params = GenParams(max_new_tokens=NEW_TOKENS)
    with running_server(store, work / "metrics-on", [MODEL], openai_port=0, test_jvm=False) as on, \
            running_server(store, work / "metrics-off", [MODEL],
                           env={METRICS_DIR_ENV: ""}, test_jvm=False) as off:
        servers = {True: on, False: off}
        for server in servers.values():  # each path once before anything is timed
            run_scenario(f"{server.inference_url}/predictions/{MODEL}", server.inference_token,
                         Scenario("concurrency", max(STREAMS), requests=3 * max(STREAMS)),
                         prompts, params)
        for r in range(rounds):
            for c in STREAMS:
                for metrics in (True, False) if r % 2 == 0 else (False, True):
                    server = servers[metrics]
                    scenario = Scenario("concurrency", c, requests=c * REQUESTS_PER_STREAM)
                    url = f"{server.inference_url}/predictions/{MODEL}"
                    if metrics:
                        with Scraper(on.scrape_url, out):
                            res = run_scenario(url, server.inference_token, scenario, prompts,
                                               params, label="metrics-on")
                    else:
                        res = run_scenario(url, server.inference_token, scenario, prompts,
                                           params, label="metrics-off")
                    eff = host_efficiency(res.summary.output_tokens_per_s, c, STEP_MS)
                    out.efficiency.setdefault((metrics, c), []).append(eff)
                    out.runs.setdefault((metrics, c), []).append(res)
                    print(f"  round {r + 1} metrics {'on ' if metrics else 'off'} streams "
                          f"{c:2d}: efficiency {eff:.3f} ok={res.summary.ok}/"
                          f"{res.summary.requests}", flush=True)
    return out


def table(cost: MetricsCost) -> list[str]:
    """SUMMARY.md's lines for these cells."""
    lines = [f"Metrics on and off (docs/monitoring.md): the same synthetic device "
             f"({STEP_MS:g} ms steps, batch {BATCH}, {NEW_TOKENS} new tokens) on two servers "
             "side by side, one recording every worker's metrics under vLLM's names with "
             f"/metrics read as each run starts and every {SCRAPE_EVERY_S:g} s after "
             f"({cost.scrapes} reads of {cost.scrape_bytes:,} bytes), one without. Host "
             f"efficiency, median of {cost.rounds} paired rounds (order alternating), and "
             "the median of each round's on/off ratio.", "",
             "| streams | metrics on | metrics off | on / off (per round) |", "|---|---|---|---|"]
    for c in STREAMS:
        ratios = cost.ratios(c)
        lines.append(f"| {c} | {statistics.median(cost.efficiency[True, c]):.3f} | "
                     f"{statistics.median(cost.efficiency[False, c]):.3f} | "
                     f"**{statistics.median(ratios):.3f}** "
                     f"({', '.join(f'{r:.3f}' for r in ratios)}) |")
    return lines + [""]
