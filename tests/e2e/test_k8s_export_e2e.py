"""The exported Deployment's container, run as a plain process: it serves and streams.

The container's command, args, env and working directory are taken from deployment.yaml
and the ConfigMap's files, with only paths and ports remapped to this machine (the
image's /models/model-store is the export's model-store/, the ConfigMap mount a temp
dir). TorchServe comes from the stock serving venv (tests/e2e/_venv.py); the readiness
and liveness probes are the exported ones, run as the kubelet would (exit code).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from archive_tools.export import export
from archive_tools.k8s_export import CONFIG_DIR, MODEL_STORE, WORKER_METRICS_DIR, K8sOptions
from archive_tools.package import package
from archive_tools.ports import free_port

from ._venv import make_serving_venv
from .test_package_formats import CONFIG, _wait_gone, isolated_ports, stream

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("java") is None, reason="TorchServe needs a Java 17 runtime"),
]


@pytest.fixture(scope="module")
def serving_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stock TorchServe, torch and transformers, without this toolkit."""
    return make_serving_venv(tmp_path_factory.mktemp("serving-venv") / "venv")


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _text(url: str) -> str:
    try:
        return httpx.get(url, timeout=10).text
    except httpx.HTTPError as exc:
        return str(exc)


def _run_probe(cmd: list[str], remap, env: dict[str, str]) -> int:
    return subprocess.run([remap(a) for a in cmd], env=env, capture_output=True,
                          timeout=30).returncode


def _stop(proc: subprocess.Popen) -> None:
    """The session holds torchserve, java and the workers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_exported_container_serves_and_streams(tiny_checkpoint: Path, serving_python: Path,
                                               tmp_path: Path) -> None:
    archive = package(CONFIG, tiny_checkpoint, "tiny", "no-archive", tmp_path / "store")
    out, _ = export(archive, tmp_path / "k8s", "kubernetes", k8s=K8sOptions(replicas=1))
    container, router = _load(out / "deployment.yaml")["spec"]["template"]["spec"]["containers"]
    files = _load(out / "configmap.yaml")["data"]

    # the ConfigMap mount, with this machine's free ports instead of 8080/8081/8082 (8090:
    # the router's)
    ports = {p: free_port() for p in ("8080", "8081", "8082", "8090")}
    props = re.sub(r":(8080|8081|8082)\b", lambda m: f":{ports[m.group(1)]}",
                   files["config.properties"])
    props += "".join(f"{k}={v}\n" for k, v in isolated_ports().items())  # shared machine only
    mount = tmp_path / "etc-inf2serve"
    mount.mkdir()
    (mount / "config.properties").write_text(props)
    (mount / "probe.py").write_text(files["probe.py"])
    # the pod's /tmp (TEMP: TorchServe's worker sockets) must stay short as in the pod, so
    # not under pytest's nested $TMPDIR, which a long TMPDIR pushes past the 107-byte limit
    work = Path(tempfile.mkdtemp(prefix="pod-tmp-", dir="/tmp" if os.access("/tmp", os.W_OK)
                                 else None))
    shared = tmp_path / "metrics-volume"  # the emptyDir both containers mount
    shared.mkdir()

    def remap(value: str) -> str:
        for inside, here in ((CONFIG_DIR, mount), (MODEL_STORE, out / "model-store"),
                             ("/tmp", work), (WORKER_METRICS_DIR, shared)):
            if value == inside or value.startswith(inside + "/"):
                return str(here) + value[len(inside):]
        return re.sub(r"(?<=127\.0\.0\.1:)(8080|8082)\b|^(8090)$",
                      lambda m: str(ports[m.group(1) or m.group(2)]), value)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({e["name"]: remap(e["value"]) for e in container["env"]})
    env["PATH"] = f"{serving_python.parent}:{env['PATH']}"
    probe_env = {**env, "PROBE_INFERENCE_URL": f"http://127.0.0.1:{ports['8080']}",
                 "PROBE_MANAGEMENT_URL": f"http://127.0.0.1:{ports['8081']}"}
    cmd = [remap(a) for a in container["command"] + container["args"]]
    log = tmp_path / "container.out"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=remap(container["workingDir"]), env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{ports['8080']}"
    # the router, from this toolkit (the image's python3 has it; here: this interpreter)
    router_cmd = [sys.executable if a == "python3" else remap(a)
                  for a in router["command"] + router["args"]]
    router_cmd[router_cmd.index("--host") + 1] = "127.0.0.1"  # a shared machine: loopback
    with open(tmp_path / "router.out", "wb") as f:
        router_proc = subprocess.Popen(router_cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                       start_new_session=True)
    try:
        startup = container["startupProbe"]
        deadline = time.monotonic() + startup["periodSeconds"] * startup["failureThreshold"]
        while _run_probe(startup["exec"]["command"], remap, probe_env) != 0:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "startup probe never passed"
            time.sleep(1)
        assert _run_probe(container["readinessProbe"]["exec"]["command"], remap, probe_env) == 0
        assert _run_probe(container["livenessProbe"]["exec"]["command"], remap, probe_env) == 0
        # the ConfigMap's vmargs reach the JVM: its memory is what the container's limit holds
        (java,) = [p.cmdline() for p in psutil.Process(proc.pid).children(recursive=True)
                   if "org.pytorch.serve.ModelServer" in p.cmdline()]
        vmargs = next(line.split("=", 1)[1] for line in props.splitlines()
                      if line.startswith("vmargs="))
        assert vmargs.split() == [a for a in java if a in vmargs.split()]
        assert "-Xmx256m" in java and any(a.startswith("-XX:MaxDirectMemorySize=") for a in java)
        r, chunks = stream(f"{url}/predictions/tiny")  # no token: the platform authenticates
        assert r.status_code == 200 and r.headers.get("transfer-encoding") == "chunked"
        assert "".join(chunks).strip()
        # the model API is off: nothing registers models, even from inside the pod
        mgmt = httpx.post(f"http://127.0.0.1:{ports['8081']}/models?url=x.mar", timeout=10)
        assert mgmt.status_code == 405
        # the pod's /metrics (the router's port, which Prometheus and the HPA's adapter
        # read): the worker's metrics under vLLM's names, and TorchServe's own
        expected = ('vllm:time_to_first_token_seconds_count{model_name="tiny"} 1.0',
                    "vllm:num_requests_running", "ts_inference_requests_total",
                    'inf2serve_upstream_up{upstream="torchserve"} 1.0')
        deadline = time.monotonic() + 30
        while not all(e in (text := _text(f"http://127.0.0.1:{ports['8090']}/metrics"))
                      for e in expected):
            assert time.monotonic() < deadline, text[-3000:]
            time.sleep(1)
    finally:
        _stop(proc)
        router_proc.terminate()
        router_proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    _wait_gone(f"{url}/ping", 60)
