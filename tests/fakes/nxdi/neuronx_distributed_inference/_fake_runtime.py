"""Test hooks of the fake (not part of the real package): events and simulated NeuronCores.

The same variables as the transformers-neuronx fake (tests/fakes/transformers_neuronx/
_runtime.py), so one test helper counts compiles and loads of either:
INF2SERVE_FAKE_NEURON_EVENTS (JSON lines, one per compile/load), INF2SERVE_FAKE_NEURON_COMPILE_S
(seconds a compile takes), INF2SERVE_FAKE_NEURON_DEVICE_DIR (per-core lock files: a core in
use by one process cannot be taken by another, as with the real runtime).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from pathlib import Path

_held: dict[int, int] = {}


def record(event: str, **fields) -> None:
    path = os.environ.get("INF2SERVE_FAKE_NEURON_EVENTS")
    if not path:
        return
    line = json.dumps({"event": event, "pid": os.getpid(), "time": time.time(),
                       "library": "nxdi", **fields})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def compile_delay() -> None:
    delay = float(os.environ.get("INF2SERVE_FAKE_NEURON_COMPILE_S", "0") or 0)
    if delay > 0:
        time.sleep(delay)


def visible_cores() -> list[int] | None:
    text = os.environ.get("NEURON_RT_VISIBLE_CORES", "").strip()
    if not text:
        return None
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def reserve_cores(world_size: int) -> list[int] | None:
    """nrt_init for a model of world_size ranks: that many visible cores, held exclusively."""
    cores = visible_cores()
    num = os.environ.get("NEURON_RT_NUM_CORES")
    if cores is None:
        if num and int(num) < world_size:
            raise RuntimeError(f"nrt_init: NEURON_RT_NUM_CORES={num} < world_size {world_size}")
        return None
    if len(cores) < world_size:
        raise RuntimeError(f"nrt_init: {len(cores)} visible NeuronCores "
                           f"({os.environ['NEURON_RT_VISIBLE_CORES']}) < tp_degree {world_size}")
    device_dir = Path(os.environ.get("INF2SERVE_FAKE_NEURON_DEVICE_DIR")
                      or Path(tempfile.gettempdir()) / "inf2serve-fake-neuron-device")
    device_dir.mkdir(parents=True, exist_ok=True)
    for core in cores:
        if core in _held:
            continue
        fd = os.open(device_dir / f"nc{core}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"nrt_init: NeuronCore {core} is already in use by another "
                               "process") from None
        _held[core] = fd
    return cores
