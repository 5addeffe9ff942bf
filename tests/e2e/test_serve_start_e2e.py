"""`serve.start` picks its ports before TorchServe binds them; a port taken in between (a CI
run lost a gRPC bind that way) costs one more start, never a failed or hung one. The JVM it
starts carries the frontend's memory bounds (config.properties' vmargs reach `java`)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from archive_tools import serve
from archive_tools.jvm_options import FrontendMemory
from tests.e2e.harness import ArchiveSpec, build_store, post, running_server

pytestmark = pytest.mark.e2e


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another listener holds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def store(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return build_store(tmp_path, tiny_checkpoint, [ArchiveSpec("tiny", fmt="no-archive")])


def test_a_port_taken_before_torchserve_binds_it_is_picked_again(
        store: Path, tmp_path: Path, taken_port: int, monkeypatch) -> None:
    picks, real = iter([taken_port]), serve.free_port  # the first pick: the inference port
    monkeypatch.setattr(serve, "free_port", lambda: next(picks, None) or real())
    with running_server(store, tmp_path / "run", ["tiny"]) as server:
        assert urlsplit(server.inference_url).port != taken_port
        r = post(server, "tiny", {"prompt": "Once upon a time", "max_new_tokens": 4,
                                  "stream": False})
        assert r.status == 200, r.body
        java = psutil.Process(server.pid).cmdline()
        assert "org.pytorch.serve.ModelServer" in java
        assert set(FrontendMemory().flags()) <= set(java)
        assert "-Xmx256m" in java and any(a.startswith("-XX:MaxDirectMemorySize=") for a in java)
    out = (tmp_path / "run" / "torchserve.out").read_text()
    assert out.count("Address already in use") == 1  # the first start's, then one that bound


def test_ports_taken_at_every_start_fail_naming_the_bind(
        store: Path, tmp_path: Path, taken_port: int, monkeypatch) -> None:
    monkeypatch.setattr(serve, "START_ATTEMPTS", 2)
    monkeypatch.setattr(serve, "free_port", lambda: taken_port)
    run_dir = tmp_path / "run"
    with pytest.raises(serve.PortTaken) as failed:
        serve.start(store, ["tiny"], run_dir, ready_timeout_s=300)
    why = str(failed.value).split("\n---")[0]  # the JVM's exception, before the log tails
    assert why.startswith("TorchServe exited during start-up: ")
    assert f"127.0.0.1:{taken_port}" in why and "Address already in use" in why
    out = (run_dir / "torchserve.out").read_text()
    assert out.count("Address already in use") == 2  # each attempt's, and no third
    assert not serve._alive(serve._pid(run_dir))
