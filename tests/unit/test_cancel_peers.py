"""The workers of one model answer one another's cancels (handlers/torchserve/
cancel_peers.py); tests/e2e/test_cancel_workers_e2e.py does it through TorchServe with 2 and
3 workers."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from handlers.torchserve.cancel_peers import MAX_SOCKET_PATH, CancelPeers


class Owner:
    """A worker's client map: cancel(client_id) is True once for a client it runs."""

    def __init__(self, *clients: str) -> None:
        self.clients = set(clients)
        self.cancelled: list[str] = []

    def cancel(self, client_id: str) -> bool:
        if client_id in self.clients:
            self.clients.discard(client_id)
            self.cancelled.append(client_id)
            return True
        return False


@pytest.fixture
def peers(tmp_path):
    opened: list[CancelPeers] = []

    def open_peer(name: str, owner: Owner, model_dir: Path = tmp_path) -> CancelPeers:
        peer = CancelPeers.open(model_dir, owner.cancel, name=name)
        assert peer is not None
        opened.append(peer)
        return peer

    yield open_peer
    for peer in opened:
        peer.close()


def test_a_cancel_reaches_the_worker_that_runs_the_request(peers) -> None:
    mine, theirs, third = Owner(), Owner("c1"), Owner("c2")
    asker = peers("a", mine)
    peers("b", theirs)
    peers("c", third)
    assert len(str(asker.path)) < MAX_SOCKET_PATH
    assert asyncio.run(asker.ask("c1"))
    assert theirs.cancelled == ["c1"] and third.cancelled == [] and mine.cancelled == []
    assert not asyncio.run(asker.ask("c1"))  # cancelled once: it runs nowhere now
    assert not asyncio.run(asker.ask("unknown"))
    assert asyncio.run(asker.ask("c2")) and third.cancelled == ["c2"]


def test_workers_of_other_models_are_not_asked(peers, tmp_path) -> None:
    other = tmp_path / "other-model"
    other.mkdir()
    asker = peers("a", Owner())
    elsewhere = Owner("c1")
    peers("b", elsewhere, other)
    assert not asyncio.run(asker.ask("c1")) and elsewhere.cancelled == []


def test_a_dead_workers_socket_is_removed_and_a_silent_one_times_out(peers, monkeypatch):
    from handlers.torchserve import cancel_peers

    monkeypatch.setattr(cancel_peers, "PEER_TIMEOUT_S", 0.2)
    asker = peers("a", Owner())
    directory = asker.path.parent
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(directory / "dead.sock"))  # bound, never listening: a worker that died
    dead.close()
    silent = socket.socket(socket.AF_UNIX)
    silent.bind(str(directory / "silent.sock"))
    silent.listen(1)  # listens, never answers: a wedged worker
    try:
        assert not asyncio.run(asker.ask("c1"))
        assert not (directory / "dead.sock").exists()
    finally:
        silent.close()


def test_no_peers_where_the_socket_path_would_not_fit(tmp_path) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    assert CancelPeers.open(tmp_path, Owner().cancel, base=deep) is None


def test_a_directory_others_may_enter_is_refused(tmp_path) -> None:
    base = tmp_path / "b"
    base.mkdir()
    shared = base / f"inf2serve-{os.getuid()}"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    assert CancelPeers.open(tmp_path, Owner().cancel, base=base) is None
