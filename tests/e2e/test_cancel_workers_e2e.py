"""A client that leaves is cancelled whichever worker of the model gets the cancel.

The OpenAI router POSTs a departed client's name to the model's inf2serve/cancel, and
TorchServe hands that POST to any worker of the model; the request runs on one of them.
One TorchServe serves a model with 2 workers and one with 3 (one slot each, the synthetic
device at 10 ms a token): 20 streams of 400 tokens each are abandoned after their first
chunk, and each cancel must come back `{"cancelled": true}` -- with 2 workers, 4 of 6 once
came back false, and the requests ran on -- with some reaching their worker through
another (handlers/torchserve/cancel_peers.py).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import ArchiveSpec, attach_logs_fixture, build_store, logs, running_server

pytestmark = pytest.mark.e2e
WORKERS = {"tiny-two-workers": 2, "tiny-three-workers": 3}
ABANDONED = 20
HANDLER = {"backend": "synthetic", "batch_size": 1, "max_queue": 8, "max_new_tokens_limit": 500,
           "threads": 1, "warmup": False,
           "synthetic": {"decode_step_ms": 10, "decode_ms_per_row": 0, "prefill_ms": [0]}}
ANSWERED = "cancel answered 200"
#: what a worker logs when it cancels a request another worker was asked to cancel
THROUGH_PEER = "which another worker was asked to cancel"


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("cancel-workers")
    specs = [ArchiveSpec(name, frontend={"minWorkers": n, "maxWorkers": n}, handler=HANDLER)
             for name, n in WORKERS.items()]
    store = build_store(root, tiny_checkpoint, specs)
    # five workers and their engine processes load at once: on 2 shared cores, minutes
    with running_server(store, root / "run", list(WORKERS), openai_port=0,
                        ready_timeout_s=900) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


def first_chunk_then_leave(server, model: str, errors: list[str]) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400, "min_tokens": 400, "stream": True}
    try:
        with httpx.Client(timeout=60) as client, client.stream(
                "POST", f"{server.openai_url}/chat/completions", json=body,
                headers={"Authorization": f"Bearer {server.inference_token}"}) as r:
            assert r.status_code == 200, r.read()
            next(r.iter_raw())
    except Exception as exc:  # noqa: BLE001 -- reported by the test
        errors.append(f"{type(exc).__name__}: {exc}")


def model_log(server) -> str:
    path = server.run_dir / "logs" / "model_log.log"
    return path.read_text() if path.exists() else ""


def cancel_answers(server) -> list[str]:
    text = (server.run_dir / "logs" / "openai_router.log").read_text()
    return [line for line in text.splitlines() if ANSWERED in line]


@pytest.mark.parametrize("model", list(WORKERS))
def test_every_cancel_reaches_the_worker_running_its_request(server, model: str) -> None:
    workers, before = WORKERS[model], len(cancel_answers(server))
    through_peers = model_log(server).count(THROUGH_PEER)
    errors: list[str] = []
    left = 0
    while left < ABANDONED:
        streams = min(workers, ABANDONED - left)  # a round: a stream for each worker
        threads = [threading.Thread(target=first_chunk_then_leave, args=(server, model, errors))
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
    print(f"{model}: {ABANDONED - len(missed)} of {ABANDONED} cancels reached their request")
    assert not missed, missed
    assert model_log(server).count(THROUGH_PEER) > through_peers  # some went through a peer
