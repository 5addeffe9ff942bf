"""When the TorchServe worker dies, the engine process answers its requests on the worker's
socket (handlers/engine/process.Farewell), in messages the worker encoded beforehand
(handlers/torchserve/worker_service.last_words, closing_message).

What the frontend makes of those messages is checked with tests/unit/ts_frontend.py (the
rules of TorchServe 0.12's RestJob and AsyncBatchAggregator); a real worker process is
killed in the last test, and tests/e2e/test_worker_sigkill_e2e.py does it through TorchServe.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import psutil
from ts.context import Context, RequestProcessor

from handlers.api.framing import native_framer
from handlers.api.openai_framing import ResponseMeta, openai_framer
from handlers.engine import guardian
from handlers.engine.client import LAST_WORDS, EngineClient
from handlers.engine.guardian import Farewell
from handlers.engine.scheduler import FinishEvent, TextEvent
from handlers.torchserve import worker_service
from handlers.torchserve.generation_handler import WORKER_DIED, GenerationHandler, _last_words
from handlers.torchserve.worker_service import closing_message, last_words
from tests.unit.test_generation_handler import FakeService, Socket
from tests.unit.ts_frontend import Prediction, decode, http_view

ROOT = Path(__file__).resolve().parents[2]
CLOSING = closing_message(WORKER_DIED)


def started_stream(request_id: str) -> list[Prediction]:
    """A stream whose first chunk went out (what StreamWriter sends)."""
    return [Prediction(200, request_id, "application/x-ndjson", 200,
                       {"ts_stream_next": "true"}, b'{"text": "Once"}\n')]


def read_all(sock: socket.socket, timeout_s: float = 5) -> tuple[bytes, float]:
    """Everything until EOF, and when the EOF came (time.monotonic)."""
    sock.settimeout(timeout_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic()


def split_closing(data: bytes) -> bytes:
    """The messages before the closing one, which must end the data."""
    assert data.endswith(CLOSING)
    return data[:-len(CLOSING)]


def test_silent_words_are_a_whole_500_that_clears_the_request():
    words = _last_words("r1", native_framer(False, ""))
    assert words.spoken is None  # not streamed: nothing goes out before its end
    view = http_view(decode(words.silent))
    assert view.status == 500 and view.framing == "content-length" and view.complete
    assert json.loads(view.body)["error"]["message"] == WORKER_DIED
    assert view.forgotten  # out of the frontend's in-flight map


def test_spoken_words_end_a_started_stream_in_band():
    words = _last_words("r1", native_framer(True, "ndjson"))
    view = http_view(started_stream("r1") + decode(words.spoken))
    assert view.status == 200 and view.complete and view.forgotten
    lines = view.body.decode().splitlines()
    assert json.loads(lines[0]) == {"text": "Once"}
    assert json.loads(lines[1])["error"] == {"code": 500, "type": "server_error",
                                             "field": None, "message": WORKER_DIED}
    assert len(lines) == 2


def test_spoken_words_on_a_stream_that_had_not_started_are_a_500():
    # the text reached the worker, which died before sending it: a 500 head, then the
    # frontend closes the connection (NettyUtils.java:197-200); cleared either way
    words = _last_words("r1", native_framer(True, "ndjson"))
    view = http_view(decode(words.spoken))
    assert view.status == 500 and view.forgotten


def test_openai_streams_get_an_error_event_and_done():
    meta = ResponseMeta("chatcmpl-1", 0, "m", chat=True)
    words = _last_words("r1", openai_framer(meta, stream=True))
    view = http_view(started_stream("r1") + decode(words.spoken))
    events = [x[len("data: "):] for x in view.body.decode().splitlines()
              if x.startswith("data: ")]
    assert json.loads(events[0])["error"]["code"] == 500 and events[1] == "[DONE]"


def test_the_closing_message_is_an_error_for_every_request_in_flight():
    # a code other than 200: AsyncBatchAggregator.java:121-137 errors every job in its map
    code, length = struct.unpack("!ii", CLOSING[:8])
    assert code == 500 and CLOSING[8:8 + length].decode() == WORKER_DIED
    assert CLOSING[8 + length:] == struct.pack("!i", -1)  # no predictions


def test_the_encoding_is_torchserves_for_any_request_id():
    words = last_words("ünïcode-id", "text/plain", "{}", "[error]")
    assert {p.request_id for p in decode(words.silent) + decode(words.spoken)} == {
        "ünïcode-id"}


def test_farewell_says_spoken_or_silent_words_then_closes():
    frontend, worker_end = socket.socketpair()
    farewell = Farewell()
    farewell.arm(worker_end, CLOSING)
    streamed = native_framer(True, "ndjson")
    for rid in ("spoke", "quiet", "done", "cancelled"):
        farewell.expect(_last_words(rid, streamed))
    farewell.sent([("spoke", "Once", 1), ("quiet", "", 0)], [("done", None)])
    farewell.forget("cancelled")  # the worker may have ended it itself
    farewell.say()
    data, _ = read_all(frontend)
    predictions = decode(split_closing(data))
    assert [p.request_id for p in predictions] == ["spoke", "spoke", "quiet", "quiet"]
    spoke = http_view(started_stream("spoke") + predictions[:2])
    assert spoke.complete and b"error" in spoke.body
    quiet = http_view(predictions[2:])
    assert quiet.status == 500 and quiet.framing == "content-length" and quiet.forgotten
    farewell.say()  # said once: the socket is gone


def test_farewell_without_a_socket_says_nothing():
    farewell = Farewell()
    farewell.expect(_last_words("r1", native_framer(False, "")))  # not kept: no socket
    farewell.say()
    assert not farewell._words


def test_the_engine_process_answers_for_a_killed_worker(tmp_path):
    """A worker process (an EngineClient with the test's socket handed over) gets SIGKILL
    with three requests in flight: the engine process answers each within 5 s and exits."""
    frontend, worker_end = socket.socketpair()
    script, ready = tmp_path / "worker.py", tmp_path / "ready"
    script.write_text(textwrap.dedent(f"""
        import socket, sys, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from handlers.api.framing import native_framer
        from handlers.backends.base import SamplingParams
        from handlers.engine.client import LAST_WORDS
        from handlers.engine.messages import EngineRequest
        from handlers.torchserve.generation_handler import WORKER_DIED, _last_words
        from handlers.torchserve.worker_service import closing_message
        from tests.unit.test_engine_client import start

        if __name__ == "__main__":
            client = start(Path({str(tmp_path)!r}))
            client.hand_over(socket.socket(fileno={worker_end.fileno()}),
                             closing_message(WORKER_DIED))
            started = set()
            for rid, stream in (("ndjson", True), ("whole", False), ("gone", True)):
                LAST_WORDS.set(_last_words(rid, native_framer(stream, "ndjson")))
                sink = lambda event, rid=rid: started.add(rid)
                client.submit(EngineRequest(rid, [97], 200, SamplingParams()), sink)
            LAST_WORDS.set(None)
            while len(started) < 3:
                time.sleep(0.01)
            client.cancel("gone")  # the worker answers this one itself
            time.sleep(0.3)
            Path({str(ready)!r}).write_text(str(client.pid))
            time.sleep(600)
    """))
    worker = subprocess.Popen([sys.executable, str(script)], pass_fds=[worker_end.fileno()])
    worker_end.close()  # the worker and the engine process hold it now
    try:
        for _ in range(600):
            if ready.exists() or worker.poll() is not None:
                break
            time.sleep(0.1)
        engine = int(ready.read_text())
        killed_at = time.monotonic()
        os.kill(worker.pid, signal.SIGKILL)
        data, eof_at = read_all(frontend)
    finally:
        worker.kill()
        worker.wait()
    assert eof_at - killed_at < 5, eof_at - killed_at
    predictions = decode(split_closing(data))
    assert [p.request_id for p in predictions] == ["ndjson", "ndjson", "whole", "whole"]
    assert http_view(started_stream("ndjson") + predictions[:2]).complete
    whole = http_view(predictions[2:])
    assert whole.status == 500 and json.loads(whole.body)["error"]["message"] == WORKER_DIED
    try:
        psutil.Process(engine).wait(10)  # then it exits, as before
    except psutil.NoSuchProcess:
        pass
    assert not psutil.pid_exists(engine)


class HandedOver(EngineClient):
    """An EngineClient that only records the socket it is handed (no engine process)."""

    def __init__(self) -> None:
        self.handed: list = []
        self.cancel = lambda request_id: None
        self.down = None

    def hand_over(self, sock, closing: bytes, exact=None, takeover=None) -> None:
        self.handed.append((sock, closing))
        self.exact, self.takeover = exact, takeover


def test_the_handler_hands_the_socket_over_and_sends_words_with_each_request():
    seen = []

    class Service(FakeService):
        def submit(self, request_id, request, prompt_ids, loop, on_text=None):
            seen.append(LAST_WORDS.get())
            return super().submit(request_id, request, prompt_ids, loop, on_text)

    handler = GenerationHandler()
    handler.service = Service([TextEvent("Hi"), FinishEvent("length", 1, 1, "Hi")])
    context = Context("tiny", "/m", {}, 1, None, "0.12.0")
    context.request_processor = [RequestProcessor({"url_path": ""})]
    context.request_ids = {0: "req-1"}
    context.cl_socket = Socket()
    asyncio.run(handler.handle([{"body": {"prompt": "Hello"}}], context))
    assert seen == [None]  # nothing handed over: no words

    engine = handler.service.engine = HandedOver()
    handler._hand_over(context.cl_socket)
    assert engine.handed == [(context.cl_socket, CLOSING)]
    # exact: a request read and never booked gets the whole 500 (handlers/engine/guardian.py)
    assert http_view(decode(guardian.one_request_message("x", engine.exact))).status == 500
    asyncio.run(handler.handle([{"body": {"prompt": "Hello", "stream": False}}], context))
    assert seen[1].request_id == "req-1" and seen[1].spoken is None
    assert LAST_WORDS.get() is None  # set for the submit call only


def test_the_takeover_gets_the_load_requests_arguments_unless_the_config_turns_it_off():
    """handler.worker_takeover false: no takeover params, so the guardian answers and closes
    the socket for TorchServe to restart the worker (handlers/engine/guardian.py)."""
    from handlers.torchserve.generation_handler import takeover_params

    context = Context("tiny", "/m", {"model": {"handler": "h.py"}}, 1, None, "0.12.0",
                      metrics=types.SimpleNamespace(config_file_path="/c.yaml"),
                      model_yaml_config={"startupTimeout": 30})
    params = takeover_params(context)
    assert params is not None
    assert (params["model_name"], params["model_dir"], params["handler"]) == ("tiny", "/m", "h.py")
    assert (params["timeout_s"], params["metrics_config"]) == (30.0, "/c.yaml")
    assert takeover_params(context, enabled=False) is None
    assert takeover_params(object()) is None  # not a TorchServe worker's context


def test_an_inline_engine_gets_no_socket():
    handler = GenerationHandler()
    handler.service = FakeService([])
    handler._hand_over(object())
    assert not handler._handed_over


def test_the_worker_service_tells_the_socket_before_it_reads(monkeypatch):
    from ts import async_service

    main = types.ModuleType("__main__")
    main.AsyncService = async_service.AsyncService
    monkeypatch.setitem(sys.modules, "__main__", main)
    told = []
    assert worker_service.install(on_socket=told.append)
    frontend, worker_end = socket.socketpair()
    service = types.SimpleNamespace(cl_socket=worker_end, context=None)
    thread = threading.Thread(target=lambda: main.AsyncService(service).run(), daemon=True)
    thread.start()
    for _ in range(100):
        if told:
            break
        time.sleep(0.01)
    frontend.close()  # the frontend goes away: the worker service returns
    thread.join(10)
    assert told == [worker_end] and not thread.is_alive()
