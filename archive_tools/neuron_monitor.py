"""`inf2serve serve --neuron-monitor`: AWS's neuron-monitor piped into its Prometheus
exporter, beside the server, so the router's /metrics carries the device's series too.

Both come with the Neuron tools (aws-neuronx-tools, installed to /opt/aws/neuron/bin) and run
as AWS's user guide runs them, `neuron-monitor | neuron-monitor-prometheus.py --port PORT`
(aws-neuron/aws-neuron-sdk@81ce03ae:tools/neuron-sys-tools/neuron-monitor-user-guide.rst:
850-877). They are looked for on PATH, then in /opt/aws/neuron/bin. The exporter is a Python
script that needs prometheus_client, which this toolkit's interpreter has (the system
python3 of an Inf2 host may not), so it runs under sys.executable. It binds every interface
on its port (the script has no address option): the port is a free one, and the router
reads it on loopback.

neuron-monitor without a config reports every metric group of every Neuron application
every 5 s (user guide:63-64), which is what the dashboard reads. The two processes outlive
`inf2serve serve`, as TorchServe does; `inf2serve stop` stops them (pids in
RUN_DIR/neuron_monitor.pid).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from archive_tools import pids
from handlers.errors import Inf2ServeError

TOOLS_DIR = "/opt/aws/neuron/bin"
MONITOR, EXPORTER = "neuron-monitor", "neuron-monitor-prometheus.py"
PID_FILE = "neuron_monitor.pid"
LOG_FILE = "neuron_monitor.log"


def find() -> tuple[str, str]:
    """The paths of neuron-monitor and its exporter; a one-line error naming the fix."""
    path = os.environ.get("PATH", "") + os.pathsep + TOOLS_DIR
    found = [shutil.which(name, path=path) for name in (MONITOR, EXPORTER)]
    if None in found:
        missing = " and ".join(n for n, f in zip((MONITOR, EXPORTER), found, strict=True)
                               if f is None)
        raise Inf2ServeError(f"--neuron-monitor: {missing} not found on PATH or in {TOOLS_DIR}; "
                             "install the Neuron tools (apt-get install aws-neuronx-tools, from "
                             "AWS's Neuron repository) or leave --neuron-monitor off")
    return found[0], found[1]


def start(run_dir: Path, port: int, timeout_s: float = 30) -> str:
    """Start the pipeline; return the exporter's /metrics URL once it answers."""
    monitor, exporter = find()
    stop(run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / LOG_FILE, "ab") as log:
        source = subprocess.Popen([monitor], stdout=subprocess.PIPE, stderr=log,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        sink = subprocess.Popen([sys.executable, exporter, "--port", str(port)],
                                stdin=source.stdout, stdout=log, stderr=log,
                                start_new_session=True)
    source.stdout.close()  # the exporter holds the pipe's read end now
    (run_dir / PID_FILE).write_text(f"{source.pid} {sink.pid}\n")
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if source.poll() is not None or sink.poll() is not None:
            break
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(run_dir)
    raise Inf2ServeError(f"--neuron-monitor: {MONITOR} | {EXPORTER} did not serve {url}; see "
                         f"{logs / LOG_FILE}")


def terminate(run_dir: Path) -> list[int]:
    """SIGTERM the pipeline of `run_dir`, if one runs, without waiting: the pids signalled."""
    path = run_dir / PID_FILE
    try:
        found = [int(p) for p in path.read_text().split()]
    except (OSError, ValueError):
        return []
    path.unlink(missing_ok=True)
    return [pid for pid in found if pids.terminate_if(pid, MONITOR.encode())]


def stop(run_dir: Path) -> bool:
    """Stop the pipeline of `run_dir`, if one runs; True if it did."""
    signalled = terminate(run_dir)
    pids.end(signalled, 5)
    return bool(signalled)

