"""`inf2serve chat` without a browser: the client against a local fake OpenAI server, the
messages it sends, every error as the page would show it, the command's checks, and the
page's config (what the browser loads) holding no token.

The fake speaks what the page relies on: GET models (with max_model_len, as
handlers/api/openai.py and vLLM list it), streamed chat completions as server-sent events,
TorchServe's own 400 InvalidKeyException for a wrong token, OpenAI-shaped 4xx, a 5xx, an
error event inside a stream, a server that stops answering, and a long stream that notes
when its client hangs up (the stop button). The browser test is
tests/e2e/test_chat_page_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from archive_tools import chat_cmd
from archive_tools.chat_client import (
    ChatBackend,
    ChatError,
    PageError,
    Sampling,
    ServedModel,
    Token,
    model_from_url,
    to_messages,
)
from archive_tools.cli import main

pytest.importorskip("openai", reason="the chat extra's client")
TOKEN = "right-token"
BASE = "/predictions/tiny/1.0/v1"
INVALID_KEY = {"code": 400, "type": "InvalidKeyException",
               "message": "Token Authorization failed. Token either incorrect, expired, or not "
                          "provided correctly"}


def _chunk(text: str) -> str:
    return "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0,
                                  "model": "tiny", "choices": [{"index": 0, "delta": {
                                      "content": text}, "finish_reason": None}]}) + "\n\n"


class Fake(BaseHTTPRequestHandler):
    """One behaviour per test (`mode`), every request body kept (`bodies`)."""

    mode = "ok"
    bodies: list[dict] = []
    hung_up = threading.Event()

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: Any, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {TOKEN}":
            return True
        self._send(400, INVALID_KEY)
        return False

    def do_GET(self) -> None:
        if self.path.startswith("/models/"):  # the management API: the served version
            self._send(200, [{"modelName": "tiny", "modelVersion": "2.0"}])
        elif self._authorized() and self.path == f"{BASE}/models":
            self._send(200, {"object": "list", "data": [
                {"id": "tiny", "object": "model", "created": 0, "owned_by": "inf2serve",
                 "max_model_len": 128}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Fake.bodies.append(body)
        if not self._authorized():
            return
        if self.mode == "400":
            self._send(400, {"error": {"message": "max_tokens must be at most 64", "type":
                                       "invalid_request_error", "param": "max_tokens",
                                       "code": None}})
            return
        if self.mode == "500":
            self._send(500, {"error": {"message": "the model process died", "type":
                                       "server_error", "param": None, "code": None}})
            return
        if self.mode == "silent":
            time.sleep(3)
            return
        if self.mode == "cut":  # chunked, as TorchServe streams, and closed mid-body
            self.protocol_version = "HTTP/1.1"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            data = _chunk("Hel").encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.close_connection = True
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        parts = ["Hel", "lo"] if self.mode != "long" else ["x"] * 500
        try:
            for part in parts:
                self.wfile.write(_chunk(part).encode())
                self.wfile.flush()
                if self.mode == "long":
                    time.sleep(0.02)
            if self.mode == "error-event":
                self.wfile.write(("data: " + json.dumps({"error": {
                    "message": "the engine process died", "type": "server_error",
                    "param": None, "code": 500}}) + "\n\n").encode())
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            Fake.hung_up.set()


@pytest.fixture
def fake() -> Iterator[str]:
    """The fake's OpenAI base URL; its mode reset to `ok` and its record cleared."""
    Fake.mode, Fake.bodies, Fake.hung_up = "ok", [], threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}{BASE}"
    finally:
        server.shutdown()
        server.server_close()


def _collect(backend: ChatBackend, model: ServedModel, sampling: Sampling | None = None,
             messages: list[dict] | None = None) -> tuple[list[str], str | None]:
    """(deltas, the page's error message or None)."""
    sampling = sampling or Sampling()
    async def run() -> tuple[list[str], str | None]:
        deltas: list[str] = []
        try:
            async for delta in backend.stream(model, messages or [{"role": "user",
                                                                   "content": "hi"}], sampling):
                deltas.append(delta)
        except PageError as exc:
            return deltas, str(exc)
        return deltas, None

    return asyncio.run(run())


def test_models_are_listed_with_their_context(fake: str) -> None:
    listing = asyncio.run(ChatBackend([fake], Token(TOKEN)).list_models())
    assert listing.errors == []
    assert listing.models == [ServedModel("tiny", fake, 128)]
    assert list(listing.labels()) == ["tiny"]


def test_the_same_model_at_two_urls_is_named_by_its_url(fake: str) -> None:
    other = fake.replace("127.0.0.1", "localhost")
    listing = asyncio.run(ChatBackend([fake, other], Token(TOKEN)).list_models())
    assert list(listing.labels()) == [f"tiny @ {fake}", f"tiny @ {other}"]


