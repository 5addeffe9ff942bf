"""A client that leaves frees its slot at once, through the one OpenAI base URL, whichever
worker of its model runs it.

TorchServe 0.12 tells a worker nothing when a client disconnects (docs/design.md); the
OpenAI router `serve` starts holds the client's connection and cancels the request at the
model when it goes. Two slots, two long streams abandoned after their first chunk (a chat
UI's stop button): a newcomer's first token must come within a second of their leaving,
where without the cancel it would wait for 400 more tokens of each.

TorchServe hands that cancel to any worker of the model, and only the worker running the
request knows its name, so the workers of a model answer one another
(handlers/torchserve/cancel_peers.py). The same server hosts a synthetic model (one slot
per worker) with 2 workers, then scaled to 3: 20 streams abandoned after their first
chunk, each cancel must come back `{"cancelled": true}` -- with 2 workers, 4 of 6 once came
back false, and the requests ran on -- some through another worker. That model runs its
engine inline (one process per worker, the cheapest to load): the forwarding is the
handler's, above the engine, and the first model cancels through an engine process.
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
#: the model whose workers forward cancels; 400 tokens at 10 ms run on for 4 s if missed
PEERS = "synth-workers"
PEERS_HANDLER = {"backend": "synthetic", "engine_process": "inline", "batch_size": 1,
                 "max_queue": 8, "max_new_tokens_limit": 500, "threads": 1, "warmup": False,
                 "synthetic": {"decode_step_ms": 10, "decode_ms_per_row": 0,
                               "prefill_ms": [0]}}
ABANDONED = 20
ANSWERED = "cancel answered 200"
#: what a worker logs when it cancels a request another worker was asked to cancel
THROUGH_PEER = "which another worker was asked to cancel"


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("disconnect")
    store = build_store(root, tiny_checkpoint, [
        ArchiveSpec(MODEL, handler=HANDLER),
        ArchiveSpec(PEERS, frontend={"minWorkers": 2, "maxWorkers": 2}, handler=PEERS_HANDLER)])
    with running_server(store, root / "run", [MODEL, PEERS], openai_port=0) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


def first_chunk_then_leave(server, model: str, errors: list[str],
                           got_first: threading.Event | None = None,
                           left: list[float] | None = None) -> None:
    body = {**LONG, "model": model}
    try:
        with httpx.Client(timeout=60) as client, client.stream(
                "POST", f"{server.openai_url}/chat/completions", json=body,
                headers={"Authorization": f"Bearer {server.inference_token}"}) as r:
            assert r.status_code == 200, r.read()
            next(r.iter_raw())
            if got_first is not None:
                got_first.set()
    except Exception as exc:  # noqa: BLE001 -- reported by the test
        errors.append(f"{type(exc).__name__}: {exc}")
        return
    if left is not None:
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


def cancel_answers(server) -> list[str]:
    text = (server.run_dir / "logs" / "openai_router.log").read_text()
    return [line for line in text.splitlines() if ANSWERED in line]


def model_log(server) -> str:
    path = server.run_dir / "logs" / "model_log.log"
    return path.read_text() if path.exists() else ""


def test_abandoned_streams_free_their_slots_for_a_newcomer_within_a_second(server) -> None:
    before = len(cancel_answers(server))
    events = [threading.Event(), threading.Event()]
    left: list[float] = []
    errors: list[str] = []
    threads = [threading.Thread(target=first_chunk_then_leave,
                                args=(server, MODEL, errors, e, left)) for e in events]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(e.is_set() for e in events) and len(left) == 2  # both ran, then left
    waited = first_token_after(server, max(left))
    print(f"newcomer's first token {waited:.3f} s after the last client left")
    answers = cancel_answers(server)[before:]
    assert len(answers) == 2, answers
    assert waited < 1.0, logs(server.run_dir)[-3000:]


def scale(server, model: str, workers: int) -> None:
    """`workers` READY workers of `model`, through TorchServe's management API."""
    headers = {"Authorization": f"Bearer {server.management_token}"}
    r = httpx.put(f"{server.management_url}/models/{model}", headers=headers, timeout=30,
                  params={"min_worker": workers, "max_worker": workers})
    assert r.status_code in (200, 202), r.text
    deadline = time.monotonic() + 600  # a worker loading on 2 shared cores
    while time.monotonic() < deadline:
        r = httpx.get(f"{server.management_url}/models/{model}", headers=headers, timeout=10)
        ready = [w for w in r.json()[0]["workers"] if w["status"] == "READY"]
        if len(ready) == workers:
            return
        time.sleep(0.5)
    raise AssertionError(f"{model} has no {workers} READY workers: {r.text}")


@pytest.mark.parametrize("workers", [2, 3])
def test_every_cancel_reaches_the_worker_running_its_request(server, workers: int) -> None:
    scale(server, PEERS, workers)
    before = len(cancel_answers(server))
    through_peers = model_log(server).count(THROUGH_PEER)
    errors: list[str] = []
    left = 0
    while left < ABANDONED:
        streams = min(workers, ABANDONED - left)  # a round: a stream for each worker
        threads = [threading.Thread(target=first_chunk_then_leave, args=(server, PEERS, errors))
                   for _ in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        left += streams
        deadline = time.monotonic() + 30  # the round's cancels answered before the next
        while len(cancel_answers(server)) < before + left and time.monotonic() < deadline:
            time.sleep(0.05)
    answers = cancel_answers(server)[before:]
    assert not errors, errors
    assert len(answers) == ABANDONED, logs(server.run_dir)[-3000:]
    missed = [line for line in answers if '"cancelled": true' not in line]
    print(f"{workers} workers: {ABANDONED - len(missed)} of {ABANDONED} cancels reached "
          "their request")
    assert not missed, missed
    assert model_log(server).count(THROUGH_PEER) > through_peers  # some went through a peer
