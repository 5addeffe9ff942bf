"""bench/soak.py's arithmetic: the JVM's native memory summary read per category, growth per
process after warm-up, and which growth counts as linear (a leak) rather than a step."""

from __future__ import annotations

import pytest

from bench import soak

# `jcmd PID VM.native_memory summary` of the frontend under the soak (Java 17), cut short
NMT = """10507:

Native Memory Tracking:

(Omitting categories weighting less than 1KB)

Total: reserved=618205KB, committed=404233KB
       malloc: 49533KB #142329
       mmap:   reserved=568672KB, committed=354700KB

-                 Java Heap (reserved=262144KB, committed=262144KB)
                            (mmap: reserved=262144KB, committed=262144KB)

-                     Class (reserved=82386KB, committed=3346KB)
                            (classes #5403)
                            (  Metadata:   )
                            (    reserved=65536KB, committed=21632KB)

-                    Thread (reserved=34161KB, committed=2861KB)
                            (thread #35)

-                      Code (reserved=66799KB, committed=11395KB)

-        Shared class space (reserved=12288KB, committed=12072KB)
"""


def test_nmt_summary_by_category() -> None:
    got = soak.parse_nmt(NMT)
    assert got["Total"] == {"reserved": 618205, "committed": 404233}
    assert got["Java Heap"]["committed"] == 262144
    assert got["Shared class space"] == {"reserved": 12288, "committed": 12072}
    assert set(got) == {"Total", "Java Heap", "Class", "Thread", "Code", "Shared class space"}
    # tracking off: jcmd answers with a line, not a summary
    assert soak.parse_nmt("10507:\nNative memory tracking is not enabled\n") is None


def test_nmt_deltas_cover_categories_on_either_side() -> None:
    before = {"categories": {"Total": {"committed": 100}, "Code": {"committed": 10}}}
    after = {"categories": {"Total": {"committed": 130}, "Code": {"committed": 15},
                            "Arena Chunk": {"committed": 20}}}
    assert soak.nmt_deltas(before, after) == {"Total": 30, "Arena Chunk": 20, "Code": 5}
    assert soak.nmt_deltas(None, after) is None


def _samples(rss: dict[str, list[int]], step: int = 1000) -> list[dict]:
    n = len(next(iter(rss.values())))
    return [{"requests": i * step, "rss_kb": {k: v[i] for k, v in rss.items()}}
            for i in range(n)]


def test_a_leak_is_linear_and_a_step_is_not() -> None:
    n = 40
    samples = _samples({
        "frontend": [400_000 + i * 1000 // 2 for i in range(n)],  # 0.5 KB/request, on and on
        "worker-1": [300_000 + (20_000 if i > 20 else 0) for i in range(n)],  # one step
        "engine-2": [200_000 + i % 2 for i in range(n)],  # noise
    })
    got = soak.process_slopes(samples, warmup=10_000)
    assert got["frontend"]["kb_per_request"] == pytest.approx(0.5)
    assert got["frontend"]["linear_growth"]
    assert not got["worker-1"]["linear_growth"]  # levelled off: flat in its last half
    assert not got["engine-2"]["linear_growth"]
    assert list(got) == ["frontend", "engine-2", "worker-1"]  # the frontend first
    assert got["frontend"]["rss_kb_after_warmup"] == 400_000 + 10 * 500


def test_small_steady_growth_is_noise_not_a_leak() -> None:
    # 0.01 KB/request: 1 MB over 100k requests, below both thresholds
    samples = _samples({"frontend": [400_000 + i * 10 for i in range(40)]}, step=2500)
    assert not soak.process_slopes(samples, warmup=0)["frontend"]["linear_growth"]


def test_verdict() -> None:
    ok = {"failed": 0, "frontend_kb_per_request": 0.05,
          "processes": {"frontend": {"linear_growth": False}}}
    assert soak.verdict(ok)["passed"]
    assert not soak.verdict({**ok, "failed": 1})["passed"]
    assert not soak.verdict({**ok, "frontend_kb_per_request": 0.6})["passed"]
    leak = {**ok, "processes": {"worker-7": {"linear_growth": True}}}
    assert soak.verdict(leak)["linearly_growing"] == ["worker-7"]
    assert not soak.verdict(leak)["passed"]
