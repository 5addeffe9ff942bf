"""The device bench's "prefill" cells: what newcomers' prefills cost the streams running.

Closed-loop streams (each sends its next request when the last one ends) with a distinct
prompt and a length of its own per request (64 to 188 new tokens, 126 on average: the
synthetic model never ends early, and streams that all started together would otherwise all
end together and arrive as one wave of newcomers, with nobody decoding to pause), on the
synthetic device replaying the llama-2-7b-tp24 preset at batch
32: its decode step extrapolated to batch 32 (handlers/presets/synthetic_timing.py) and its
prefill times, the 128-token bucket's the published 27.6 ms. Under continuous batching a
prefill is a device call of its own between two decode steps, so every newcomer's prefill is
a pause for every running stream, and newcomers that arrive together pause them for the sum
of their prefills: neither SDK encodes several sequences' contexts in one call there
(NxD Inference asserts a single seq_id per context call, transformers-neuronx compiles
context batch 1 and loops; the synthetic device charges accordingly), so there is nothing to
gain by joining newcomers into one call. The same archive with every prefill free runs in
the same rounds (order alternating), so the cell shows the pauses' price: throughput, time
to first token and inter-token gaps, p50 and p99, medians over rounds. Never a hardware
result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from archive_tools.bench_stats import Scenario, ScenarioResult, host_efficiency  # noqa: E402
from archive_tools.loadgen import GenParams, run_scenario  # noqa: E402
from handlers.presets.synthetic_timing import PRESETS  # noqa: E402
from tests.e2e.harness import ArchiveSpec, build_store, running_server  # noqa: E402

PRESET = "llama-2-7b-tp24"
STREAMS = 32
BATCH = 32
NEW_TOKENS = 128
REQUESTS_PER_STREAM = 3
#: about 100 tokens of the bench tokenizer: the 128-token bucket, the preset's published one
PROMPT_TOKENS = 100
MAX_LENGTH = 1024  # the preset's buckets up to it: 128, 512, 1024
KINDS = ("preset", "free")


@dataclass(frozen=True)
class VariedLength(GenParams):
    """Request i asks for exactly 64 + (37 i mod 129) tokens: 64 to 188 over a run's 96
    requests, 126 on average, so the streams drift apart after their first request."""

    def body(self, prompt: str, index: int) -> dict:
        n = length(index)
        return {**super().body(prompt, index), "max_new_tokens": n, "min_new_tokens": n}


def length(index: int) -> int:
    return NEW_TOKENS // 2 + (37 * index) % (NEW_TOKENS + 1)


def step_ms() -> float:
    """The preset's decode call at batch BATCH (its batch-1 figure plus a slope per row)."""
    p = PRESETS[PRESET]
    return p.decode_b1_ms + p.per_row_ms * (BATCH - 1)


def archive(kind: str, threads: int) -> ArchiveSpec:
    synthetic: dict = {"preset": PRESET}
    if kind == "free":
        synthetic["prefill_ms"] = [0, 0, 0]  # one per bucket up to MAX_LENGTH
    return ArchiveSpec(f"prefill-{kind}", fmt="no-archive", handler={
        "backend": "synthetic", "batching": "continuous", "batch_size": BATCH,
        "max_length": MAX_LENGTH, "max_new_tokens_limit": 512, "max_queue": 256,
        "threads": threads, "warmup": False, "synthetic": synthetic})