def test_a_reply_streams_as_deltas_with_the_messages_and_settings(fake: str) -> None:
    model = ServedModel("tiny", fake, 128)
    messages = to_messages([{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "hello", "metadata": None}],
                           "and now?", system="Be brief.")
    deltas, error = _collect(ChatBackend([fake], Token(TOKEN)), model,
                             Sampling(temperature=0, top_p=1, max_tokens=4096), messages)
    assert (deltas, error) == (["Hel", "lo"], None)
    body = Fake.bodies[-1]
    assert body["stream"] is True and body["model"] == "tiny"
    assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "hello"},
                                {"role": "user", "content": "and now?"}]
    # clamped to the model's context, which the listing said
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0, 1, 128)


def test_messages_leave_out_notices_and_join_text_parts() -> None:
    history = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                            {"type": "file", "file": {"path": "x.png"}},
                                            {"type": "text", "text": "b"}]},
               {"role": "assistant", "content": "Error: ...",
                "metadata": {"title": "Error: the server refused the token"}},
               {"role": "assistant", "content": ""}]
    assert to_messages(history, "next") == [{"role": "user", "content": "a\nb"},
                                            {"role": "user", "content": "next"}]


def test_sampling_clamps_max_tokens_to_the_model_only_when_it_says() -> None:
    assert Sampling(max_tokens=300).body(ServedModel("m", "u", 128))["max_tokens"] == 128
    assert Sampling(max_tokens=300).body(ServedModel("m", "u"))["max_tokens"] == 300


def test_the_model_is_read_from_a_torchserve_base_url() -> None:
    assert model_from_url("http://h:1/predictions/llama-3/1.0/v1") == "llama-3"
    assert model_from_url("http://h:1/v1") is None


def test_a_refused_token_says_how_to_renew_it_and_the_renewed_one_is_used(
        fake: str, tmp_path: Path) -> None:
    keys = tmp_path / "key_file.json"
    keys.write_text(json.dumps({"inference": {"key": "expired"}}))
    backend = ChatBackend([fake], Token(key_file=keys, run_dir=tmp_path))
    model = ServedModel("tiny", fake)
    deltas, error = _collect(backend, model)
    assert deltas == [] and error is not None
    assert error.startswith("the server refused the token (400 InvalidKeyException")
    assert f"inf2serve token --run-dir {tmp_path}" in error and "reads it on the next" in error
    keys.write_text(json.dumps({"inference": {"key": TOKEN}}))  # `inf2serve token` did this
    assert _collect(backend, model) == (["Hel", "lo"], None)


def test_a_wrong_token_given_on_the_command_line_says_to_restart(fake: str) -> None:
    listing = asyncio.run(ChatBackend([fake], Token("n0t-the-t0ken")).list_models())
    # the page still offers the model its URL names, and says why it could not list
    assert listing.models == [ServedModel("tiny", fake)]
    assert len(listing.errors) == 1 and "refused the token" in listing.errors[0]
    assert "restart `inf2serve chat` with a valid --token" in listing.errors[0]
    assert "n0t-the-t0ken" not in listing.errors[0]


@pytest.mark.parametrize("mode,want", [
    ("400", "the server refused the request (400): max_tokens must be at most 64"),
    ("500", "the server failed (500): the model process died; its worker log says why"),
])
def test_an_error_answer_carries_the_server_message(fake: str, mode: str, want: str) -> None:
    Fake.mode = mode
    deltas, error = _collect(ChatBackend([fake], Token(TOKEN)), ServedModel("tiny", fake))
    assert deltas == [] and error is not None and error.startswith(want), error


def test_an_error_event_ends_the_reply_after_what_arrived(fake: str) -> None:
    Fake.mode = "error-event"
    deltas, error = _collect(ChatBackend([fake], Token(TOKEN)), ServedModel("tiny", fake))
    assert deltas == ["Hel", "lo"]
    assert error == "the server ended the reply with an error: the engine process died"


def test_a_reply_cut_short_says_the_worker_stopped(fake: str, tmp_path: Path) -> None:
    Fake.mode = "cut"
    keys = tmp_path / "key_file.json"
    keys.write_text(json.dumps({"inference": {"key": TOKEN}}))
    deltas, error = _collect(ChatBackend([fake], Token(key_file=keys, run_dir=tmp_path)),
                             ServedModel("tiny", fake))
    assert deltas == ["Hel"] and error is not None
    assert error.startswith("the reply was cut short (") and "stopped" in error, error
    assert str(tmp_path / "logs" / "model_log.log") in error


