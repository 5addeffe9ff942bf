"""Test hooks of the fake: an event log across processes and simulated NeuronCores.

INF2SERVE_FAKE_NEURON_EVENTS   JSON-lines file; one line per to_neuron():
                               {"event": "compile"|"load", "pid", "visible_cores", ...}
                               so tests spanning processes count compilations.
INF2SERVE_FAKE_NEURON_COMPILE_S seconds a compilation takes (default 0).
INF2SERVE_FAKE_NEURON_DEVICE_DIR where per-core lock files live (default: a tmp dir);
                               like the real runtime, a core used by one process
                               cannot be taken by another.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from pathlib import Path

EVENTS_ENV = "INF2SERVE_FAKE_NEURON_EVENTS"
COMPILE_S_ENV = "INF2SERVE_FAKE_NEURON_COMPILE_S"
DEVICE_DIR_ENV = "INF2SERVE_FAKE_NEURON_DEVICE_DIR"

_held_cores: dict[int, int] = {}  # core id -> fd, held for the life of the process


def record(event: str, **fields) -> None:
    path = os.environ.get(EVENTS_ENV)
    if not path:
        return
    line = json.dumps({"event": event, "pid": os.getpid(), "time": time.time(), **fields})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one O_APPEND write: atomic across processes
    finally:
        os.close(fd)


def read_events(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def compile_delay() -> None:
    delay = float(os.environ.get(COMPILE_S_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)


def visible_cores() -> list[int] | None:
    """NEURON_RT_VISIBLE_CORES as ids (None when unset: the runtime would take every core)."""
    text = os.environ.get("NEURON_RT_VISIBLE_CORES", "").strip()
    if not text:
        return None
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def reserve_cores(tp_degree: int) -> list[int] | None:
    """Like nrt_init: needs tp_degree visible cores and owns them exclusively."""
    cores = visible_cores()
    num = os.environ.get("NEURON_RT_NUM_CORES")
    if cores is None:
        if num and int(num) < tp_degree:
            raise RuntimeError(f"nrt_init: NEURON_RT_NUM_CORES={num} < tp_degree {tp_degree}")
        return None
    if len(cores) < tp_degree:
        raise RuntimeError(f"nrt_init: {len(cores)} visible NeuronCores "
                           f"({os.environ['NEURON_RT_VISIBLE_CORES']}) < tp_degree {tp_degree}")
    device_dir = Path(os.environ.get(DEVICE_DIR_ENV)
                      or Path(tempfile.gettempdir()) / "inf2serve-fake-neuron-device")
    device_dir.mkdir(parents=True, exist_ok=True)
    for core in cores:
        if core in _held_cores:
            continue
        fd = os.open(device_dir / f"nc{core}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"nrt_init: NeuronCore {core} is already in use by another "
                               "process") from None
        _held_cores[core] = fd
    return cores
