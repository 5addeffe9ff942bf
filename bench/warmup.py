"""Warm TorchServe's frontend until its JIT compiler has settled, measured rather than guessed.

The JVM compiles the frontend's request path gradually: on this 2-core VM, with 1-token
requests at 32 streams, its C1/C2 compiler threads still used about 1 ms of CPU per request
after 6,000 requests (more than the frontend's own request handling, ~0.35 ms once compiled)
and fell to ~0.01 ms only after ~12,000. A figure taken before that measures the JVM's
warm-up, not the serving path a long-running server has. So a benchmark sends rounds of short
requests until a round costs the compiler threads less than `settled_us` per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import psutil

from archive_tools.bench_stats import Scenario
from archive_tools.loadgen import GenParams, run_scenario

#: HotSpot's compiler threads as /proc shows them ("C2 CompilerThre", "C1 CompilerThre")
COMPILER_THREADS = ("C1 CompilerThre", "C2 CompilerThre")


def compiler_cpu_s(pid: int) -> float:
    """CPU seconds the JVM `pid`'s JIT compiler threads have used so far (psutil's per-thread
    times; the thread names only Linux /proc gives)."""
    total = 0.0
    for thread in psutil.Process(pid).threads():
        try:
            name = Path(f"/proc/{pid}/task/{thread.id}/comm").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        if name.startswith(COMPILER_THREADS):
            total += thread.user_time + thread.system_time
    return total


@dataclass
class Warmup:
    settled_us: float
    requests: int = 0
    #: compiler CPU per request of each round, microseconds
    compiler_us: list[float] = field(default_factory=list)

    @property
    def settled(self) -> bool:
        return bool(self.compiler_us) and self.compiler_us[-1] < self.settled_us


def settle_jit(url: str, token: str | None, frontend_pid: int, prompts: list[str], *,
               round_requests: int = 1500, streams: int = 32, max_rounds: int = 20,
               settled_us: float = 50.0) -> Warmup:
    """Rounds of 2-token requests (one prefill, one decode step: the streamed path) until
    the frontend's compiler threads use less than `settled_us` of CPU per request."""
    out = Warmup(settled_us=settled_us)
    params = GenParams(max_new_tokens=2)
    for _ in range(max_rounds):
        before = compiler_cpu_s(frontend_pid)
        run_scenario(url, token, Scenario("concurrency", streams, requests=round_requests),
                     prompts, params)
        out.requests += round_requests
        out.compiler_us.append((compiler_cpu_s(frontend_pid) - before) / round_requests * 1e6)
        if out.settled:
            break
    return out
