"""Start a real TorchServe on packaged archives, and read its streams.

Used by every end-to-end test: free ports, a temporary model store and run
directory, READY checked through the management API, token auth on, and the
server always stopped (no Java process left) -- its logs are attached to failures.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from archive_tools import serve
from archive_tools.package import package

BASE_CONFIG = Path(__file__).resolve().parents[2] / "model_configs" / "tiny-llama-cpu.yaml"
#: JVM options of a test server, after the product's (HotSpot takes the last of a repeated
#: one): a test server lives for seconds to minutes, where C2 compiling TorchServe's hot
#: paths, G1's threads and pre-touching a 256 MiB heap are start-up CPU that never pays
#: back. The client compiler only, the serial collector, no pre-touch: the frontend's CPU
#: to READY and one request, median of 3 paired starts on 2 shared cores, 3.8 s -> 2.6 s.
#: A test's own `vmargs` in extra_props replaces these.
TEST_VMARGS = ("-XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 -XX:-UseG1GC -XX:+UseSerialGC "
               "-XX:-AlwaysPreTouch")


def make_config(path: Path, frontend: dict | None = None, handler: dict | None = None) -> Path:
    """The shipped tiny config with overrides, written to `path`."""
    data = yaml.safe_load(BASE_CONFIG.read_text())
    data.update(frontend or {})
    data["handler"].update(handler or {})
    path.write_text(yaml.safe_dump(data))
    return path


@dataclass
class ArchiveSpec:
    name: str
    frontend: dict = field(default_factory=dict)
    handler: dict = field(default_factory=dict)
    fmt: str = "mar"
    entry_source: str | None = None  # replaces handler_entry.py (no-archive only)


def build_store(root: Path, checkpoint: Path, specs: list[ArchiveSpec]) -> Path:
    store = root / "model_store"
    store.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        cfg = make_config(root / f"{spec.name}.yaml", spec.frontend, spec.handler)
        target = package(cfg, checkpoint, spec.name, spec.fmt, store, force=True)
        if spec.entry_source is not None:
            (target / "handler_entry.py").write_text(spec.entry_source)
    return store


@contextlib.contextmanager
def running_server(store: Path, run_dir: Path, models: list[str],
                   env: dict[str, str] | None = None, workers: int = 1,
                   python: str | None = None, extra_props: dict[str, str] | None = None,
                   openai_port: int | None = None,
                   ready_timeout_s: float = 300,
                   neuron_monitor: bool = False,
                   test_jvm: bool = True) -> Iterator[serve.Server]:
    """TorchServe serving `models` of `store` for the block. `test_jvm` False: the frontend's
    JVM runs as the product starts it (no TEST_VMARGS), for a benchmark that measures the
    serving path a long-running server has, its JIT settled (bench/warmup.py)."""
    server = None
    props = {"vmargs": TEST_VMARGS} if test_jvm else {}
    try:
        server = serve.start(store, models, run_dir, env=env, workers=workers, python=python,
                             ready_timeout_s=ready_timeout_s,
                             extra_props={**props, **(extra_props or {})},
                             openai_port=openai_port, neuron_monitor=neuron_monitor)
        yield server
    finally:
        serve.stop(run_dir)
        if server is not None:
            _assert_no_java(run_dir)


def _assert_no_java(run_dir: Path) -> None:
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if "org.pytorch.serve.ModelServer" in cmd and str(run_dir) in cmd:
            raise AssertionError(f"TorchServe still running after stop: pid {proc.pid}")


@dataclass
class StreamResult:
    status: int
    headers: dict
    chunks: list[tuple[float, bytes]]  # (arrival time, bytes) as read from the socket
    started: float
    ended: float

    @property
    def body(self) -> bytes:
        return b"".join(c for _, c in self.chunks)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8")

    def json(self) -> Any:
        return json.loads(self.body)

    def ndjson(self) -> list[dict]:
        return [json.loads(line) for line in self.text.splitlines() if line.strip()]


def post(server: serve.Server, model: str, body: Any, timeout: float = 120,
         headers: dict | None = None) -> StreamResult:
    """POST and read the chunked response as it arrives."""
    hdrs = {"Authorization": f"Bearer {server.inference_token}"}
    hdrs.update(headers or {})
    kwargs = {"json": body} if isinstance(body, dict) else {"content": body}
    started = time.monotonic()
    with httpx.Client(timeout=timeout) as client:
        with client.stream("POST", f"{server.inference_url}/predictions/{model}",
                           headers=hdrs, **kwargs) as r:
            chunks = [(time.monotonic(), c) for c in r.iter_raw() if c]
            return StreamResult(r.status_code, dict(r.headers), chunks, started,
                                time.monotonic())


def logs(run_dir: Path) -> str:
    return serve.log_tail(run_dir, 200)


def logged(run_dir: Path, text: str, timeout_s: float = 10) -> bool:
    """Whether `text` reaches the logs within `timeout_s`: an answer can overtake the log
    lines of its own failure (TorchServe copies the worker's stdout line by line)."""
    deadline = time.monotonic() + timeout_s
    while text not in logs(run_dir):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def attach_logs_fixture():
    """An autouse fixture printing the module's `server` log tail after a failed test.

    Bind it in a test module (`_attach_logs = attach_logs_fixture()`); pytest shows
    the output with the failure. Needs tests/conftest.py's rep_call hook.
    """
    @pytest.fixture(autouse=True)
    def _attach_logs(request, server):
        yield
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            print(logs(server.run_dir))

    return _attach_logs


def cleanup(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
