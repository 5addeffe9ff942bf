"""handlers/torchserve/worker_service.py: TorchServe 0.12's async worker protocol, served by
inf2serve.

Messages go in as the frontend encodes them (the format TorchServe's own decoder reads:
pytorch/serve@v0.12.0:ts/protocol/otf_message_handler.py:236-365) over a real socket pair,
and answers come back through tests/unit/ts_frontend.py's decoder of the frontend side.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
import threading
import types
from pathlib import Path

import pytest
from ts.context import Context
from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
from ts.utils.util import PredictionException

from handlers.torchserve import worker_service
from handlers.torchserve.worker_service import WorkerService
from tests.unit.ts_frontend import decode


def _bytes(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return struct.pack("!i", len(data)) + data


def inference_message(*requests: tuple[str, bytes]) -> bytes:
    """An 'I' message with one JSON body per request, as the frontend sends it."""
    out = b"I"
    for request_id, body in requests:
        out += _bytes(request_id)
        out += _bytes("url_path") + _bytes("") + struct.pack("!i", -1)  # headers
        out += _bytes("body") + _bytes("application/json") + _bytes(body) + struct.pack("!i", -1)
    return out + struct.pack("!i", -1)


class RecordingSocket:
    """The worker's end: records which thread wrote each message."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.writers: list[str] = []

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def sendall(self, data: bytes) -> None:
        self.writers.append(threading.current_thread().name)
        self.sock.sendall(data)


class Worker:
    """A WorkerService on a thread, with the frontend's end of the socket."""

    def __init__(self, entry_point) -> None:
        self.frontend, worker_end = socket.socketpair()
        self.frontend.settimeout(10)
        metrics = MetricsCacheYamlImpl(config_file_path=str(
            Path(sys.modules["ts"].__file__).parent / "configs" / "metrics.yaml"))
        metrics.initialize_cache()
        context = Context("tiny", "/m", {}, 1, None, "0.12.0", metrics=metrics)
        self.sock = RecordingSocket(worker_end)
        self.service = types.SimpleNamespace(cl_socket=self.sock, context=context,
                                             _entry_point=entry_point)
        self.result: list[str | None] = []
        self.thread = threading.Thread(
            target=lambda: self.result.append(WorkerService(self.service).run()), daemon=True)
        self.thread.start()
        self._buffer = b""

    def answers(self, n: int) -> list:
        """The first `n` predictions the frontend receives."""
        while True:
            try:
                predictions = decode(self._buffer)
            except (struct.error, UnicodeDecodeError):  # a message still arriving
                predictions = []
            if len(predictions) >= n:
                return predictions
            chunk = self.frontend.recv(65536)
            assert chunk, "the worker closed the connection"
            self._buffer += chunk

    def close(self) -> str | None:
        self.frontend.close()
        self.thread.join(10)
        assert not self.thread.is_alive()
        return self.result[0]


def test_concurrent_requests_each_get_their_own_context_and_answer():
    seen, both_inside = [], asyncio.Event()

    async def entry(inputs, context):
        seen.append((context, dict(context.request_ids), dict(context.metrics.request_ids)))
        if len(seen) == 2:
            both_inside.set()
        await both_inside.wait()  # neither answers before both are in: they overlap
        context.set_response_header(0, "x-echo", inputs[0]["body"]["text"])
        return [f"echo {inputs[0]['body']['text']}"]

    worker = Worker(entry)
    worker.frontend.sendall(inference_message(("r1", b'{"text": "a"}')))
    worker.frontend.sendall(inference_message(("r2", b'{"text": "b"}')))
    answers = {p.request_id: p for p in worker.answers(2)}
    assert {r: (p.code, p.status, p.body, p.headers["x-echo"]) for r, p in answers.items()} == {
        "r1": (200, 200, b"echo a", "a"), "r2": (200, 200, b"echo b", "b")}
    (c1, ids1, mids1), (c2, ids2, mids2) = seen
    assert c1 is not c2 and c1.metrics is not c2.metrics
    assert {ids1[0], ids2[0]} == {"r1", "r2"} and (ids1, ids2) == (mids1, mids2)
    base = worker.service.context
    assert base.request_ids is None and base.metrics.request_ids is None  # untouched
    assert "Traceback" in worker.close()  # the frontend went away: run() says why


def test_every_write_comes_from_the_event_loop_thread():
    """Chunks the handler writes and the answer the service writes share one writer, so
    two messages can never interleave on the socket."""
    async def entry(inputs, context):
        context.cl_socket.sendall(b"")  # where the handler's chunk sender writes
        await asyncio.sleep(0)
        return ["done"]

    worker = Worker(entry)
    for i in range(3):
        worker.frontend.sendall(inference_message((f"r{i}", b"{}")))
    assert len(worker.answers(3)) == 3
    worker.close()
    assert worker.sock.writers == [worker.thread.name] * 6  # the thread running the loop


