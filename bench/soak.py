"""A bounded soak: one TorchServe, a mix of every kind of answer, memory sampled throughout.

Starts the tiny demo model like the end-to-end tests do (127.0.0.1 only, token auth),
then sends requests from a few client threads until `--requests` or `--duration` runs
out, cycling through streamed and non-streamed native answers, OpenAI completions and
chat (streamed and not), the SageMaker `/invocations` path and bad requests (400, 404).
Every answer is checked (status, content type, token count or error field). The
frontend's (java) and the worker's RSS are sampled every few seconds; the growth per
request after warm-up (the first third of the requests) is the least-squares slope of
RSS over answered requests. Where the JDK's jcmd exists, every `--count-every` samples
and at the end a full GC runs in the frontend and the live request objects and the heap in
use after it are recorded: the slope of the latter is the frontend's growth with the JVM's
heap sizing taken out (RSS also grows while the JVM expands its heap towards its default
maximum, a quarter of RAM). `--heap-mb` fixes the heap (-Xms = -Xmx, pre-touched) so RSS
shows only what lives outside it. After a failed answer the server's logs are kept (their
path is printed).

  python bench/soak.py --duration 600 --out bench/results/soak-after.json
  python bench/soak.py --duration 180 --heap-mb 256 --count-every 3 --out /tmp/soak.json
  python bench/soak.py --repo /path/to/older/checkout --out bench/results/soak-before.json
  python bench/soak.py report bench/results/soak-before.json bench/results/soak-after.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
TOKENS = 8
HANDLER = {"batching": "continuous", "batch_size": 8, "threads": 1}
CHAT = [{"role": "user", "content": "Tell me a story."}]


@dataclass(frozen=True)
class Kind:
    """One kind of request: where it goes, what it sends, how its answer is checked."""

    name: str
    path: str
    body: dict
    check: Callable[[httpx.Response], str | None]  # None = correct, else what is wrong


def _json_ok(key: Callable[[dict], int]) -> Callable[[httpx.Response], str | None]:
    def check(r: httpx.Response) -> str | None:
        if r.status_code != 200 or not r.headers.get("content-type", "").startswith(
                "application/json"):
            return f"{r.status_code} {r.headers.get('content-type')}"
        return None if key(r.json()) == TOKENS else f"tokens: {r.text[:200]}"
    return check


Check = Callable[[httpx.Response], "str | None"]


def _error(status: int, field: str | None, key: str = "field") -> Check:
    def check(r: httpx.Response) -> str | None:
        if r.status_code != status or r.headers.get("content-type") != "application/json":
            return f"{r.status_code} {r.headers.get('content-type')}"
        got = r.json()["error"].get(key)
        return None if got == field else f"error names {got!r}, not {field!r}"
    return check


def _text_stream(r: httpx.Response) -> str | None:
    ok = r.status_code == 200 and r.headers.get("content-type", "").startswith("text/plain")
    return None if ok and r.text else f"{r.status_code} {r.text[:200]!r}"


def _ndjson_stream(r: httpx.Response) -> str | None:
    if r.status_code != 200 or r.headers.get("content-type") != "application/x-ndjson":
        return f"{r.status_code} {r.headers.get('content-type')}"
    last = json.loads(r.text.splitlines()[-1])
    return None if last.get("completion_tokens") == TOKENS else f"last line {last}"


def _sse_stream(r: httpx.Response) -> str | None:
    if r.status_code != 200 or r.headers.get("content-type") != "text/event-stream":
        return f"{r.status_code} {r.headers.get('content-type')}"
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    if events[-1] != "[DONE]":
        return "no [DONE]"
    usage = json.loads(events[-2]).get("usage") or {}
    return None if usage.get("completion_tokens") == TOKENS else f"usage {usage}"


def kinds() -> list[Kind]:
    native, v1 = f"/predictions/{MODEL}", f"/predictions/{MODEL}/1.0/v1"
    n = {"max_new_tokens": TOKENS, "min_new_tokens": TOKENS}
    o = {"model": MODEL, "max_tokens": TOKENS, "min_tokens": TOKENS}
    return [
        Kind("native-text-stream", native, {"prompt": "Once", **n}, _text_stream),
        Kind("native-ndjson-stream", native, {"prompt": "Once", "stream_format": "ndjson", **n},
             _ndjson_stream),
        Kind("native-json", native, {"prompt": "Once", "stream": False, **n},
             _json_ok(lambda b: b["completion_tokens"])),
        Kind("native-400", native, {"prompt": "Once", "temperature": -1},
             _error(400, "temperature")),
        Kind("invocations-json", f"/invocations?model_name={MODEL}",
             {"prompt": "Once", "stream": False, **n}, _json_ok(lambda b: b["completion_tokens"])),
        Kind("openai-completion-json", f"{v1}/completions", {"prompt": "Once", **o},
             _json_ok(lambda b: b["usage"]["completion_tokens"])),
        Kind("openai-chat-json", f"{v1}/chat/completions", {"messages": CHAT, **o},
             _json_ok(lambda b: b["usage"]["completion_tokens"])),
        Kind("openai-chat-sse", f"{v1}/chat/completions",
             {"messages": CHAT, "stream": True, "stream_options": {"include_usage": True}, **o},
             _sse_stream),
        Kind("openai-400", f"{v1}/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1},
             _error(400, "max_tokens", "param")),
        Kind("openai-404", f"{v1}/embeddings", {"model": MODEL, "input": "x"},
             _error(404, None, "param")),
    ]


class Memory:
    """RSS of the frontend (java) and its worker processes, sampled on a thread."""

    def __init__(self, frontend_pid: int, done: Callable[[], int], every_s: float,
                 count_every: int = 12) -> None:
        import psutil

        self.frontend = psutil.Process(frontend_pid)
        self.done, self.every_s, self.count_every = done, every_s, count_every
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.monotonic()

    def sample(self) -> None:
        workers = [p for p in self.frontend.children(recursive=True) if "python" in p.name()]
        sample = {"t_s": round(time.monotonic() - self.started, 1), "requests": self.done(),
                  "frontend_rss_kb": self.frontend.memory_info().rss // 1024,
                  "worker_rss_kb": sum(p.memory_info().rss for p in workers) // 1024}
        if len(self.samples) % self.count_every == 0:  # a full GC in the frontend: not often
            sample["live_request_objects"] = live_request_objects(self.frontend.pid)
            sample["frontend_heap_after_gc_kb"] = heap_used_kb(self.frontend.pid)
        self.samples.append(sample)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __enter__(self) -> Memory:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def slope_kb_per_request(samples: list[dict], key: str, warmup: int) -> float | None:
    """Least-squares slope of `key` over answered requests, samples after `warmup` only."""
    pts = [(s["requests"], s[key]) for s in samples if s["requests"] >= warmup]
    if len(pts) < 3 or pts[-1][0] == pts[0][0]:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / var


def live_request_objects(pid: int) -> int | None:
    """Live org.pytorch.serve.job.RestJob objects after a full GC; None without jcmd."""
    if shutil.which("jcmd") is None:
        return None
    out = subprocess.run(["jcmd", str(pid), "GC.class_histogram"], capture_output=True,
                         text=True, timeout=300).stdout
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[-1] == "org.pytorch.serve.job.RestJob":
            return int(parts[1])
    return 0


def heap_used_kb(pid: int) -> int | None:
    """The frontend's heap in use, read right after `live_request_objects`' full GC."""
    if shutil.which("jcmd") is None:
        return None
    out = subprocess.run(["jcmd", str(pid), "GC.heap_info"], capture_output=True, text=True,
                         timeout=60).stdout
    # G1, Java 17: " garbage-first heap   total 262144K, used 41234K [0x..."
    match = re.search(r"heap\s+total \d+K, used (\d+)K", out)
    return int(match.group(1)) if match else None


def soak(server, max_requests: int, duration_s: float, concurrency: int,
         sample_every_s: float, count_every: int = 12) -> dict:
    order = itertools.cycle(kinds())
    lock = threading.Lock()
    counts: Counter[str] = Counter()
    failures: list[dict] = []
    sent = 0
    deadline = time.monotonic() + duration_s
    headers = {"Authorization": f"Bearer {server.inference_token}"}

    def next_kind() -> Kind | None:
        nonlocal sent
        with lock:
            if sent >= max_requests or time.monotonic() >= deadline:
                return None
            sent += 1
            return next(order)

    def client() -> None:
        with httpx.Client(base_url=server.inference_url, headers=headers, timeout=120) as c:
            while (kind := next_kind()) is not None:
                try:
                    problem = kind.check(c.post(kind.path, json=kind.body))
                except Exception as exc:  # a broken answer is a finding, not a crash
                    problem = repr(exc)
                with lock:
                    counts[kind.name] += 1
                    if problem is not None:
                        counts["failed"] += 1
                        if len(failures) < 20:
                            failures.append({"kind": kind.name, "problem": problem})

    started = time.monotonic()
    with Memory(server.pid, lambda: sum(v for k, v in counts.items() if k != "failed"),
                sample_every_s, count_every) as memory:
        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elapsed = time.monotonic() - started
    answered = sum(v for k, v in counts.items() if k != "failed")
    warmup = answered // 3  # the JVM grows its heap for a while whether or not it leaks
    gc_points = [s for s in memory.samples if s.get("frontend_heap_after_gc_kb") is not None]
    return {
        "requests": answered, "failed": counts["failed"], "seconds": round(elapsed, 1),
        "requests_per_s": round(answered / elapsed, 2), "concurrency": concurrency,
        "by_kind": {k: v for k, v in sorted(counts.items()) if k != "failed"},
        "failures": failures, "warmup_requests": warmup,
        "frontend_kb_per_request": _round(slope_kb_per_request(memory.samples,
                                                               "frontend_rss_kb", warmup)),
        "worker_kb_per_request": _round(slope_kb_per_request(memory.samples, "worker_rss_kb",
                                                             warmup)),
        "frontend_live_heap_kb_per_request": _round(slope_kb_per_request(
            gc_points, "frontend_heap_after_gc_kb", warmup)),
        "live_request_objects_at_end": live_request_objects(server.pid),
        "frontend_heap_after_gc_kb_at_end": heap_used_kb(server.pid),
        "samples": memory.samples,
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def run(args: argparse.Namespace) -> int:
    repo = Path(args.repo).resolve()
    sys.path.insert(0, str(repo))  # package and serve the runtime of that checkout
    from archive_tools.demo_model import build_demo_model
    from tests.e2e.harness import ArchiveSpec, build_store, running_server

    work = Path(tempfile.mkdtemp(prefix="inf2serve-soak-"))
    result: dict = {"failed": 1}
    try:
        checkpoint = build_demo_model(work / "ckpt", "tiny", seed=0)
        store = build_store(work, checkpoint, [ArchiveSpec(MODEL, handler=HANDLER)])
        # fixed and pre-touched: RSS then grows only with what lives outside the heap
        heap = {"vmargs": f"-Xms{args.heap_mb}m -Xmx{args.heap_mb}m -XX:+AlwaysPreTouch"}
        with running_server(store, work / "run", [MODEL],
                            **({"extra_props": heap} if args.heap_mb else {})) as server:
            result = soak(server, args.requests, args.duration, args.concurrency,
                          args.sample_every, args.count_every)
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        result = {"repo_commit": commit or None, "label": args.label,
                  "heap_mb": args.heap_mb or None, **result}
    finally:
        if result["failed"]:
            print(f"server logs kept in {work / 'run' / 'logs'}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    return 1 if result["failed"] else 0


def report(paths: list[str]) -> int:
    """A markdown table of soak results, one row per file."""
    print("| run | requests | failed | req/s | frontend RSS KB/request | frontend live heap "
          "KB/request | worker KB/request | live RestJob at end |\n"
          "|---|---|---|---|---|---|---|---|")
    for path in paths:
        r = json.loads(Path(path).read_text())
        print(f"| {r.get('label') or path} | {r['requests']} | {r['failed']} | "
              f"{r['requests_per_s']} | {r['frontend_kb_per_request']} | "
              f"{r.get('frontend_live_heap_kb_per_request')} | "
              f"{r['worker_kb_per_request']} | {r['live_request_objects_at_end']} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        return report(argv[1:])
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=100_000, help="stop after this many")
    p.add_argument("--duration", type=float, default=600, help="stop after this many seconds")
    p.add_argument("--concurrency", type=int, default=4, help="client threads")
    p.add_argument("--sample-every", type=float, default=5, help="seconds between RSS samples")
    p.add_argument("--count-every", type=int, default=12,
                   help="samples between full GCs in the frontend (live objects, heap in use)")
    p.add_argument("--heap-mb", type=int, default=0,
                   help="fix the frontend's heap (-Xms = -Xmx, pre-touched); 0 = JVM default")
    p.add_argument("--repo", default=str(ROOT), help="checkout whose runtime is served")
    p.add_argument("--label", default="", help="name of this run in reports")
    p.add_argument("--out", default="bench/results/soak.json")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
