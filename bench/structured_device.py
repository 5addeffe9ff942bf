"""The device bench's "structured" cells: 32 streams all constrained by a nested JSON schema
against the same server's unconstrained host sampling, in paired rounds (issue 39).

A synthetic device of 10 ms steps that leaves sampling to the host
(`handler.synthetic.host_sampling_vocab`) at Llama 2's 32,000 and Llama 3's 128,256
tokens, each with a tokenizer of that size trained locally (bench/grammar_engines.py: no
model may be downloaded here), so the grammar's masks are as wide as a real model's. Every
constrained request sends `response_format` json_schema (strict) with SCHEMA, a nested order
(an object in an object, an array of objects holding arrays) whose `minItems` keeps any
answer longer than NEW_TOKENS: constrained and free requests both end at `length`, so the
only difference between the two is the grammar's work -- matchers advanced and masks filled
on the helper thread while the device step runs (handlers/structured/masks.py,
SlotGrammars), and the masks checked in the host sampler (handlers/backends/
masked_sampling.py) after it. The synthetic model puts its best logit on a token the mask
allows (handlers/backends/synthetic_grammar.py), as a model that follows the format would.

Each round runs, per vocabulary and per kind of request (greedy; sampled at temperature 0.8,
top_p 0.95, unseeded), the free and the constrained scenario back to back, their order
alternating from round to round. Host efficiency = output tokens/s / (streams / step); a
cell's figure is the median over rounds, and "constrained / free" the median of each
round's ratio (goal TARGET). "Mask time per token" is the host time a constrained token
added in that round, (streams / tok/s constrained - streams / tok/s free) per token, median
over rounds. Never a hardware result.

Run: .venv/bin/python bench/structured_device.py [--rounds 5] [--out bench/results]
(`make bench-device` runs it as the device bench's "structured" cells.)
"""

from __future__ import annotations

import argparse
import json
import os
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
from tests.e2e.harness import ArchiveSpec, build_store, running_server  # noqa: E402

VOCABS = (32000, 128256)
STEP_MS = 10.0
STREAMS = 32
BATCH = 64
NEW_TOKENS = 128
REQUESTS_PER_STREAM = 3
TARGET = 0.95
VARIANTS = ("greedy", "sampled")
#: a nested order: every answer is longer than NEW_TOKENS (24 items of >= 12 tokens each)
SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["order_id", "customer", "items"],
    "properties": {
        "order_id": {"type": "string"},
        "customer": {
            "type": "object", "additionalProperties": False,
            "required": ["name", "address"],
            "properties": {
                "name": {"type": "string"},
                "address": {
                    "type": "object", "additionalProperties": False,
                    "required": ["street", "city", "zip"],
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "zip": {"type": "string"}}}}},
        "items": {
            "type": "array", "minItems": 24,
            "items": {
                "type": "object", "additionalProperties": False,
                "required": ["sku", "quantity", "tags"],
                "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer"},
                               "tags": {"type": "array", "items": {"type": "string"}}}}}}}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "order", "schema": SCHEMA, "strict": True}}


@dataclass(frozen=True)
class CellParams(GenParams):
    """No seed (a seeded row samples on its own, off the batched path), top_p, and the
    response_format of a constrained request."""

    top_p: float = 1.0
    constrained: bool = False

    def body(self, prompt: str, index: int) -> dict:
        body = super().body(prompt, index)
        del body["seed"]
        if self.top_p < 1.0:
            body["top_p"] = self.top_p
        if self.constrained:
            body["response_format"] = RESPONSE_FORMAT
        return body


def params(variant: str, constrained: bool) -> CellParams:
    if variant == "greedy":
        return CellParams(max_new_tokens=NEW_TOKENS, constrained=constrained)
    return CellParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_p=0.95,
                      constrained=constrained)


def model(vocab: int) -> str:
    return f"structured-hs{vocab}"


