"""Scratch probe for issue 13: host efficiency of the serving path with a sleeping "device".

A handler subclass whose backend sleeps a fixed time per model call and returns fixed
real token ids (no model compute), served through a real TorchServe (tests/e2e/harness.py);
closed-loop streams of 128-token requests; host efficiency = served tokens/s / (streams /
step). Not the official scenario (that is `backend: synthetic` in bench/run_bench.py).

  python bench/overlap_probe.py --runtime /path/to/tree-with-handlers --streams 1,8,32 \
      --steps-ms 10,5 --requests 4 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

NEW_TOKENS = 128
SLEEP_ENTRY = '''
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "runtime"))

from handlers.torchserve.generation_handler import GenerationHandler  # noqa: E402

STEP_S = {step_s}
IDS = list(range(300, 812))  # real ids of the demo vocabulary, never EOS


def sleep_backend(batch_size):
    """Defined in here: TorchServe wants exactly one class in the handler module."""
    from handlers.backends.base import Backend

    class SleepBackend(Backend):
        def __init__(self):
            self.batch_size, self.max_length = batch_size, 512
            self.max_prompt_length, self.eos_token_ids = 511, frozenset([2])
            self.n = {{}}

        def _prefill(self, slots, prompts, params):  # no device time: decode steps only
            for s in slots:
                self.n[s] = 0
            return [IDS[0] for _ in slots]

        def _decode(self, slots):
            time.sleep(STEP_S)
            out = []
            for s in slots:
                self.n[s] += 1
                out.append([IDS[self.n[s] % len(IDS)]])
            return out

        def _release(self, slots):
            for s in slots:
                self.n.pop(s, None)

    return SleepBackend()


class SleepHandler(GenerationHandler):
    def make_backend(self, config, model_dir):
        return sleep_backend(config.handler.batch_size)
'''


async def one_stream(session, url, headers, n_requests, prompt):
    body = {"prompt": prompt, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}
    for _ in range(n_requests):
        async with session.post(url, json=body, headers=headers) as r:
            assert r.status == 200, r.status
            async for _ in r.content.iter_any():
                pass


def server_procs(run_dir):
    """This TorchServe's processes (frontend, workers, engine processes) by role."""
    import psutil

    out = {}
    for proc in psutil.process_iter(["cmdline", "pid"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if "org.pytorch.serve.ModelServer" in cmd and str(run_dir) in cmd:
            out["frontend"] = [proc]
            for child in proc.children(recursive=True):
                ccmd = " ".join(child.cmdline())
                role = "worker" if "model_service_worker" in ccmd else "engine"
                out.setdefault(role, []).append(child)
    return out


def cpu_seconds(procs):
    import os

    total = {}
    for role, ps in procs.items():
        t = 0.0
        for p in ps:
            try:
                c = p.cpu_times()
                t += c.user + c.system
            except Exception:
                pass
        total[role] = t
    c = os.times()
    total["loadgen"] = c.user + c.system
    return total


async def closed_loop(url, token, streams, n_requests, run_dir, profile=None):
    import subprocess

    headers = {"Authorization": f"Bearer {token}"}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        await one_stream(session, url, headers, 1, "warm up")
        procs = server_procs(run_dir)
        spies = []
        if profile:
            for role in ("worker", "engine"):
                for p in procs.get(role, []):
                    spies.append(subprocess.Popen(
                        [str(Path(sys.executable).parent / "py-spy"), "record", "-r", "250",
                         "-d", "5", "--format", "raw", "-t", "-o",
                         f"{profile}-{role}-{p.pid}.txt", "--pid", str(p.pid)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        before = cpu_seconds(procs)
        t0 = time.monotonic()
        await asyncio.gather(*(one_stream(session, url, headers, n_requests, f"Hello {i}")
                               for i in range(streams)))
        wall = time.monotonic() - t0
        after = cpu_seconds(procs)
        for spy in spies:
            spy.wait()
        return wall, {k: after[k] - before[k] for k in after}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runtime", required=True, help="tree whose handlers/ gets packaged")
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--steps-ms", default="10,5")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--engine-process", default="child")
    p.add_argument("--work", default="/tmp/overlap-probe")
    p.add_argument("--out")
    p.add_argument("--profile", help="py-spy raw profiles of the last scenario, this prefix")
    args = p.parse_args()
    sys.path.insert(0, args.runtime)
    import handlers
    from archive_tools.demo_model import build_demo_model
    from tests.e2e.harness import ArchiveSpec, build_store, running_server
    assert Path(handlers.__file__).resolve().is_relative_to(Path(args.runtime).resolve()), \
        handlers.__file__
    work = Path(args.work)
    ckpt = work / "ckpt" / "tiny-llama"
    if not (ckpt / "config.json").exists():
        build_demo_model(ckpt, "tiny", seed=0)
    steps = [float(s) for s in args.steps_ms.split(",")]
    streams = [int(s) for s in args.streams.split(",")]
    specs = [ArchiveSpec(f"sleep{int(ms * 10)}", fmt="no-archive",
                         handler={"batch_size": max(streams), "threads": 1,
                                  "max_new_tokens_limit": 256, "warmup": False,
                                  "engine_process": args.engine_process},
                         entry_source=SLEEP_ENTRY.format(step_s=ms / 1000)) for ms in steps]
    root = work / f"run-{time.time_ns()}"
    store = build_store(root, ckpt, specs)
    out = []
    with running_server(store, root / "run", [s.name for s in specs], test_jvm=False) as srv:
        for ms, spec in zip(steps, specs, strict=True):
            url = f"{srv.inference_url}/predictions/{spec.name}"
            for n in streams:
                last = (ms, n) == (steps[-1], streams[-1])
                wall, cpu = asyncio.run(closed_loop(url, srv.inference_token, n, args.requests,
                                                    srv.run_dir,
                                                    args.profile if last else None))
                tokens = n * args.requests * NEW_TOKENS
                tps = tokens / wall
                eff = tps / (n / (ms / 1000))
                us = {k: round(v / tokens * 1e6, 1) for k, v in cpu.items()}
                out.append({"step_ms": ms, "streams": n, "tokens_per_s": tps, "eff": eff,
                            "cpu_us_per_token": us})
                print(f"step {ms} ms streams {n}: {tps:.0f} tok/s eff {eff:.3f} "
                      f"cpu us/token {us}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out))
    _ = statistics


if __name__ == "__main__":
    main()
