"""`make bench`: the bench demo model served in continuous and micro mode, and in-process.

One run, one machine, the same torch thread count everywhere:
  1. in-process `model.generate` (batch 1 and batch 8, 64 new tokens) -- the ceiling;
  2. TorchServe with two archives of the same checkpoint, `batching: continuous` and
     `batching: micro` (static micro-batches, the reference Inf2 design), each measured
     single-stream, with 8 closed-loop streams, and with Poisson arrivals at 2 req/s;
  3. a side-by-side report (bench.json, bench.md, PNG plots) plus SUMMARY.md with the
     issue's targets as measured ratios.
Run: `.venv/bin/python bench/run_bench.py --out bench/results` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from archive_tools.bench_report import write_report  # noqa: E402
from archive_tools.bench_stats import Scenario, ScenarioResult  # noqa: E402
from archive_tools.demo_model import build_demo_model  # noqa: E402
from archive_tools.loadgen import GenParams, build_prompts, run_scenario  # noqa: E402
from tests.e2e.harness import ArchiveSpec, build_store, running_server  # noqa: E402

NEW_TOKENS = 64
PROMPT_TOKENS = 30


def in_process(checkpoint: Path, prompts: list[str], threads: int) -> dict:
    """Tokens/s of plain `generate` at batch 1 and batch 8 (greedy, exactly NEW_TOKENS)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    tok.pad_token, tok.padding_side = tok.eos_token, "left"
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    gen = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False,
           "pad_token_id": tok.eos_token_id}

    def timed(batch: list[str]) -> float:
        enc = tok(batch, return_tensors="pt", padding=True)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(**enc, **gen)
        return time.perf_counter() - start

    timed(prompts[:1])  # warm-up
    single = [NEW_TOKENS / timed([p]) for p in prompts[:5]]
    batch8 = [8 * NEW_TOKENS / timed(prompts[i * 8:(i + 1) * 8]) for i in range(3)]
    return {"single_stream_tokens_per_s": statistics.median(single),
            "batch8_tokens_per_s": statistics.median(batch8),
            "single_runs": single, "batch8_runs": batch8}


def served(url: str, token: str, label: str, prompts: list[str], rate_s: float) -> list:
    params = GenParams(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    scenarios = [Scenario("sync", 1, requests=5), Scenario("concurrency", 8, requests=32),
                 Scenario("rate", 2.0, duration_s=rate_s)]
    out = []
    for sc in scenarios:
        res = run_scenario(url, token, sc, prompts, params, label=label)
        s = res.summary
        print(f"  {label:10s} {sc.name:10s} ok={s.ok}/{s.requests} "
              f"tok/s={s.output_tokens_per_s:7.1f} ttft p50={s.ttft.p50} p99={s.ttft.p99}",
              flush=True)
        out.append(res)
    return out


def per_request_tokens_per_s(res: ScenarioResult) -> float:
    rates = [r.completion_tokens / r.e2e_s for r in res.records if r.ok and r.e2e_s]
    return statistics.median(rates)


def summary_md(inproc: dict, results: dict[str, list[ScenarioResult]], threads: int) -> str:
    cont = {r.scenario.mode: r for r in results["continuous"]}
    micro = {r.scenario.mode: r for r in results["micro"]}
    single = per_request_tokens_per_s(cont["sync"])
    agg8 = cont["concurrency"].summary.output_tokens_per_s
    ttft = cont["rate"].summary.ttft
    mttft = micro["rate"].summary.ttft
    rows = [
        ("1. Poisson 2 req/s: TTFT p99 (continuous)", f"{ttft.p99:.3f} s", "<= 0.5 s",
         ttft.p99 <= 0.5),
        ("2. 8 streams: served tok/s / in-process batch-8", f"{agg8:.1f} / "
         f"{inproc['batch8_tokens_per_s']:.1f} = {agg8 / inproc['batch8_tokens_per_s']:.3f}",
         ">= 0.95", agg8 / inproc["batch8_tokens_per_s"] >= 0.95),
        ("3. single stream: served tok/s / in-process batch-1", f"{single:.1f} / "
         f"{inproc['single_stream_tokens_per_s']:.1f} = "
         f"{single / inproc['single_stream_tokens_per_s']:.3f}", ">= 0.95",
         single / inproc["single_stream_tokens_per_s"] >= 0.95),
        ("4. micro mode, Poisson 2 req/s: TTFT p50 / p99", f"{mttft.p50:.3f} / {mttft.p99:.3f} s",
         "reference design: 2.1 / 3.8 s", mttft.p99 <= 3.8),
    ]
    lines = [f"# Benchmark summary ({platform.node()}, {threads} torch threads, "
             f"{time.strftime('%Y-%m-%d %H:%M')})", "",
             f"Bench demo model (~88M params), {NEW_TOKENS} new tokens, ~{PROMPT_TOKENS}-token "
             "prompts, CPU, one run; medians where several samples.", "",
             "| target | measured | goal | met |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {'yes' if d else 'NO'} |" for a, b, c, d in rows]
    lines += ["", "In-process `generate`: single stream "
              f"{inproc['single_stream_tokens_per_s']:.1f} tok/s, batch 8 "
              f"{inproc['batch8_tokens_per_s']:.1f} tok/s.", "",
              "Full tables: bench.md; raw records: bench.json."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--work", default=str(ROOT / "bench" / "work"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rate-duration", type=float, default=30.0)
    args = ap.parse_args()
    work, out = Path(args.work), Path(args.out)
    checkpoint = work / "bench-llama"
    if not (checkpoint / "config.json").exists():
        build_demo_model(checkpoint, "bench", seed=0)
    prompts = build_prompts(64, PROMPT_TOKENS, seed=0)

    print("in-process generate ...", flush=True)
    inproc = in_process(checkpoint, prompts, args.threads)
    print(f"  single {inproc['single_stream_tokens_per_s']:.1f} tok/s, batch-8 "
          f"{inproc['batch8_tokens_per_s']:.1f} tok/s", flush=True)

    common = {"threads": args.threads, "max_length": 1024, "max_new_tokens_limit": 512,
              "max_queue": 256}
    # continuous: 16 slots; micro: the reference shape, static micro-batches of 8
    specs = [ArchiveSpec("bench-cont", handler={**common, "batching": "continuous",
                                                "batch_size": 16}, fmt="no-archive"),
             ArchiveSpec("bench-micro", handler={**common, "batching": "micro", "batch_size": 8,
                                                 "micro_batch_size": 8, "batch_delay_ms": 50},
                         fmt="no-archive")]
    store = build_store(work, checkpoint, specs)
    results: dict[str, list[ScenarioResult]] = {}
    with running_server(store, work / "run", [s.name for s in specs]) as server:
        for label, name in (("continuous", "bench-cont"), ("micro", "bench-micro")):
            url = f"{server.inference_url}/predictions/{name}"
            results[label] = served(url, server.inference_token, label, prompts,
                                    args.rate_duration)
    meta = {"threads": args.threads, "in_process": inproc, "new_tokens": NEW_TOKENS}
    write_report(results, out, meta)
    (out / "in_process.json").write_text(json.dumps(inproc, indent=2))
    text = summary_md(inproc, results, args.threads)
    (out / "SUMMARY.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