def test_a_server_that_is_not_there_is_named() -> None:
    url = "http://127.0.0.1:1/predictions/tiny/1.0/v1"  # port 1: refused at once
    deltas, error = _collect(ChatBackend([url], Token(TOKEN)), ServedModel("tiny", url))
    assert deltas == [] and error is not None
    assert error.startswith(f"cannot reach {url} (") and "is the server running?" in error


def test_a_server_that_does_not_answer_times_out(fake: str) -> None:
    Fake.mode = "silent"
    started = time.monotonic()
    deltas, error = _collect(ChatBackend([fake], Token(TOKEN), timeout_s=0.5),
                             ServedModel("tiny", fake))
    assert time.monotonic() - started < 2.5
    assert error is not None and error.startswith(f"no answer from {fake} within 0.5 s"), error


def test_stopping_a_reply_closes_the_request(fake: str) -> None:
    """What Gradio's stop button does: it closes the reply's generator (aclose); the HTTP
    request must go with it, so the server stops writing."""
    Fake.mode = "long"

    async def run() -> list[str]:
        stream = ChatBackend([fake], Token(TOKEN)).stream(ServedModel("tiny", fake),
                                                           [{"role": "user", "content": "x"}],
                                                           Sampling())
        got = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()
        return got

    assert asyncio.run(run()) == ["x", "x"]
    assert Fake.hung_up.wait(5), "the server kept streaming to a stopped reply"


def _run_dir(tmp_path: Path, management_url: str, pid: int) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "server.json").write_text(json.dumps({
        "run_dir": str(run), "inference_url": "http://127.0.0.1:9", "management_url":
        management_url, "metrics_url": "http://127.0.0.1:9", "pid": pid,
        "models": ["tiny", "other"]}))
    (run / "key_file.json").write_text(json.dumps({
        "management": {"key": "m"}, "inference": {"key": TOKEN}, "API": {"key": "a"}}))
    return run


def test_the_running_server_gives_each_model_its_base_url(fake: str, tmp_path: Path) -> None:
    management = fake.split("/predictions")[0]  # the fake answers the version, 2.0
    run = _run_dir(tmp_path, management, os.getpid())
    assert chat_cmd.served_base_urls(run) == [
        "http://127.0.0.1:9/predictions/tiny/2.0/v1", "http://127.0.0.1:9/predictions/other/2.0/v1"]


def test_the_servers_one_base_url_is_taken_when_it_runs_one(fake: str, tmp_path: Path) -> None:
    """Through the router, the page's stop button also cancels the reply at the model."""
    management = fake.split("/predictions")[0]
    run = _run_dir(tmp_path, management, os.getpid())
    info = json.loads((run / "server.json").read_text())
    (run / "server.json").write_text(json.dumps({**info,
                                                 "openai_url": "http://127.0.0.1:7/v1"}))
    assert chat_cmd.served_base_urls(run) == ["http://127.0.0.1:7/v1"]


def test_a_server_that_stopped_is_refused_in_one_line(tmp_path: Path) -> None:
    ended = subprocess.Popen(["true"])  # a pid that has exited
    ended.wait()
    run = _run_dir(tmp_path, "http://127.0.0.1:1", ended.pid)
    with pytest.raises(ChatError, match="is not running"):
        chat_cmd.served_base_urls(run)


def _fails(capsys, *argv: str) -> str:
    assert main(["chat", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    return err


def test_the_command_refuses_bad_input_in_one_line(tmp_path: Path, capsys) -> None:
    assert "no server started by `inf2serve serve`" in _fails(capsys, "--run-dir",
                                                               str(tmp_path))
    assert "not an http(s) URL" in _fails(capsys, "--url", "127.0.0.1:8080/v1")
    assert "not both" in _fails(capsys, "--url", "http://h/v1", "--token", "t", "--token-file",
                                "k")
    assert "cannot read the inference token" in _fails(capsys, "--url", "http://h/v1",
                                                       "--token-file", str(tmp_path / "no"))
    assert "--temperature 3.0" in _fails(capsys, "--url", "http://h/v1", "--temperature", "3")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"--port {port}: in use" in _fails(capsys, "--url", "http://h/v1", "--port",
                                                  str(port))


def test_the_page_config_holds_no_token(fake: str) -> None:
    """The JSON the browser loads names the model and the base URL, never the token."""
    pytest.importorskip("gradio", reason="the chat extra")
    from archive_tools.chat_page import build

    backend = ChatBackend([fake], Token(TOKEN))
    listing = asyncio.run(backend.list_models())
    page = build(backend, listing, Sampling(), system="Be brief.")
    config = json.dumps(page.get_config_file(), default=repr)
    assert "tiny" in config and fake in config and "Be brief." in config
    assert TOKEN not in config
