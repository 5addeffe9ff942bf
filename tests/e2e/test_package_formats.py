"""Every archive format `package` writes is served, and streams, by a stock TorchServe.

The server runs from a separate virtualenv with torchserve, torch and transformers
but without inf2serve (tests/e2e/_venv.py), so each archive must carry its own
runtime. One TorchServe serves all four archives (one model per format), and one
packaged with a user's handler subclass, extra files and requirements, to keep the
suite fast; the SageMaker export is served through its own `serve` script.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from archive_tools import serve
from archive_tools.export import export
from archive_tools.package import FORMATS, package
from archive_tools.ports import free_port

from ._venv import importable, make_serving_venv

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs a Java 17 runtime"),
]
CONFIG = Path(__file__).resolve().parents[2] / "model_configs" / "tiny-llama-cpu.yaml"
REQUEST = {"prompt": "Hello", "max_new_tokens": 8, "min_new_tokens": 8}
NAMES = {fmt: f"tiny-{fmt}" for fmt in FORMATS}
CUSTOM = "tiny-custom"
#: a user's handler: pre-processing that caps every request with settings from its extra
#: files (a module and a JSON file beside it at the top of the archive)
USER_HANDLER = """
import json

from capped_settings import SETTINGS

from handlers.torchserve.generation_handler import GenerationHandler


class CappedHandler(GenerationHandler):
    async def serve_one(self, writer, item):
        key = "body" if "body" in item else "data"
        body = item[key]
        if isinstance(body, (bytes, bytearray)):
            body = json.loads(body)
        return await super().serve_one(writer, {**item, key: {**body, **SETTINGS}})
"""
USER_MODULE = """
import json
from pathlib import Path

SETTINGS = json.loads((Path(__file__).parent / "capped.json").read_text())
"""
CAPPED = {"max_new_tokens": 3, "min_new_tokens": 3, "stream_format": "ndjson"}


@pytest.fixture(scope="session")
def serving_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv that has torchserve/torch/transformers and provably not this toolkit."""
    python = make_serving_venv(tmp_path_factory.mktemp("serving-venv") / "venv")
    neutral = tmp_path_factory.mktemp("neutral-cwd")
    for module in ("ts", "torch", "transformers", "tokenizers", "safetensors", "yaml"):
        assert importable(python, module, neutral), module
    for module in ("handlers", "archive_tools", "neuron_cache", "model_archiver"):
        assert not importable(python, module, neutral), f"{module} leaked into the serving venv"
    return python


@pytest.fixture(scope="module")
def store(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model_store")
    for fmt, name in NAMES.items():
        package(CONFIG, tiny_checkpoint, name, fmt, out)
    user = tmp_path_factory.mktemp("user")
    (user / "capped_handler.py").write_text(USER_HANDLER)
    (user / "capped_settings.py").write_text(USER_MODULE)
    (user / "capped.json").write_text(json.dumps(CAPPED))
    # installed only with install_py_dep_per_model=true (off here: no network in tests)
    (user / "r.txt").write_text("inf2serve-e2e-never-installed==0.0.1\n")
    package(CONFIG, tiny_checkpoint, CUSTOM, "mar", out, handler=user / "capped_handler.py",
            extra_files=f"{user / 'capped_settings.py'},{user / 'capped.json'}",
            requirements_file=user / "r.txt", version="2.0")
    return out


def isolated_ports() -> dict[str, str]:
    """Other TorchServes may run on this machine: by default every one binds gRPC 7070/7071
    and puts worker sockets at /tmp/.ts.sock.9000+, so give this one its own."""
    base = random.randrange(20000, 60000, 100)
    return {"grpc_inference_port": str(free_port()),
            "grpc_management_port": str(free_port()),
            "initial_worker_port": str(base), "initial_distribution_port": str(base + 50)}


def stream(url: str, token: str | None = None) -> tuple[httpx.Response, list[str]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.stream("POST", url, json=REQUEST, headers=headers, timeout=120) as r:
        chunks = [c for c in r.iter_text() if c]
    return r, chunks


def test_every_format_is_served_and_streams(store: Path, serving_python: Path, tmp_path: Path,
                                            monkeypatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the worker must not find our sources
    run_dir = tmp_path / "run"
    server = serve.start(store, [*NAMES.values(), CUSTOM], run_dir, python=str(serving_python),
                         ready_timeout_s=300, extra_props=isolated_ports())
    try:
        log = (run_dir / "logs" / "ts_log.log").read_text(errors="replace")
        assert f"Python executable: {serving_python}" in log
        for fmt, name in NAMES.items():
            r, chunks = stream(f"{server.inference_url}/predictions/{name}",
                               server.inference_token)
            assert r.status_code == 200, (fmt, "".join(chunks))
            assert r.headers.get("transfer-encoding") == "chunked", fmt  # streamed, not buffered
            assert "".join(chunks).strip(), f"{fmt}: empty text"
            assert not "".join(chunks).startswith("{"), f"{fmt}: raw text, not the custom NDJSON"
        # the user's subclass ran: the 8-token text request came back as 3 tokens of NDJSON
        r, chunks = stream(f"{server.inference_url}/predictions/{CUSTOM}/2.0",
                           server.inference_token)
        lines = [json.loads(line) for line in "".join(chunks).splitlines() if line.strip()]
        assert r.status_code == 200, "".join(chunks)
        assert lines[-1]["completion_tokens"] == 3 and lines[-1]["finish_reason"] == "length"
    finally:
        assert serve.stop(run_dir)
    assert not serve._alive(server.pid)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.inference_url}/ping", timeout=5)


def _wait_ping(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"serve exited\n{log.read_text(errors='replace')[-3000:]}"
        try:
            if httpx.get(f"{url}/ping", timeout=2).status_code == 200:
                # /ping answers before workers are up; /invocations needs one READY
                r, chunks = stream(f"{url}/invocations")
                if r.status_code == 200:
                    return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise AssertionError(f"no READY model after {timeout_s}s\n{log.read_text()[-3000:]}")


def test_sagemaker_export_serves_via_its_serve_script(store: Path, serving_python: Path,
                                                      tmp_path: Path) -> None:
    """What SageMaker runs: /opt/ml/model/serve, /ping and /invocations, no token."""
    model_dir, _ = export(store / NAMES["no-archive"], tmp_path / "opt-ml-model", "sagemaker")
    with open(model_dir / "config.properties", "a") as f:  # only for this shared test machine
        f.write("".join(f"{k}={v}\n" for k, v in isolated_ports().items()))
    model_dir.chmod(0o555)  # /opt/ml/model is read-only on SageMaker
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(SM_MODEL_DIR=str(model_dir), SAGEMAKER_BIND_TO_PORT=str(port),
               PATH=f"{serving_python.parent}:{env['PATH']}", TMPDIR=str(tmp_path))
    log = tmp_path / "serve.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["/bin/sh", str(model_dir / "serve"), "serve"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ping(url, proc, 300, log)
        r, chunks = stream(f"{url}/invocations")
        assert r.status_code == 200 and r.headers.get("transfer-encoding") == "chunked"
        assert "".join(chunks).strip()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the session holds torchserve, java and workers
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        model_dir.chmod(0o755)
    _wait_gone(f"http://127.0.0.1:{port}/ping", 60)


def _wait_gone(url: str, timeout_s: float) -> None:
    """The shell exits before Java has finished shutting down: wait until the port refuses."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=2)
        except httpx.TransportError:
            return
        time.sleep(0.5)
    pytest.fail(f"{url} still answers {timeout_s:.0f}s after the server was stopped")
