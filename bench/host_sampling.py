"""Host sampling cost per decode step: the per-row RowSampler loop against `sample_rows`.

Before issue 25 item 4 every backend that samples on the host picked tokens row by row:
`[sampler(logits[i]) for i ...]`, a float copy, the warpers (a full-vocabulary sort for
top-p), softmax, `torch.multinomial` over every token and an `int()` per row. This times
that loop against one `handlers.backends.sampling.sample_rows` call on the same logits, with the
same parameters, per decode step.

Cells: vocabulary 32,000 (Llama-2) and 128,256 (Llama-3); 1, 8 and 32 rows; greedy and
sampled requests (temperature 0.8, top_p 0.95, no seed: a seeded row keeps the per-row
path); two kinds of logits (float32, as Neuron returns them):
- peaked: one token far above an N(0, 2^2) background -- what the synthetic device hands
  the host (handler.synthetic.host_sampling_vocab), and a confident model step;
- broad: a head of 64 tokens at N(12, 2^2) over the same background -- a less certain
  step: at temperature 0.8 the top-p nucleus holds ~20 tokens, and 8,000-18,000 tokens
  lie within the batched path's reach (its candidates).

Each round times both methods back to back, the order alternating from round to round;
a method's figure in a round is the median of its calls, a cell's figure the median
over rounds, and the speed-up the median of the per-round ratios. Calls back to back
keep the logits in the CPU's caches; a server samples once per device step, after a
wait, so each round also times the batched call after a 10 ms wait of the synthetic
device's own StepTimer (sleep, then poll to the deadline): "after a wait".
torch runs on one thread: on a 2-core host its intra-op threads stalled ~8 ms whenever
the other core was busy, which would flatter the batched path (numpy) unfairly.

Run: .venv/bin/python bench/host_sampling.py [--rounds 7] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from handlers.backends.base import SamplingParams  # noqa: E402
from handlers.backends.sampling import RowSampler, sample_rows  # noqa: E402
from handlers.backends.synthetic_backend import StepTimer  # noqa: E402

VOCABS = (32000, 128256)
ROWS = (1, 8, 32)
MODES = {"greedy": SamplingParams(),
         "sampled": SamplingParams(temperature=0.8, top_p=0.95)}
SHAPES = ("peaked", "broad")
STEP_MS = 10.0  # the device step the efficiency bound is taken against
CALL_BUDGET_S = 0.05  # each method's calls per round: at least this long, 3 to 30 calls
TIMER = StepTimer()  # the synthetic device's wait: sleep, then poll to the deadline


def make_logits(shape: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    """[rows, vocab] float32 logits of one kind (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2
    if shape == "peaked":
        best = torch.randint(0, vocab, (rows,), generator=g)
        logits[torch.arange(rows), best] = 30.0
    else:
        head = torch.randint(0, vocab, (rows, 64), generator=g)
        logits.scatter_(1, head, 12 + 2 * torch.randn(rows, 64, generator=g))
    return logits


def per_row(logits: torch.Tensor, samplers: list[RowSampler]) -> list[int]:
    """What the backends did before: one RowSampler call per row."""
    return [s(logits[i]) for i, s in enumerate(samplers)]


def time_calls(fn: Callable[[], object], calls: int, wait_s: float = 0.0) -> float:
    """Median seconds of `calls` calls, each after a device step's wait of `wait_s`."""
    times = []
    for _ in range(calls):
        if wait_s:
            TIMER.wait_until(time.perf_counter() + wait_s)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cell(vocab: int, rows: int, mode: str, shape: str, rounds: int) -> dict:
    logits = make_logits(shape, rows, vocab, seed=vocab + rows)
    eos = frozenset([2])
    methods = {
        "per_row": (per_row, [RowSampler(MODES[mode], eos, torch.device("cpu"))
                              for _ in range(rows)]),
        "batched": (sample_rows, [RowSampler(MODES[mode], eos, torch.device("cpu"))
                                  for _ in range(rows)]),
    }
    calls = {}
    with torch.inference_mode():  # as the backends call them
        for name, (fn, samplers) in methods.items():  # warm, and size the rounds
            start = time.perf_counter()
            fn(logits, samplers)
            once = time.perf_counter() - start
            calls[name] = int(min(30, max(3, CALL_BUDGET_S / max(once, 1e-6))))
        per_round: dict[str, list[float]] = {name: [] for name in (*methods, "after_wait")}
        for r in range(rounds):
            order = list(methods) if r % 2 == 0 else list(methods)[::-1]
            for name in order:
                fn, samplers = methods[name]
                per_round[name].append(
                    time_calls(lambda fn=fn, s=samplers: fn(logits, s), calls[name]))
            samplers = methods["batched"][1]
            per_round["after_wait"].append(time_calls(
                lambda s=samplers: sample_rows(logits, s), min(calls["batched"], 10),
                STEP_MS / 1000))
    ratios = [a / b for a, b in zip(per_round["per_row"], per_round["batched"], strict=True)]
    batched_ms = statistics.median(per_round["batched"]) * 1e3  # back to back
    return {"vocab": vocab, "rows": rows, "mode": mode, "shape": shape,
            "per_row_ms": round(statistics.median(per_round["per_row"]) * 1e3, 3),
            "batched_ms": round(batched_ms, 3),
            "batched_after_wait_ms": round(statistics.median(per_round["after_wait"]) * 1e3, 3),
            "speedup": round(statistics.median(ratios), 1),
            "efficiency_bound_10ms": round(
                STEP_MS / (STEP_MS + statistics.median(per_round["after_wait"]) * 1e3), 3),
            "calls_per_round": calls,
            "rounds_ms": {k: [round(v * 1e3, 3) for v in vs] for k, vs in per_round.items()}}


def markdown(doc: dict) -> str:
    m = doc["meta"]
    lines = [f"# Host sampling cost per decode step ({m['host']}, {m['created']})", "",
             "The per-row RowSampler loop every host-sampling backend ran before issue 25 "
             "item 4, against one `handlers.backends.sampling.sample_rows` call on the same "
             "float32 "
             "logits (bench/host_sampling.py: the kinds of logits, and how rounds pair). "
             f"Median of {m['rounds']} paired rounds, the order alternating; speed-up = median "
             "of the per-round ratios. 'after a wait': the batched call after a 10 ms wait of "
             "the synthetic device's StepTimer, as a server calls it once per device step. "
             "'bound at 10 ms' = 10 / (10 + batched ms after a wait): the host efficiency a "
             "10 ms device step could keep if sampling were the only host work (it is not: the "
             f"serving path costs 3-4% more). torch threads: {m['threads']}; "
             f"numpy {m['numpy']}, torch {m['torch']}; load average before "
             f"{m['loadavg_before']}, after {m['loadavg_after']}.", "",
             "| logits | mode | vocab | rows | per-row ms | batched ms | speed-up | "
             "batched ms after a wait | bound at 10 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for c in doc["cells"]:
        lines.append(f"| {c['shape']} | {c['mode']} | {c['vocab']:,} | {c['rows']} | "
                     f"{c['per_row_ms']:.3f} | {c['batched_ms']:.3f} | {c['speedup']:g}x | "
                     f"{c['batched_after_wait_ms']:.3f} | {c['efficiency_bound_10ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    meta = {"created": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
            "cpus": os.cpu_count(), "threads": args.threads, "rounds": args.rounds,
            "numpy": np.__version__, "torch": torch.__version__,
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in os.getloadavg()],
            "modes": {k: {"temperature": p.temperature, "top_p": p.top_p}
                      for k, p in MODES.items()}}
    cells = []
    for shape in SHAPES:
        for mode in MODES:
            for vocab in VOCABS:
                for rows in ROWS:
                    c = cell(vocab, rows, mode, shape, args.rounds)
                    cells.append(c)
                    print(f"{shape:6s} {mode:7s} vocab {vocab:6d} rows {rows:2d}: per-row "
                          f"{c['per_row_ms']:9.3f} ms, batched {c['batched_ms']:7.3f} ms "
                          f"(x{c['speedup']:g}), after a wait {c['batched_after_wait_ms']:7.3f} "
                          "ms", flush=True)
    meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    doc = {"meta": meta, "cells": cells}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_sampling.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "host_sampling.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
