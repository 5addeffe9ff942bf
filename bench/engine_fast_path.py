"""Does the engine's fast path pay for itself? Paired rounds, in one process.

The engine (handlers/engine/core.py) has two shortcuts between device calls: a step whose
batch is the last one's only decodes it again, without the scheduler (`_unchanged_batch`),
and while such a decode can end nobody its tokens are recorded by the output thread
(`Unrecorded`). Both cost code and shared state; this measures what each buys, on the
machine it runs on, with the engine alone: a backend that sleeps a fixed step on the
synthetic device's StepTimer (no TorchServe, no engine process), closed-loop streams of
128-token requests, the demo tokenizer's real word ids rendered on the output thread.

Variants, by subclassing the shipped Engine (nothing here is a production switch):
  shipped       the engine as it is
  no-hand-over  every decode's tokens recorded on the engine thread
  no-fast-path  every step through the scheduler (and no hand-over)

Per cell: host efficiency (tokens / (streams * elapsed / step)) and the median host gap
between two device calls, medians over rounds; each round runs every variant once per
stream count, the order rotating, so drift hits all alike.

  python bench/engine_fast_path.py --rounds 7 --out bench/results/engine_fast_path
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from handlers.backends.base import Backend, SamplingParams  # noqa: E402
from handlers.backends.synthetic_backend import StepTimer, tighten_timer_slack  # noqa: E402
from handlers.engine.core import Engine  # noqa: E402
from handlers.engine.scheduler import FinishEvent, Scheduler, Sequence  # noqa: E402

NEW_TOKENS = 128
IDS = list(range(300, 812))  # word ids of the demo vocabulary, never EOS


class SleepBackend(Backend):
    """A device step of `step_s` per decode (prefill free); records the host gap before
    each decode."""

    def __init__(self, batch_size: int, step_s: float) -> None:
        self.batch_size, self.max_length = batch_size, 4096
        self.max_prompt_length, self.eos_token_ids = 64, frozenset([2])
        self.step_s, self.n, self.gaps = step_s, {}, []
        self._timer, self._end = StepTimer(), None

    def _prefill(self, slots, prompts, params):
        for s in slots:
            self.n[s] = 0
        return [IDS[0] for _ in slots]

    def _decode(self, slots):
        start = time.perf_counter()
        if self._end is not None:
            self.gaps.append(start - self._end)
        self._timer.wait_until(start + self.step_s)
        rows = []
        for s in slots:
            self.n[s] += 1
            rows.append([IDS[self.n[s] % len(IDS)]])
        self._end = time.perf_counter()
        return rows

    def _release(self, slots):
        for s in slots:
            self.n.pop(s, None)
        self._end = None  # a step that admitted or released is not a steady one


class NoHandOver(Engine):
    def _quiet_decodes(self, batch):
        return 0


class NoFastPath(NoHandOver):
    def _unchanged_batch(self):
        return None


VARIANTS = {"shipped": Engine, "no-hand-over": NoHandOver, "no-fast-path": NoFastPath}


def run_cell(engine_cls: type[Engine], streams: int, step_s: float, per_stream: int,
             tokenizer) -> dict:
    backend = SleepBackend(max(streams, 1), step_s)
    engine = engine_cls(backend, Scheduler(backend.batch_size, max_queue=1024))
    left = {i: per_stream for i in range(streams)}
    done, tokens, lock = threading.Event(), [0], threading.Lock()

    def submit(i: int) -> None:
        engine.submit(Sequence(
            request_id=f"{i}-{left[i]}", prompt_ids=[IDS[i % len(IDS)]] * 4,
            max_new_tokens=NEW_TOKENS, sampling=SamplingParams(ignore_eos=True), stop=(),
            tokenizer=tokenizer, sink=lambda e, i=i: on_event(i, e)))

    def on_event(i: int, event) -> None:
        if type(event) is not FinishEvent:
            return
        with lock:
            tokens[0] += event.completion_tokens
            left[i] -= 1
            again = left[i] > 0
            if not again and not any(left.values()):
                done.set()
        if again:
            submit(i)

    engine.start()
    t0 = time.perf_counter()
    for i in range(streams):
        submit(i)
    if not done.wait(600):
        raise RuntimeError("cell did not finish")
    elapsed = time.perf_counter() - t0
    engine.stop()
    return {"efficiency": tokens[0] / (streams * elapsed / step_s),
            "gap_us": statistics.median(backend.gaps) * 1e6 if backend.gaps else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--streams", default="1,8,32,64")
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--per-stream", type=int, default=2)
    p.add_argument("--out", help="write OUT.json and OUT.md")
    args = p.parse_args()
    from archive_tools.demo_model import SIZES, build_tokenizer

    tighten_timer_slack()
    tokenizer = build_tokenizer(SIZES["tiny"], 0)
    streams = [int(s) for s in args.streams.split(",")]
    names = list(VARIANTS)
    rounds: dict[str, dict[int, list[dict]]] = {n: {s: [] for s in streams} for n in names}
    load_before = os.getloadavg()
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for s in streams:
            for name in order:
                rounds[name][s].append(run_cell(VARIANTS[name], s, args.step_ms / 1000,
                                                args.per_stream, tokenizer))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    summary = {n: {s: {"efficiency": statistics.median(c["efficiency"] for c in rounds[n][s]),
                       "gap_us": statistics.median(c["gap_us"] for c in rounds[n][s])}
                   for s in streams} for n in names}
    meta = {"step_ms": args.step_ms, "rounds": args.rounds, "per_stream": args.per_stream,
            "new_tokens": NEW_TOKENS, "python": platform.python_version(),
            "cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg()}
    lines = ["| variant | " + " | ".join(f"{s} streams: efficiency, gap" for s in streams) + " |",
             "|---|" + "---|" * len(streams)]
    for n in names:
        cells = [f"{summary[n][s]['efficiency']:.3f}, {summary[n][s]['gap_us']:.0f} us"
                 for s in streams]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps(
            {"meta": meta, "summary": summary, "rounds": rounds}, indent=1) + "\n")
        out.with_suffix(".md").write_text(
            f"# Engine fast path, paired ({args.step_ms:g} ms steps)\n\n"
            f"`python bench/engine_fast_path.py --rounds {args.rounds}` on {os.cpu_count()} "
            f"CPUs, load average {load_before[0]:.2f} before, {meta['load_after'][0]:.2f} "
            "after. Median over rounds; gap = host time between two steady decode calls. "
            "Never a hardware result.\n\n" + table + "\n")


if __name__ == "__main__":
    main()