@pytest.mark.parametrize("outcome, code", [
    (ValueError("boom"), 503),
    (PredictionException("teapot", 418), 418),
    (MemoryError(), 507),
    (RuntimeError("CUDA out of memory"), 507),
    ("not a list", 503),
    (["one", "two"], 503),  # two answers for one request
])
def test_failures_answer_as_torchserve_does(outcome, code):
    async def entry(inputs, context):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    worker = Worker(entry)
    worker.frontend.sendall(inference_message(("r1", b"{}")))
    (answer,) = worker.answers(1)
    assert (answer.request_id, answer.code, answer.status, answer.body) == ("r1", code, code,
                                                                             b"error")
    worker.frontend.sendall(inference_message(("r2", b"{}")))  # and the worker goes on
    assert worker.answers(2)[1].request_id == "r2"
    worker.close()


def test_prediction_time_is_reported_per_request(caplog):
    async def entry(inputs, context):
        return ["ok"]

    worker = Worker(entry)
    with caplog.at_level(logging.INFO):
        worker.frontend.sendall(inference_message(("req-42", b"{}")))
        worker.answers(1)
        worker.close()
    lines = [r.getMessage() for r in caplog.records if "PredictionTime" in r.getMessage()]
    assert len(lines) == 1 and "req-42" in lines[0]


def test_install_replaces_only_torchserves_own_async_service(monkeypatch):
    from ts import async_service

    main = types.ModuleType("__main__")
    main.AsyncService = async_service.AsyncService
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert worker_service.install() and main.AsyncService is WorkerService
    other = object()
    main.AsyncService = other  # someone else's: left alone
    assert not worker_service.install() and main.AsyncService is other
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    assert not worker_service.install()  # not a TorchServe worker at all


def test_a_message_is_marked_begun_before_any_of_it_leaves_the_socket():
    """The board's `reading` goes up before the first byte is taken (the guardian must never
    see a socket inside a message while the board says it is at one), and the message then
    reads whole."""
    frontend, worker_end = socket.socketpair()
    message = inference_message(("r1", b'{"text": "a"}'))
    frontend.sendall(message)
    left = []
    _, batch = worker_service._receive(
        worker_end, lambda: left.append(len(worker_end.recv(1 << 16, socket.MSG_PEEK))))
    assert left == [len(message)]
    assert [worker_service._request_id(item) for item in batch] == ["r1"]
    frontend.close()
    with pytest.raises(ValueError, match="disconnected"):  # nothing more: no message begun
        worker_service._receive(worker_end, lambda: pytest.fail("begun without a message"))


class Notes:
    """A GuardedWrites' notes, recorded with what the socket held at each."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.calls: list[tuple] = []

    def _held(self) -> int:
        try:
            return len(self.sock.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            return 0

    def noting(self, request_ids, head, length) -> None:
        self.calls.append(("noting", request_ids, head, length, self._held()))

    def taken(self) -> None:
        self.calls.append(("taken", self._held()))

    def reading(self) -> None:
        self.calls.append(("reading", self._held()))

    def read(self, request_ids) -> None:
        self.calls.append(("read", request_ids, self._held()))


def test_a_whole_message_is_noted_with_its_head_before_any_of_it_is_taken():
    """The guardian learns each message's requests, first bytes and length while all of it
    is still on the socket; it then leaves in one read (the next message stays)."""
    frontend, worker_end = socket.socketpair()
    first = inference_message(("r1", b'{"text": "a"}'), ("r2", b'{"text": "b"}'))
    second = inference_message(("r3", b'{"text": "c"}'))
    frontend.sendall(first + second)
    notes = Notes(worker_end)
    batch = worker_service._receive_noted(worker_end, notes)
    assert [worker_service._request_id(item) for item in batch] == ["r1", "r2"]
    assert notes.calls == [
        ("noting", ["r1", "r2"], first[:worker_service.HEAD_BYTES], len(first),
         len(first) + len(second)),
        ("taken", len(second))]


def test_a_message_longer_than_a_peek_is_read_as_it_comes(monkeypatch):
    """Past PEEK_BYTES the message is read field by field, the board `reading` throughout."""
    monkeypatch.setattr(worker_service, "PEEK_BYTES", 16)
    frontend, worker_end = socket.socketpair()
    message = inference_message(("r1", b'{"text": "a"}'))
    frontend.sendall(message)
    notes = Notes(worker_end)
    batch = worker_service._receive_noted(worker_end, notes)
    assert [worker_service._request_id(item) for item in batch] == ["r1"]
    assert notes.calls == [("reading", len(message)), ("read", ["r1"], 0)]