@dataclass
class PrefillCost:
    rounds: int
    prompts: int
    #: kind -> each round's result
    runs: dict[str, list[ScenarioResult]] = field(default_factory=dict)

    def figure(self, kind: str, get) -> float:
        """The median over rounds of `get(summary)`."""
        return statistics.median(get(r.summary) for r in self.runs[kind])

    def efficiency(self, kind: str) -> list[float]:
        return [host_efficiency(r.summary.output_tokens_per_s, STREAMS, step_ms())
                for r in self.runs[kind]]

    def ratios(self) -> list[float]:
        """Each round's throughput with the preset's prefills over the free one's."""
        return [p.summary.output_tokens_per_s / f.summary.output_tokens_per_s
                for p, f in zip(self.runs["preset"], self.runs["free"], strict=True)]

    def results(self) -> dict[str, list[ScenarioResult]]:
        """label -> the median round's result (by throughput), for bench.json."""
        out = {}
        for kind, runs in self.runs.items():
            mid = sorted(runs, key=lambda r: r.summary.output_tokens_per_s)[len(runs) // 2]
            out[f"prefill-{kind}"] = [mid]
        return out

    def meta(self) -> dict:
        return {"preset": PRESET, "streams": STREAMS, "batch": BATCH, "step_ms": step_ms(),
                "prefill_ms_128": PRESETS[PRESET].prefill_ms[0], "new_tokens": NEW_TOKENS,
                "distinct_prompts": self.prompts, "rounds": self.rounds,
                "rounds_by_kind": {k: [_row(r) for r in v] for k, v in self.runs.items()},
                "preset_over_free_throughput": [round(x, 4) for x in self.ratios()]}


def _row(r: ScenarioResult) -> dict:
    s = r.summary
    return {"output_tokens_per_s": round(s.output_tokens_per_s, 1), "ok": s.ok,
            "ttft_p50_s": s.ttft.p50, "ttft_p99_s": s.ttft.p99,
            "itl_p50_s": s.itl.p50, "itl_p99_s": s.itl.p99}


def run(checkpoint: Path, work: Path, rounds: int, threads: int = 2) -> PrefillCost:
    """`checkpoint`: config and tokenizer (the synthetic device reads no weights)."""
    from archive_tools.loadgen import build_prompts, tokenizer_counter

    prompts = build_prompts(STREAMS * REQUESTS_PER_STREAM, PROMPT_TOKENS, seed=1,
                            count_tokens=tokenizer_counter(checkpoint))  # one per request
    out = PrefillCost(rounds, len(prompts))
    store = build_store(work / "prefill-cell", checkpoint, [archive(k, threads) for k in KINDS])
    params = VariedLength()
    scenario = Scenario("concurrency", STREAMS, requests=STREAMS * REQUESTS_PER_STREAM)
    with running_server(store, work / "prefill-run", [f"prefill-{k}" for k in KINDS],
                        test_jvm=False) as server:
        def one(kind: str) -> ScenarioResult:
            return run_scenario(f"{server.inference_url}/predictions/prefill-{kind}",
                                server.inference_token, scenario, prompts, params,
                                label=f"prefill-{kind}")

        for kind in KINDS:  # each path once before anything is timed
            one(kind)
        for r in range(rounds):
            for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                res = one(kind)
                out.runs.setdefault(kind, []).append(res)
                s = res.summary
                print(f"  round {r + 1} prefill {kind:6s}: {s.output_tokens_per_s:7.1f} tok/s "
                      f"TTFT p99 {1000 * (s.ttft.p99 or 0):6.1f} ms ITL p99 "
                      f"{1000 * (s.itl.p99 or 0):6.1f} ms ok={s.ok}/{s.requests}", flush=True)
    return out


def table(cost: PrefillCost) -> list[str]:
    """The cells' lines of a report."""
    ms = 1000.0
    lines = [f"Prefill between decode steps: {STREAMS} closed-loop streams, a distinct prompt "
             f"per request (~{PROMPT_TOKENS} tokens, the 128-token bucket), 64 to 188 new "
             f"tokens (126 on average), on the synthetic device replaying {PRESET} "
             f"at batch {BATCH} (decode {step_ms():.1f} ms, prefill "
             f"{PRESETS[PRESET].prefill_ms[0]:g} ms a newcomer) "
             f"against the same device with free prefills; medians of {cost.rounds} paired "
             "rounds (order alternating). Efficiency: output tokens/s over the decode bound "
             f"({STREAMS} / {step_ms():.1f} ms).", "",
             "| prefill | tok/s | efficiency | TTFT p50 / p99 (ms) | inter-token p50 / p99 (ms) |",
             "|---|---|---|---|---|"]
    for kind in KINDS:
        lines.append(
            f"| {kind} | {cost.figure(kind, lambda s: s.output_tokens_per_s):.0f} | "
            f"{statistics.median(cost.efficiency(kind)):.3f} | "
            f"{ms * cost.figure(kind, lambda s: s.ttft.p50):.1f} / "
            f"{ms * cost.figure(kind, lambda s: s.ttft.p99):.1f} | "
            f"{ms * cost.figure(kind, lambda s: s.itl.p50):.1f} / "
            f"{ms * cost.figure(kind, lambda s: s.itl.p99):.1f} |")
    ratios = cost.ratios()
    lines += ["", f"Throughput with the preset's prefills over free ones, per round: "
              f"**{statistics.median(ratios):.3f}** ({', '.join(f'{x:.3f}' for x in ratios)})."]
    return lines + [""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "work")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    from archive_tools.demo_model import build_demo_model
    from bench.device_bound import synthetic_checkpoint

    source = args.work / "bench-llama"
    if not (source / "config.json").exists():
        build_demo_model(source, "bench", seed=0)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    ckpt = synthetic_checkpoint(source, args.work / "synthetic-ckpt")
    cost = run(ckpt, args.work, args.rounds, args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"when": started, "cells": cost.meta()}
    (args.out / "prefill_device.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = "\n".join(["# Prefill between decode steps on the synthetic device "
                      "(make bench-device)", "", f"{started}, on a 2-core VM.", "",
                      *table(cost)])
    (args.out / "prefill_device.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
