"""Overdue and abandoned requests free their slots, through a real TorchServe.

TorchServe 0.12 never tells the worker that a client went away (docs/design.md, "Abandoned
requests"), so a request's deadline (`timeout`, or handler.request_timeout_s) is what
frees its slot. The model here sleeps STEP_S per step, so a 400-token stream holds its
slot for at least 400 x STEP_S seconds -- a floor, whatever the machine's load -- and
a newcomer that finds every slot taken must wait for that unless deadlines work.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.e2e.harness import ArchiveSpec, attach_logs_fixture, build_store, running_server

pytestmark = pytest.mark.e2e
STEP_S, LONG, DEADLINE_S = 0.02, 400, 1.5
FLOOR_S = LONG * STEP_S  # the least time a LONG-token stream holds its slot without a deadline

SLOW_ENTRY = f'''
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "runtime"))

from handlers.backends import load_backend  # noqa: E402
from handlers.torchserve.generation_handler import GenerationHandler  # noqa: E402


class SlowHandler(GenerationHandler):
    """Injected by the test: every model call takes at least {STEP_S} s longer."""

    def make_backend(self, config, model_dir):
        backend = load_backend(config.handler, model_dir)
        for name in ("prefill", "decode", "step"):
            real = getattr(backend, name)

            def slow(*args, _real=real):
                time.sleep({STEP_S})
                return _real(*args)

            setattr(backend, name, slow)
        return backend
'''
MODEL = "tiny-slow"
SPECS = [ArchiveSpec(MODEL, handler={"batching": "continuous", "batch_size": 4, "threads": 1,
                                     "max_new_tokens_limit": LONG},
                     fmt="no-archive", entry_source=SLOW_ENTRY)]
LONG_BODY = {"prompt": "Busy", "max_new_tokens": LONG, "min_new_tokens": LONG,
             "timeout": DEADLINE_S, "stream_format": "ndjson"}


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("deadline-e2e")
    store = build_store(root, tiny_checkpoint, SPECS)
    with running_server(store, root / "run", [MODEL]) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


def headers(server) -> dict:
    return {"Authorization": f"Bearer {server.inference_token}"}


def long_stream(server, path: str, body: dict, started: threading.Barrier, out: list,
                abandon: bool) -> None:
    """Stream `body`; note when it was sent and, unless abandoned, every chunk."""
    t0 = time.monotonic()
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", f"{server.inference_url}{path}", json=body, headers=headers(server)) as r:
        chunks = []
        for chunk in r.iter_raw():
            if not chunks:
                started.wait(60)
            chunks.append(chunk)
            if abandon:  # the client goes away: closes the connection mid-stream
                break
        out.append((t0, r.status_code, b"".join(chunks)))


def newcomer(server) -> tuple[float, float, list[dict]]:
    """A short stream sent once every slot is busy: (sent, first chunk, ndjson lines)."""
    body = {"prompt": "Newcomer", "max_new_tokens": 4, "min_new_tokens": 4,
            "stream_format": "ndjson"}
    sent, first, data = time.monotonic(), None, b""
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", f"{server.inference_url}/predictions/{MODEL}", json=body,
            headers=headers(server)) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            first = first or time.monotonic()
            data += chunk
    return sent, first, [json.loads(line) for line in data.decode().splitlines()]


def occupy_all_slots(server, bodies: list[tuple[str, dict]], abandon: bool):
    """Four streams at once; returns once each has its first chunk (every slot is busy)."""
    started = threading.Barrier(len(bodies) + 1)
    out: list = []
    threads = [threading.Thread(target=long_stream,
                                args=(server, path, body, started, out, abandon))
               for path, body in bodies]
    for t in threads:
        t.start()
    started.wait(60)
    return threads, out


def test_abandoned_streams_free_their_slots_at_their_deadline(server):
    threads, out = occupy_all_slots(server, [(f"/predictions/{MODEL}", LONG_BODY)] * 4,
                                    abandon=True)
    sent, first, lines = newcomer(server)
    for t in threads:
        t.join(60)
    assert len(out) == 4 and all(status == 200 for _, status, _ in out)
    assert lines[-1]["finish_reason"] == "length" and lines[-1]["completion_tokens"] == 4
    # it waited for a slot: none could free before the first long stream's deadline...
    assert first >= min(t0 for t0, _, _ in out) + DEADLINE_S
    # ...and got one long before the abandoned streams would have let go
    assert first - sent < FLOOR_S / 2, (first - sent, FLOOR_S)


#: the overdue test's long deadline: the queued request's 0.5 s must lapse before any long
#: stream's, counted from the first one's start, however long the four take to get going
#: (at 1.5 s, at a load of 7-9, a slot freed while the queued request waited: a 200)
OVERDUE_S = 3.0


def test_overdue_streams_end_with_finish_reason_timeout_and_queued_ones_get_504(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Busy"}],
            "max_tokens": LONG, "min_tokens": LONG, "timeout": OVERDUE_S, "stream": True}
    bodies = [(f"/predictions/{MODEL}", {**LONG_BODY, "timeout": OVERDUE_S})] * 2 + \
        [(f"/predictions/{MODEL}/1.0/v1/chat/completions", chat)] * 2
    threads, out = occupy_all_slots(server, bodies, abandon=False)
    queued = httpx.post(f"{server.inference_url}/predictions/{MODEL}", headers=headers(server),
                        json={"prompt": "Queued", "timeout": 0.5, "stream": False}, timeout=60)
    sent, first, lines = newcomer(server)
    for t in threads:
        t.join(60)
    assert queued.status_code == 504 and queued.json()["error"]["type"] == "timeout"
    assert "waited for a slot" in queued.json()["error"]["message"]
    for _, status, data in out:
        assert status == 200
        text = data.decode()
        if text.startswith("data:"):  # OpenAI chat: the finish_reason event, then [DONE]
            events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
            assert events[-1]["choices"][0]["finish_reason"] == "timeout"
            assert text.endswith("data: [DONE]\n\n")
        else:
            final = json.loads(text.splitlines()[-1])
            assert final["finish_reason"] == "timeout" and final["completion_tokens"] < LONG
    assert first >= min(t0 for t0, _, _ in out) + OVERDUE_S
    assert first - sent < FLOOR_S / 2, (first - sent, FLOOR_S)


def test_the_openai_client_reads_finish_reason_timeout(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.inference_url}/predictions/{MODEL}/1.0/v1",
                    api_key=server.inference_token, max_retries=0, timeout=60)
    out = client.completions.create(model=MODEL, prompt="Busy", max_tokens=LONG,
                                    extra_body={"min_tokens": LONG, "timeout": 0.3})
    assert out.choices[0].finish_reason == "timeout"
    assert 0 < out.usage.completion_tokens < LONG
