"""The OpenAI API on a real TorchServe: the official client, curl -N, errors in a batch.

One TorchServe for the module, serving the tiny demo model. TorchServe's frontend
batch must be 1 under asyncCommunication (see handlers/config.py), so the handler
batches: micro-batches with a 200 ms fill delay put concurrent requests together.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import ArchiveSpec, attach_logs_fixture, build_store, running_server

pytestmark = pytest.mark.e2e
MODEL = "tiny"
GREEDY = {"temperature": 0, "seed": 7, "max_tokens": 16}
# micro-batches of up to 8, started when full or 200 ms after the first arrives
HANDLER = {"batching": "micro", "batch_size": 8, "micro_batch_size": 8, "batch_delay_ms": 200,
           "threads": 1}
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("openai-e2e")
    store = build_store(root, tiny_checkpoint, [ArchiveSpec(MODEL, handler=HANDLER)])
    with running_server(store, root / "run", [MODEL]) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"{server.inference_url}/predictions/{MODEL}/1.0/v1"


@pytest.fixture(scope="module")
def client(server, base_url):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key=server.inference_token, max_retries=0, timeout=60)


def _post(server, url: str, body: dict | bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.inference_token}"}
    if isinstance(body, dict):
        return httpx.post(url, json=body, headers=headers, timeout=60)
    return httpx.post(url, content=body, timeout=60,
                      headers={**headers, "Content-Type": "application/json"})


def test_models_listing_answers_get(server, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


def test_completion_with_the_openai_client(client) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon a time", **GREEDY)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == MODEL
    choice = out.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert 0 < out.usage.completion_tokens <= 16
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_chat_deltas_concatenate_to_the_whole_answer(client) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content
    assert text

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True},
        **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == text
    assert with_choices[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert [c.choices[0].finish_reason for c in with_choices[:-1]] == [None] * \
        (len(with_choices) - 1)
    last = chunks[-1]  # include_usage: empty choices and the usage, before [DONE]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens


def read_lines_as_they_arrive(cmd: list[str]) -> list[tuple[int, float, str]]:
    """(read number, arrival time, line) for each line of a subprocess's stdout, read raw so
    lines that arrive apart are told apart."""
    lines, buf, reads = [], b"", 0
    with subprocess.Popen(cmd, stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        while piece := os.read(proc.stdout.fileno(), 65536):
            reads += 1
            buf += piece
            *complete, buf = buf.split(b"\n")
            now = time.monotonic()
            lines += [(reads, now, raw.decode("utf-8").rstrip("\r")) for raw in complete]
    assert proc.returncode == 0 and not buf
    return lines


def test_curl_sees_sse_events_one_by_one(server, base_url) -> None:
    body = json.dumps({"model": MODEL, "messages": CHAT, "stream": True, "max_tokens": 64,
                       "min_tokens": 64, "temperature": 0})
    lines = read_lines_as_they_arrive(
        ["curl", "-sS", "-N", "-i", "-H", f"Authorization: Bearer {server.inference_token}",
         "-H", "Content-Type: application/json", "-d", body, f"{base_url}/chat/completions"])
    head = [line.lower() for _, _, line in lines if not line.startswith("data:")]
    assert "content-type: text/event-stream" in head, head
    events = [(n, t, line) for n, t, line in lines if line.startswith("data: ")]
    assert events[-1][2] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for _, _, line in events[:-1]]
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert len(payloads) > 10  # about one per token (partial UTF-8 waits for the next)
    # one by one: the first event was read (and timed) before [DONE] was sent
    assert events[0][0] < events[-1][0] and events[0][1] < events[-1][1]


BAD = {
    "missing messages": ({"model": MODEL}, "messages"),
    "n=2": ({"model": MODEL, "messages": CHAT, "n": 2}, "n"),
    "max_tokens=-1": ({"model": MODEL, "messages": CHAT, "max_tokens": -1}, "max_tokens"),
    "bad role": ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
                 "messages[0].role"),
}


def test_invalid_requests_fail_alone_in_a_batch(server, base_url) -> None:
    url = f"{base_url}/chat/completions"
    good = [{"model": MODEL, "messages": CHAT, **GREEDY},
            {"model": MODEL, "messages": CHAT, "stream": True, **GREEDY}]
    bodies = [b for b, _ in BAD.values()] + good
    with ThreadPoolExecutor(len(bodies)) as pool:  # together within batch_delay_ms (200 ms)
        responses = list(pool.map(lambda b: _post(server, url, b), bodies))
    for (name, (_, param)), r in zip(BAD.items(), responses, strict=False):
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == param, name
    plain, streamed = responses[len(BAD):]
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"]
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.endswith("data: [DONE]\n\n")


def test_unknown_endpoint_and_malformed_json(server, base_url) -> None:
    r = _post(server, f"{base_url}/embeddings", {"model": MODEL, "input": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = _post(server, f"{base_url}/completions", b'{"prompt": "x",')
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "malformed JSON" in error["message"]
