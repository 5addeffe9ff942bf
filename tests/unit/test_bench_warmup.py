"""bench/warmup.py: the frontend is warmed until its JIT compiler has settled, not for a guess."""

from __future__ import annotations

import os
import threading

from bench import warmup


def test_compiler_cpu_counts_only_the_jit_threads():
    # this interpreter has no HotSpot compiler threads, however busy its own threads are
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    busy = threading.Thread(target=spin)
    busy.start()
    try:
        assert warmup.compiler_cpu_s(os.getpid()) == 0.0
    finally:
        stop.set()
        busy.join()


def _fake(monkeypatch, per_round_us: list[float]):
    """run_scenario is a no-op; the compiler threads use per_round_us[i] per request in round i."""
    spent, rounds = [0.0], iter(per_round_us)

    def run_scenario(url, token, scenario, prompts, params):
        assert params.max_new_tokens == 2  # one prefill and one decode step: the streamed path
        spent[0] += next(rounds) * scenario.requests / 1e6

    monkeypatch.setattr(warmup, "run_scenario", run_scenario)
    monkeypatch.setattr(warmup, "compiler_cpu_s", lambda pid: spent[0])


def test_stops_at_the_first_round_below_the_threshold(monkeypatch):
    _fake(monkeypatch, [1200, 900, 300, 40, 10, 10])
    out = warmup.settle_jit("http://x", None, 1, ["p"], round_requests=100, settled_us=50)
    assert out.settled and out.requests == 400
    assert [round(u) for u in out.compiler_us] == [1200, 900, 300, 40]


def test_gives_up_after_max_rounds_and_says_so(monkeypatch):
    _fake(monkeypatch, [500] * 5)
    out = warmup.settle_jit("http://x", None, 1, ["p"], round_requests=10, max_rounds=3)
    assert not out.settled and out.requests == 30 and len(out.compiler_us) == 3
