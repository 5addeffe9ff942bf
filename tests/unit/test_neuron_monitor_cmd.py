"""`inf2serve serve --neuron-monitor` (archive_tools/neuron_monitor.py): neuron-monitor piped
into its exporter, found on PATH or in /opt/aws/neuron/bin, refused in one line without
them, stopped with the server -- here with the fakes of tests/fakes/neuron_tools."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from archive_tools import neuron_monitor
from archive_tools.ports import free_port
from handlers.errors import Inf2ServeError

FAKES = Path(__file__).resolve().parents[1] / "fakes" / "neuron_tools" / "bin"


def test_without_the_neuron_tools_it_says_what_to_install(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(neuron_monitor, "TOOLS_DIR", str(tmp_path / "opt"))
    with pytest.raises(Inf2ServeError) as err:
        neuron_monitor.find()
    message = str(err.value)
    assert "\n" not in message and "aws-neuronx-tools" in message
    assert "neuron-monitor and neuron-monitor-prometheus.py not found" in message


def test_the_tools_directory_is_searched_after_path(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(neuron_monitor, "TOOLS_DIR", str(FAKES))
    assert neuron_monitor.find() == (str(FAKES / "neuron-monitor"),
                                     str(FAKES / "neuron-monitor-prometheus.py"))


def test_start_serves_the_device_and_stop_ends_both(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    url = neuron_monitor.start(tmp_path, free_port())
    pids = [int(p) for p in (tmp_path / neuron_monitor.PID_FILE).read_text().split()]
    try:
        deadline = time.monotonic() + 30
        while "neuroncore_utilization_ratio" not in httpx.get(url, timeout=5).text:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        assert neuron_monitor.stop(tmp_path)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()  # ended and reaped
    assert not neuron_monitor.stop(tmp_path)  # nothing left to stop


def test_a_stale_pid_file_stops_nobody_else(tmp_path: Path) -> None:
    (tmp_path / neuron_monitor.PID_FILE).write_text(f"{os.getpid()} 1\n")
    assert not neuron_monitor.stop(tmp_path)  # neither is a neuron-monitor