def checkpoint(vocab: int, source: Path, dest: Path) -> Path:
    """`source`'s config.json with a tokenizer of `vocab` entries (no weights: none are read)."""
    from bench.grammar_engines import hf_tokenizer

    dest.mkdir(parents=True, exist_ok=True)
    tok = hf_tokenizer(vocab)
    cfg = json.loads((source / "config.json").read_text())
    cfg.update(vocab_size=vocab, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    tmp = dest / "config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=1))
    tmp.rename(dest / "config.json")
    (dest / "generation_config.json").unlink(missing_ok=True)
    tok.save_pretrained(dest)
    return dest


def archive(vocab: int, threads: int) -> ArchiveSpec:
    return ArchiveSpec(model(vocab), fmt="no-archive", handler={
        "backend": "synthetic", "batching": "continuous", "batch_size": BATCH,
        "max_length": 1024, "max_new_tokens_limit": 512, "max_queue": 256, "threads": threads,
        "warmup": False,
        "synthetic": {"decode_step_ms": STEP_MS, "decode_ms_per_row": 0, "prefill_ms": [0],
                      "host_sampling_vocab": vocab}})


@dataclass
class StructuredCost:
    rounds: int
    #: (vocab, variant, constrained) -> host efficiency per round
    efficiency: dict[tuple[int, str, bool], list[float]] = field(default_factory=dict)
    #: (vocab, variant, constrained) -> each round's result (the median round's is kept)
    runs: dict[tuple[int, str, bool], list[ScenarioResult]] = field(default_factory=dict)
    #: (vocab, variant) -> finish reasons of the constrained requests (all rounds)
    finishes: dict[tuple[int, str], dict[str, int]] = field(default_factory=dict)
    load: list[float] = field(default_factory=list)  # 1-minute load average, each round

    def ratios(self, vocab: int, variant: str) -> list[float]:
        return [c / f for c, f in zip(self.efficiency[vocab, variant, True],
                                      self.efficiency[vocab, variant, False], strict=True)]

    def mask_us_per_token(self, vocab: int, variant: str) -> list[float]:
        """Per round: host time a constrained token added (us)."""
        per_token = STEP_MS * 1e3 / STREAMS  # us of device time per token at efficiency 1
        return [per_token * (1 / c - 1 / f) for c, f in zip(
            self.efficiency[vocab, variant, True], self.efficiency[vocab, variant, False],
            strict=True)]

    def results(self) -> dict[str, list[ScenarioResult]]:
        out: dict[str, list[ScenarioResult]] = {}
        for (vocab, variant, constrained), runs in self.runs.items():
            effs = self.efficiency[vocab, variant, constrained]
            mid = sorted(range(len(effs)), key=effs.__getitem__)[len(effs) // 2]
            out.setdefault(label(vocab, variant, constrained), []).append(runs[mid])
        return out

    def meta(self) -> dict:
        return {"vocabs": list(VOCABS), "step_ms": STEP_MS, "streams": STREAMS,
                "batch": BATCH, "new_tokens": NEW_TOKENS, "rounds": self.rounds,
                "target": TARGET, "schema": SCHEMA, "load_average_rounds": self.load,
                "finish_reasons": {f"{v} {k}": f for (v, k), f in self.finishes.items()},
                "efficiency_rounds": {label(v, k, c): [round(e, 4) for e in effs]
                                      for (v, k, c), effs in self.efficiency.items()},
                "constrained_over_free_median": {
                    f"{v} {k}": round(statistics.median(self.ratios(v, k)), 4)
                    for v in VOCABS for k in VARIANTS if (v, k, True) in self.efficiency},
                "mask_us_per_token_median": {
                    f"{v} {k}": round(statistics.median(self.mask_us_per_token(v, k)), 1)
                    for v in VOCABS for k in VARIANTS if (v, k, True) in self.efficiency}}


def label(vocab: int, variant: str, constrained: bool) -> str:
    return f"structured-hs{vocab}-{variant}-{'json' if constrained else 'free'}"


def _finishes(res: ScenarioResult) -> dict[str, int]:
    out: dict[str, int] = {}
    for rec in res.records:
        reason = getattr(rec, "finish_reason", None) or ("ok" if rec.ok else "error")
        out[reason] = out.get(reason, 0) + 1
    return out


def run(source: Path, work: Path, prompts: list[str], rounds: int, threads: int = 2
        ) -> StructuredCost:
    """`source`: a checkpoint whose config.json the synthetic device reads."""
    out = StructuredCost(rounds)
    root = work / "structured-cell"
    for vocab in VOCABS:
        ckpt = checkpoint(vocab, source, root / f"ckpt-{vocab}")
        store = build_store(root, ckpt, [archive(vocab, threads)])
    urls: dict[int, str] = {}
    with running_server(store, root / "run", [model(v) for v in VOCABS], test_jvm=False) as server:
        token = server.inference_token
        for vocab in VOCABS:
            urls[vocab] = f"{server.inference_url}/predictions/{model(vocab)}"
            for variant in VARIANTS:  # each path once (and the schema compiled) untimed
                for constrained in (False, True):
                    run_scenario(urls[vocab], token, Scenario("concurrency", STREAMS,
                                                              requests=STREAMS),
                                 prompts, params(variant, constrained))
        for r in range(rounds):
            out.load.append(round(os.getloadavg()[0], 1))
            for vocab in VOCABS:
                for variant in VARIANTS:
                    order = (False, True) if r % 2 == 0 else (True, False)
                    for constrained in order:
                        res = run_scenario(
                            urls[vocab], token,
                            Scenario("concurrency", STREAMS,
                                     requests=STREAMS * REQUESTS_PER_STREAM),
                            prompts, params(variant, constrained),
                            label=label(vocab, variant, constrained))
                        tps = res.summary.output_tokens_per_s
                        eff = host_efficiency(tps, STREAMS, STEP_MS)
                        key = (vocab, variant, constrained)
                        out.efficiency.setdefault(key, []).append(eff)
                        out.runs.setdefault(key, []).append(res)
                        if constrained:
                            got = out.finishes.setdefault((vocab, variant), {})
                            for reason, n in _finishes(res).items():
                                got[reason] = got.get(reason, 0) + n
                        print(f"  round {r + 1} structured vocab {vocab} {variant} "
                              f"{'json' if constrained else 'free'}: {tps:7.1f} tok/s "
                              f"efficiency {eff:.3f} ok={res.summary.ok}/"
                              f"{res.summary.requests}", flush=True)
    return out


def table(cost: StructuredCost) -> list[str]:
    """SUMMARY.md's lines for these cells (and bench/results/structured_device.md's)."""
    lines = [f"Structured outputs (bench/structured_device.py): a synthetic device of "
             f"{STEP_MS:g} ms steps sampling on the host, {STREAMS} streams all constrained "
             f"by a nested JSON schema against the same server's free requests, "
             f"{NEW_TOKENS} new tokens each; host efficiency, median of {cost.rounds} paired "
             f"rounds (order alternating; 1-minute load average by round "
             f"{', '.join(f'{x:g}' for x in cost.load)}), the median of each round's "
             f"constrained / free ratio (goal >= {TARGET}) and the host time a constrained "
             "token added.", "",
             "| vocabulary | request | free | constrained | constrained / free (per round) "
             "| mask us per token |", "|---|---|---|---|---|---|"]
    for vocab in VOCABS:
        for variant in VARIANTS:
            if (vocab, variant, True) not in cost.efficiency:
                continue
            ratios = cost.ratios(vocab, variant)
            lines.append(
                f"| {vocab:,} | {variant} | "
                f"{statistics.median(cost.efficiency[vocab, variant, False]):.3f} | "
                f"{statistics.median(cost.efficiency[vocab, variant, True]):.3f} | "
                f"**{statistics.median(ratios):.3f}** "
                f"({', '.join(f'{x:.3f}' for x in ratios)}) | "
                f"{statistics.median(cost.mask_us_per_token(vocab, variant)):.1f} |")
    return lines + [""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "work")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    from archive_tools.demo_model import build_demo_model
    from archive_tools.loadgen import build_prompts, tokenizer_counter
    from bench.run_bench import PROMPT_TOKENS

    source = args.work / "bench-llama"
    if not (source / "config.json").exists():
        build_demo_model(source, "bench", seed=0)
    prompts = build_prompts(64, PROMPT_TOKENS, seed=0, count_tokens=tokenizer_counter(source))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cost = run(source, args.work, prompts, args.rounds, args.threads)
    doc = {"when": started, "cells": cost.meta()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured_device.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = "\n".join(["# Structured outputs on the synthetic device (make bench-device)", "",
                      f"{started}, on a 2-core VM (the load average by round is below; "
                      "each row's columns ran in the same rounds).", "",
                      *table(cost)])
    (args.out / "structured_device.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
