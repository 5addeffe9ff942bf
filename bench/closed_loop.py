"""Closed-loop tokens/s of the torch backend, continuous vs micro, in process.

The engine, scheduler and torch backend run on this thread with one torch thread,
and the clock is that thread's CPU time (plus simulated idle time): other processes
on a shared machine slow the run but barely move its figures. Each stream sends its
next request a random round trip (`--rtt`, seconds) after its previous one finished;
micro uses the served bench's shape (static batches of up to 16 within 100 ms).
What it cannot show: OpenMP with two threads, and host work (HTTP, tokenizing)
competing with the model for cores -- `make bench` measures those.

Run: `.venv/bin/python bench/closed_loop.py --streams 8 32` (builds the bench model
into bench/work/bench-llama the first time).
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import handlers.engine.scheduler as scheduler_module  # noqa: E402
from archive_tools.demo_model import build_demo_model  # noqa: E402
from archive_tools.loadgen import build_prompts, tokenizer_counter  # noqa: E402
from handlers.backends.base import SamplingParams  # noqa: E402
from handlers.backends.torch_backend import TorchBackend  # noqa: E402
from handlers.config import parse_config  # noqa: E402
from handlers.engine.core import Engine  # noqa: E402
from handlers.engine.scheduler import FinishEvent, Scheduler, Sequence  # noqa: E402

NEW_TOKENS = 64
PROMPT_TOKENS = 30


class VirtualClock:
    """`time.monotonic` for the scheduler: CPU time of the engine thread plus idle waits."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def closed_loop(backend: TorchBackend, tokenizer, prompts: list[list[int]], policy: str,
                streams: int, requests: int, rtt: tuple[float, float], seed: int) -> float:
    """Output tokens per (virtual) second of `streams` clients sending `requests` each."""
    clock = VirtualClock()
    scheduler_module.time = clock  # admission times and batch delays on the virtual clock
    try:
        sched = (Scheduler(32, "continuous", max_queue=256) if policy == "continuous"
                 else Scheduler(16, "micro", 16, max_queue=256, batch_delay_s=0.1))
        engine = Engine(backend, sched)
        rng = random.Random(seed)
        arrivals: list[tuple[float, int, int]] = []  # (time, stream, request number)
        done = {"tokens": 0, "requests": 0}

        def send(stream: int, k: int) -> Sequence:
            def sink(event) -> None:
                if isinstance(event, FinishEvent):
                    done["tokens"] += event.completion_tokens
                    done["requests"] += 1
                    if k + 1 < requests:
                        heapq.heappush(arrivals, (clock.now + rng.uniform(*rtt), stream, k + 1))

            seq = Sequence(f"{stream}-{k}", prompts[(stream * requests + k) % len(prompts)],
                           NEW_TOKENS, SamplingParams(min_new_tokens=NEW_TOKENS), (), sink,
                           tokenizer)
            seq.arrived_at = clock.now
            return seq

        for stream in range(streams):  # the first requests arrive spread over 50 ms
            heapq.heappush(arrivals, (rng.uniform(0, 0.05), stream, 0))
        while done["requests"] < streams * requests:
            while arrivals and arrivals[0][0] <= clock.now:
                _, stream, k = heapq.heappop(arrivals)
                engine.submit(send(stream, k))
            wait = sched.wait_time(clock.now)
            if wait == 0.0:
                start = time.thread_time()
                engine.step()
                clock.now += time.thread_time() - start
                continue
            # idle until the next arrival or the micro-batch delay, whichever comes first
            nxt = arrivals[0][0] - clock.now if arrivals else None
            clock.now += min(w for w in (wait, nxt) if w is not None)
        return done["tokens"] / clock.now
    finally:
        scheduler_module.time = time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--requests", type=int, default=3, help="requests per stream")
    ap.add_argument("--rounds", type=int, default=1, help="continuous/micro pairs")
    ap.add_argument("--rtt", type=float, nargs=2, default=[0.005, 0.03], metavar=("MIN", "MAX"))
    ap.add_argument("--work", default=str(ROOT / "bench" / "work"))
    args = ap.parse_args()
    checkpoint = Path(args.work) / "bench-llama"
    if not (checkpoint / "config.json").exists():
        build_demo_model(checkpoint, "bench", seed=0)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    texts = build_prompts(64, PROMPT_TOKENS, seed=0, count_tokens=tokenizer_counter(checkpoint))
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    config = parse_config({"handler": {"batch_size": 32, "max_length": 1024, "threads": 1,
                                       "max_new_tokens_limit": 512}}).handler
    backend = TorchBackend(checkpoint, config)
    backend.warmup()
    for streams in args.streams:
        ratios = []
        for r in range(args.rounds):
            rates = {policy: closed_loop(backend, tokenizer, prompts, policy, streams,
                                         args.requests, tuple(args.rtt), seed=r)
                     for policy in ("continuous", "micro")}
            ratios.append(rates["continuous"] / rates["micro"])
            print(f"{streams} streams, round {r}: continuous {rates['continuous']:.1f} tok/s, "
                  f"micro {rates['micro']:.1f} tok/s, ratio {ratios[-1]:.3f}", flush=True)
        print(f"{streams} streams: continuous / micro median {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
