"""A client that leaves frees its slot at once, through the one OpenAI base URL.

TorchServe 0.12 tells a worker nothing when a client disconnects (docs/design.md); the
OpenAI router `serve` starts holds the client's connection and cancels the request at the
model when it goes. Two slots, two long streams abandoned after their first chunk (a chat
UI's stop button): a newcomer's first token must come within a second of their leaving,
where without the cancel it would wait for 400 more tokens of each.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import ArchiveSpec, attach_logs_fixture, build_store, logs, running_server

pytestmark = pytest.mark.e2e
MODEL = "tiny-two-slots"
HANDLER = {"batch_size": 2, "max_new_tokens_limit": 500, "threads": 1}
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 400, "min_tokens": 400, "stream": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("disconnect")
    store = build_store(root, tiny_checkpoint, [ArchiveSpec(MODEL, handler=HANDLER)])
    with running_server(store, root / "run", [MODEL], openai_port=0) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


def first_chunk_then_leave(server, got_first: threading.Event, left: list[float]) -> None:
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{server.openai_url}/chat/completions", json=LONG,
            headers={"Authorization": f"Bearer {server.inference_token}"}) as r:
        assert r.status_code == 200
        next(r.iter_raw())
        got_first.set()
    left.append(time.monotonic())  # the connection is closed here: the client is gone


def first_token_after(server, sent: float) -> float:
    body = {**LONG, "max_tokens": 8, "min_tokens": 0}
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{server.openai_url}/chat/completions", json=body,
            headers={"Authorization": f"Bearer {server.inference_token}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                    "content"):
                return time.monotonic() - sent
    raise AssertionError("the newcomer got no text")


def test_abandoned_streams_free_their_slots_for_a_newcomer_within_a_second(server) -> None:
    events = [threading.Event(), threading.Event()]
    left: list[float] = []
    threads = [threading.Thread(target=first_chunk_then_leave, args=(server, e, left))
               for e in events]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(e.is_set() for e in events) and len(left) == 2  # both ran, then left
    waited = first_token_after(server, max(left))
    print(f"newcomer's first token {waited:.3f} s after the last client left")
    router_log = (server.run_dir / "logs" / "openai_router.log").read_text()
    assert router_log.count("cancel answered 200") == 2, router_log[-2000:]
    assert waited < 1.0, logs(server.run_dir)[-3000:]
