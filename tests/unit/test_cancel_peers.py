"""The workers of one model answer one another's cancels (handlers/torchserve/
cancel_peers.py); tests/e2e/test_disconnect_e2e.py does it through TorchServe with 2 and
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
    finally:  # a socket's file outlives it: a rerun with the same tmp_path would find it bound
        silent.close()
        (directory / "silent.sock").unlink(missing_ok=True)


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


def test_the_handler_asks_the_other_workers_for_a_cancel_it_cannot_answer(tmp_path) -> None:
    """The router's cancel reaches a worker that does not run the request: its handler asks
    the model's other workers, and the answer is theirs."""
    import json
    from types import SimpleNamespace

    from ts.context import Context, RequestProcessor
    from ts.protocol.otf_message_handler import create_predict_response

    from handlers.torchserve.generation_handler import GenerationHandler
    from handlers.torchserve.service import GenerationService
    from tests.unit.test_generation_handler import FakeService, Socket
    from tests.unit.ts_frontend import decode, http_view

    def worker(name: str, clients: dict[str, str]) -> tuple[GenerationHandler, list[str]]:
        cancelled: list[str] = []
        service = FakeService([])
        service.engine = SimpleNamespace(cancel=cancelled.append, down=None)
        service.clients = clients
        service.cancel_client = lambda client_id: GenerationService.cancel_client(service,
                                                                                  client_id)
        handler = GenerationHandler()
        handler.service = service
        handler._peers = CancelPeers.open(tmp_path, service.cancel_client, name=name)
        return handler, cancelled

    receiver, nothing = worker("receiver", {})
    owner, cancelled = worker("owner", {"c1": "req-7"})
    try:
        def cancel(client_id: str) -> dict:
            ctx = Context("tiny", "/m", {}, 1, None, "0.12.0")
            ctx.request_processor = [RequestProcessor({"url_path": "inf2serve/cancel"})]
            ctx.request_ids = {0: "req-9"}
            ctx.cl_socket = Socket()
            body = json.dumps({"client_id": client_id}).encode()
            ret = asyncio.run(receiver.handle([{"body": body}], ctx))
            ctx.cl_socket.sendall(create_predict_response(ret, ctx.request_ids, "ok", 200, ctx))
            return json.loads(http_view(decode(ctx.cl_socket.sent)).body)

        assert cancel("c1") == {"cancelled": True}
        assert cancelled == ["req-7"] and nothing == [] and owner.service.clients == {}
        assert cancel("c1") == {"cancelled": False}  # it runs nowhere now
    finally:
        for handler in (receiver, owner):
            handler._peers.close()
