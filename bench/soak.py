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
heap sizing taken out.

The frontend runs with the JVM options `inf2serve serve` and the exports deploy
(archive_tools/jvm_options.py: fixed pre-touched heap, bounded metaspace, code cache and
direct buffers; `--heap-mb` sizes the heap) plus native memory tracking, whose summary
(`jcmd PID VM.native_memory summary`: committed memory per category, Java Heap, Class,
Code, Thread, GC, Internal, Other = NIO direct buffers, ...) is taken at the start, after
warm-up and at the end. Every process is sampled: the frontend, each TorchServe worker and
each engine process under it, each with its own growth per request and a verdict (growing
linearly or not: `linear_growth`). After a failed answer the server's logs are kept (their
path is printed).

  python bench/soak.py --requests 100000 --duration 3600 --out bench/results/soak-100k-deployed.json
  python bench/soak.py --requests 3000 --duration 300 --count-every 3 --out /tmp/soak.json
  python bench/soak.py --repo /path/to/older/checkout --out bench/results/soak-before.json
  python bench/soak.py report bench/results/soak-before.json bench/results/soak-after.json
  python bench/soak.py detail bench/results/soak-100k-deployed.json   # processes, NMT
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import httpx


def _jvm_options() -> ModuleType:
    """This checkout's archive_tools/jvm_options.py, loaded by path: the deployed options
    even when `--repo` serves an older checkout (whose `archive_tools` is then imported)."""
    path = Path(__file__).resolve().parents[1] / "archive_tools" / "jvm_options.py"
    spec = importlib.util.spec_from_file_location("_soak_jvm_options", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


JVM = _jvm_options()

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
TOKENS = 8
HANDLER = {"batching": "continuous", "batch_size": 8, "threads": 1}
CHAT = [{"role": "user", "content": "Tell me a story."}]
#: a process "grows linearly" when, after warm-up, it grows at least this fast...
LINEAR_KB_PER_REQUEST = 0.05
#: ...and has not levelled off: its last half grows at least this share of that rate...
LINEAR_LAST_HALF_SHARE = 0.5
#: ...by at least this much (smaller steps are allocator noise)
LINEAR_MIN_KB = 2048


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
    """RSS of the frontend (java) and of every process under it, sampled on a thread.

    Processes are named by role and pid: `frontend`, `worker-PID` (TorchServe's Python
    workers, the frontend's children) and `engine-PID` (what a worker starts)."""

    def __init__(self, frontend_pid: int, done: Callable[[], int], every_s: float,
                 count_every: int = 12) -> None:
        import psutil

        self.frontend = psutil.Process(frontend_pid)
        self.done, self.every_s, self.count_every = done, every_s, count_every
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.monotonic()

    def processes(self) -> dict[str, int]:
        """RSS in KB of each process of the server, by name."""
        import psutil

        rss = {"frontend": self.frontend.memory_info().rss // 1024}
        for child in self.frontend.children():
            try:
                rss[f"worker-{child.pid}"] = child.memory_info().rss // 1024
                for grandchild in child.children(recursive=True):
                    rss[f"engine-{grandchild.pid}"] = grandchild.memory_info().rss // 1024
            except psutil.Error:  # gone between listing and reading
                continue
        return rss

    def sample(self) -> None:
        rss = self.processes()
        sample = {"t_s": round(time.monotonic() - self.started, 1), "requests": self.done(),
                  "frontend_rss_kb": rss["frontend"],
                  "worker_rss_kb": sum(v for k, v in rss.items() if k != "frontend"),
                  "rss_kb": rss}
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

    def __exit__(self, *exc: object) -> None:
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


def process_slopes(samples: list[dict], warmup: int) -> dict[str, dict]:
    """Per process: growth per request after warm-up (KB), over the last half of that
    window too, RSS at warm-up and at the end, and whether it grows linearly."""
    out = {}
    names = {name for s in samples for name in s.get("rss_kb", {})}
    for name in sorted(names, key=lambda n: (n != "frontend", n)):
        pts = [{"requests": s["requests"], "kb": s["rss_kb"][name]} for s in samples
               if s["requests"] >= warmup and name in s.get("rss_kb", {})]
        slope = slope_kb_per_request(pts, "kb", warmup)
        if slope is None:
            continue
        half = pts[0]["requests"] + (pts[-1]["requests"] - pts[0]["requests"]) / 2
        last = [p for p in pts if p["requests"] >= half]
        last_slope = slope_kb_per_request(last, "kb", 0) if len(last) >= 3 else None
        last_growth = last[-1]["kb"] - last[0]["kb"] if last else 0
        out[name] = {"kb_per_request": _round(slope), "last_half_kb_per_request":
                     _round(last_slope), "rss_kb_after_warmup": pts[0]["kb"],
                     "rss_kb_at_end": pts[-1]["kb"],
                     "linear_growth": linear_growth(slope, last_slope, last_growth)}
    return out


def linear_growth(slope: float, last_half_slope: float | None, last_half_kb: int) -> bool:
    """Growth that goes on with the requests, not a step that levelled off: fast enough, still
    as fast in the last half, and by more than allocator noise."""
    return (slope >= LINEAR_KB_PER_REQUEST and last_half_slope is not None
            and last_half_slope >= LINEAR_LAST_HALF_SHARE * slope
            and last_half_kb >= LINEAR_MIN_KB)


NMT_CATEGORY = re.compile(r"^-\s+(.+?) \(reserved=(\d+)KB, committed=(\d+)KB\)", re.M)
NMT_TOTAL = re.compile(r"^Total: reserved=(\d+)KB, committed=(\d+)KB", re.M)


def parse_nmt(text: str) -> dict[str, dict[str, int]] | None:
    """`VM.native_memory summary` as {category: {"reserved": KB, "committed": KB}}, with
    "Total"; None when tracking is off (jcmd says so) or the output is not a summary."""
    total = NMT_TOTAL.search(text)
    if total is None:
        return None
    out = {"Total": {"reserved": int(total.group(1)), "committed": int(total.group(2))}}
    for name, reserved, committed in NMT_CATEGORY.findall(text):
        out[name.strip()] = {"reserved": int(reserved), "committed": int(committed)}
    return out


def native_memory(pid: int) -> dict | None:
    """The frontend's native memory tracking summary, and its RSS at the same moment (what
    RSS holds beyond NMT's committed total is malloc's and the kernel's slack)."""
    if shutil.which("jcmd") is None:
        return None
    import psutil

    out = subprocess.run(["jcmd", str(pid), "VM.native_memory", "summary"],
                         capture_output=True, text=True, timeout=60).stdout
    categories = parse_nmt(out)
    if categories is None:
        return None
    return {"rss_kb": psutil.Process(pid).memory_info().rss // 1024, "categories": categories}


def nmt_deltas(before: dict | None, after: dict | None) -> dict[str, int] | None:
    """Committed KB per category, after minus before (categories in either)."""
    if not before or not after:
        return None
    a, b = after["categories"], before["categories"]
    names = sorted(set(a) | set(b), key=lambda n: (n != "Total", n))
    return {n: a.get(n, {}).get("committed", 0) - b.get(n, {}).get("committed", 0)
            for n in names}


def java_cmdline(pid: int) -> list[str]:
    """The frontend's command line: the soak checks its JVM options reached java."""
    import psutil

    return psutil.Process(pid).cmdline()


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
    """Send the mix, check every answer, sample memory; the result as a dict."""
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

    def answered_now() -> int:
        return sum(v for k, v in counts.items() if k != "failed")

    # warm-up: the first third of what will be sent (the JIT, Netty's arenas and the heap's
    # regions fill during it whether or not anything leaks)
    planned_warmup, warm_s = max_requests // 3, duration_s / 3  # whichever comes first
    nmt = {"start": native_memory(server.pid)}
    started = time.monotonic()
    with Memory(server.pid, answered_now, sample_every_s, count_every) as memory:
        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            if "warm" not in nmt and (answered_now() >= planned_warmup
                                      or time.monotonic() - started >= warm_s):
                nmt["warm"] = {"requests": answered_now(), **(native_memory(server.pid) or {})}
            time.sleep(1)
        for t in threads:
            t.join()
    elapsed = time.monotonic() - started
    nmt["end"] = native_memory(server.pid)
    answered = answered_now()
    warmup = answered // 3
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
        "processes": process_slopes(memory.samples, warmup),
        "nmt": nmt,
        "nmt_committed_delta_kb": {"warmup": nmt_deltas(nmt["start"], nmt.get("warm")),
                                   "after_warmup": nmt_deltas(nmt.get("warm"), nmt["end"])},
        "samples": memory.samples,
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


@contextlib.contextmanager
def deployed_server(store: Path, run_dir: Path, heap_mb: int, nmt: bool = True
                    ) -> Iterator[tuple[object, dict]]:
    """TorchServe started by the checkout's own `serve.start`, with the frontend's deployed
    JVM options (FrontendMemory) and native memory tracking (`nmt`). Yields the server and
    what its JVM was given. An older checkout whose `start` has no `frontend` gets the same
    options through config.properties' vmargs."""
    from archive_tools import serve

    frontend = JVM.FrontendMemory(heap_mib=heap_mb)
    if "frontend" in inspect.signature(serve.start).parameters:
        kwargs: dict = {"frontend": frontend, "native_memory_tracking": nmt}
    else:
        kwargs = {"extra_props": {"vmargs": frontend.vmargs(native_memory_tracking=nmt)}}
    try:
        server = serve.start(store, [MODEL], run_dir, ready_timeout_s=300, **kwargs)
    except BaseException:
        serve.stop(run_dir)
        raise
    try:
        jvm = {"vmargs": frontend.vmargs(native_memory_tracking=nmt),
               "frontend_budget_mib": frontend.budget_mib,
               "java_cmdline": [a for a in java_cmdline(server.pid) if a.startswith("-X")]}
        yield server, jvm
    finally:
        serve.stop(run_dir)


def run(args: argparse.Namespace) -> int:
    repo = Path(args.repo).resolve()
    sys.path.insert(0, str(repo))  # package and serve the runtime of that checkout
    from archive_tools.demo_model import build_demo_model
    from tests.e2e.harness import ArchiveSpec, build_store

    work = Path(tempfile.mkdtemp(prefix="inf2serve-soak-"))
    result: dict = {"failed": 1}
    try:
        checkpoint = build_demo_model(work / "ckpt", "tiny", seed=0)
        store = build_store(work, checkpoint, [ArchiveSpec(MODEL, handler=HANDLER)])
        with deployed_server(store, work / "run", args.heap_mb,
                             args.native_memory_tracking) as (server, jvm):
            result = soak(server, args.requests, args.duration, args.concurrency,
                          args.sample_every, args.count_every)
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True).stdout
        result = {"repo_commit": commit or None, "repo_modified": bool(dirty.strip()),
                  "label": args.label, "heap_mb": args.heap_mb, **jvm,
                  "verdict": verdict(result), **result}
    finally:
        if result["failed"]:
            print(f"server logs kept in {work / 'run' / 'logs'}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "nmt")},
                     indent=1))
    return 1 if result["failed"] else 0


#: the acceptance of a soak: frontend RSS growth per request after warm-up, at most (KB)
FRONTEND_KB_PER_REQUEST_MAX = 0.5


def verdict(result: dict) -> dict:
    """Whether the soak passes: nothing failed, the frontend's RSS grew at most
    FRONTEND_KB_PER_REQUEST_MAX per request after warm-up, no process grew linearly."""
    growing = sorted(n for n, p in result.get("processes", {}).items() if p["linear_growth"])
    frontend = result.get("frontend_kb_per_request")
    ok = (result["failed"] == 0 and frontend is not None
          and frontend <= FRONTEND_KB_PER_REQUEST_MAX and not growing)
    return {"passed": ok, "failed_requests": result["failed"],
            "frontend_kb_per_request": frontend, "linearly_growing": growing}


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


def detail(path: str) -> int:
    """Markdown tables of one soak: each process's growth, the frontend's NMT categories."""
    r = json.loads(Path(path).read_text())
    print("| process | RSS after warm-up (MB) | RSS at end (MB) | KB/request after warm-up | "
          "last half KB/request | linear growth |\n|---|---|---|---|---|---|")
    for name, p in r.get("processes", {}).items():
        print(f"| {name} | {p['rss_kb_after_warmup'] / 1024:.1f} | "
              f"{p['rss_kb_at_end'] / 1024:.1f} | {p['kb_per_request']} | "
              f"{p['last_half_kb_per_request']} | {'yes' if p['linear_growth'] else 'no'} |")
    nmt = r.get("nmt") or {}
    snaps = [(k, nmt[k]) for k in ("start", "warm", "end") if nmt.get(k)]
    if not snaps:
        return 0
    names = [n for n in snaps[-1][1]["categories"]]
    print("\nFrontend native memory tracking, committed MB (" + ", ".join(
        f"{k}: {v['requests']} requests" for k, v in snaps if "requests" in v) + ")\n")
    print("| category | " + " | ".join(k for k, _ in snaps) + " | after warm-up delta |\n|---|"
          + "---|" * (len(snaps) + 1))
    after = (r.get("nmt_committed_delta_kb") or {}).get("after_warmup") or {}
    for name in names:
        cells = [f"{v['categories'].get(name, {}).get('committed', 0) / 1024:.1f}"
                 for _, v in snaps]
        delta = after.get(name)
        print(f"| {name} | " + " | ".join(cells) + f" | "
              f"{'-' if delta is None else f'{delta / 1024:+.1f}'} |")
    print("| (process RSS) | " + " | ".join(f"{v['rss_kb'] / 1024:.1f}" for _, v in snaps)
          + " | |")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        return report(argv[1:])
    if argv[:1] == ["detail"] and len(argv) == 2:
        return detail(argv[1])
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=100_000, help="stop after this many")
    p.add_argument("--duration", type=float, default=600, help="stop after this many seconds")
    p.add_argument("--concurrency", type=int, default=4, help="client threads")
    p.add_argument("--sample-every", type=float, default=5, help="seconds between RSS samples")
    p.add_argument("--count-every", type=int, default=12,
                   help="samples between full GCs in the frontend (live objects, heap in use)")
    p.add_argument("--heap-mb", type=int, default=JVM.DEFAULT_HEAP_MIB,
                   help="the frontend's heap (archive_tools/jvm_options.py: as `inf2serve serve "
                   "--frontend-heap-mb` sets it)")
    p.add_argument("--native-memory-tracking", action=argparse.BooleanOptionalAction,
                   default=True, help="-XX:NativeMemoryTracking=summary in the frontend, read "
                   "by jcmd (on by default; --no-native-memory-tracking measures its cost)")
    p.add_argument("--repo", default=str(ROOT), help="checkout whose runtime is served")
    p.add_argument("--label", default="", help="name of this run in reports")
    p.add_argument("--out", default="bench/results/soak.json")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
