"""What a grammar's mask adds to a host-sampling step: `sample_rows` with and without masks.

Structured outputs (docs/structured_outputs.md) constrain rows with a bitmask per step. The
masked sampler checks each row's candidates against it and masks a row whole only where
none is allowed (handlers/backends/masked_sampling.py); this times one `sample_rows` call
of 32 rows with every row constrained against the same call without masks, on the same
logits, per decode step, at 32,000 and 128,256 tokens, greedy and sampled (temperature 0.8,
top_p 0.95, unseeded). The masks are a JSON answer's mix, a quarter of the rows each:
inside a string (98% of tokens allowed), a number or key (300 allowed), between values (5
allowed), and half the vocabulary -- with the row's best token ruled out in one row of
eight (a model that mostly follows the format), so the deeper search and the full-row
fallback are paid for too. Logits are
host_sampling.py's "peaked" kind (what the synthetic device hands the host).

Filling the masks (llguidance, on its thread while the device runs) is not in this figure:
bench/results/grammar_engines.md has it (0.66 ms for 32 rows at 128,256 on one thread).

Each round times both back to back, the order alternating; a cell's figure is the median
over rounds of each round's median call, and "mask ms per token" the median of the per-round
differences divided by the rows.

Run: .venv/bin/python bench/masked_sampling.py [--rounds 7] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.host_sampling import MODES, make_logits, time_calls  # noqa: E402
from handlers.backends.sampling import RowSampler, sample_rows  # noqa: E402
from handlers.structured.masks import StepMasks, words  # noqa: E402

VOCABS = (32000, 128256)
ROWS = 32
CALLS = 15


def json_masks(logits: torch.Tensor, seed: int) -> StepMasks:
    """Every row constrained, densities as in the module docstring."""
    rows, vocab = logits.shape
    g = np.random.default_rng(seed)
    ok = np.zeros((rows, vocab), dtype=bool)
    best = logits.argmax(dim=1).numpy()
    for i in range(rows):
        kind = i % 4
        if kind == 0:
            ok[i] = g.random(vocab) > 0.02
        elif kind == 1:
            ok[i, g.choice(vocab, 300, replace=False)] = True
        elif kind == 2:
            ok[i, g.choice(vocab, 5, replace=False)] = True
        else:
            ok[i] = g.random(vocab) > 0.5
        ok[i, best[i]] = i % 8 != 7  # the best token ruled out in one row of 8
    padded = np.zeros((rows, words(vocab) * 32), dtype=np.uint8)
    padded[:, :vocab] = ok
    bits = np.packbits(padded, axis=1, bitorder="little").view(np.int32)
    return StepMasks(np.arange(rows), bits)


def cell(vocab: int, mode: str, rounds: int) -> dict:
    logits = make_logits("peaked", ROWS, vocab, seed=vocab)
    masks = json_masks(logits, vocab)
    eos = frozenset([2])
    samplers = [RowSampler(MODES[mode], eos, torch.device("cpu")) for _ in range(ROWS)]
    methods = {"free": lambda: sample_rows(logits, samplers),
               "masked": lambda: sample_rows(logits, samplers, masks=masks)}
    per_round: dict[str, list[float]] = {name: [] for name in methods}
    with torch.inference_mode():
        for fn in methods.values():
            fn()  # warm
        for r in range(rounds):
            for name in methods if r % 2 == 0 else list(methods)[::-1]:
                per_round[name].append(time_calls(methods[name], CALLS))
    added = [m - f for m, f in zip(per_round["masked"], per_round["free"], strict=True)]
    return {"vocab": vocab, "rows": ROWS, "mode": mode,
            "free_ms": round(statistics.median(per_round["free"]) * 1e3, 3),
            "masked_ms": round(statistics.median(per_round["masked"]) * 1e3, 3),
            "mask_us_per_token": round(statistics.median(added) * 1e6 / ROWS, 1),
            "rounds_ms": {k: [round(v * 1e3, 3) for v in vs] for k, vs in per_round.items()}}


def markdown(doc: dict) -> str:
    lines = ["# The grammar's mask in the host sampler (bench/masked_sampling.py)", "",
             f"{doc['when']}, {doc['rounds']} paired rounds, load average {doc['load']} on the "
             "shared 2-core VM (absolute figures are loose; each row's two columns ran in the "
             "same rounds). 32 rows, every one constrained (module docstring).", "",
             "| vocabulary | mode | free ms/step | masked ms/step | mask us per token |",
             "|---|---|---|---|---|"]
    for c in doc["cells"]:
        lines.append(f"| {c['vocab']:,} | {c['mode']} | {c['free_ms']} | {c['masked_ms']} | "
                     f"{c['mask_us_per_token']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    cells = [cell(v, m, args.rounds) for v in VOCABS for m in MODES]
    doc = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rounds": args.rounds,
           "load": round(load, 1), "python": platform.python_version(), "cells": cells}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "masked_sampling.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "masked_sampling.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
