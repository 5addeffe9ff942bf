"""A TorchServe worker process that dies never hangs a request (issue 30), through a real
TorchServe.

The engine process holds a duplicate of the worker's socket to the frontend; when the
worker gets SIGKILL, it writes each request's last words there (an in-band error for a
stream, a 500 for an answer not yet started), then closes it, and TorchServe restarts
the worker. Four requests run on the Neuron fake -- a native ndjson stream, two OpenAI SSE
streams (chat, completions) and a native non-streamed one -- when the *worker* (the engine
process's parent) is killed: each must end with its error within 5 s, once, and the next
request must succeed on a new worker whose model loads from the compile cache.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import psutil
import pytest

from tests.e2e.harness import build_store, logs, post, running_server
from tests.e2e.test_neuron_e2e import _env, _events, _neuron_spec

pytestmark = pytest.mark.e2e

TOKENS = 250  # long enough to be running when the kill lands (EOS suppressed)
NATIVE = {"prompt": "Once upon a time", "max_new_tokens": TOKENS, "min_new_tokens": TOKENS}
CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": TOKENS,
        "min_tokens": TOKENS, "stream": True}
#: what a worker logs once it serves (handlers/torchserve/worker_service.py)
SERVING = "serving TorchServe's async protocol with inf2serve's worker service"
COMPLETION = {"prompt": "Once upon a time", "max_tokens": TOKENS, "min_tokens": TOKENS,
              "stream": True}


@dataclass
class Outcome:
    status: int
    body: bytes
    ended: float
    error: str = ""  # the transport error that ended it, if any


def request(server, path: str, body: dict, started: threading.Event) -> Outcome:
    """POST and read the answer as it comes; `started` is set at the first byte of body."""
    buffer, status, error = b"", 0, ""
    headers = {"Authorization": f"Bearer {server.inference_token}"}
    try:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{server.inference_url}{path}", headers=headers,
                               json=body) as r:
                status = r.status_code
                for chunk in r.iter_raw():
                    started.set()
                    buffer += chunk
    except httpx.HTTPError as exc:  # a connection cut off counts as an error, not a hang
        error = f"{type(exc).__name__}: {exc}"
    return Outcome(status, buffer, time.monotonic(), error)


def wait_for_workers(server, serving: int, timeout_s: float) -> bool:
    """Whether `serving` workers have started serving within `timeout_s`, by the model log.
    Not by the management API: TorchServe 0.12 never marks a restarted async worker READY
    (it sets the state only on its first load), and it loses a request sent while it restarts
    one (docs/design.md, "A TorchServe worker that dies"), so the next request waits."""
    path = server.run_dir / "logs" / "model_log.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count(SERVING) >= serving:
            return True
        time.sleep(0.2)
    return False


def sse_events(body: bytes) -> list[str]:
    return [line[len("data: "):] for line in body.decode().splitlines()
            if line.startswith("data: ")]


def test_a_killed_worker_process_ends_every_request_and_comes_back_from_the_cache(
        tiny_checkpoint, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("worker-sigkill")
    name = "tiny-neuron-worker-kill"
    store = build_store(root, tiny_checkpoint, [_neuron_spec(name, root)])
    with running_server(store, root / "run", [name], env=_env(root)) as server:
        try:
            loaded = _events(root, 1)
            assert [e["event"] for e in loaded] == ["compile"]
            engine = psutil.Process(loaded[0]["pid"])  # the process holding the model...
            worker = engine.parent()  # ...and the TorchServe worker, its parent
            assert "model_service_worker" in " ".join(worker.cmdline())

            v1 = f"/predictions/{name}/1.0/v1"
            calls = [(f"/predictions/{name}", {**NATIVE, "stream_format": "ndjson"}),
                     (f"{v1}/chat/completions", CHAT),
                     (f"{v1}/completions", COMPLETION),
                     (f"/predictions/{name}", {**NATIVE, "stream": False})]
            started = [threading.Event() for _ in calls]
            with ThreadPoolExecutor(len(calls)) as pool:
                futures = [pool.submit(request, server, path, body, s)
                           for (path, body), s in zip(calls, started, strict=True)]
                assert all(s.wait(60) for s in started[:3])  # the streams are running...
                time.sleep(0.3)  # ...and the non-streamed one with them (4 slots)
                killed_at = time.monotonic()
                os.kill(worker.pid, signal.SIGKILL)
                ndjson, chat, completion, whole = [f.result(30) for f in futures]

            waited = {k: round(o.ended - killed_at, 3) for k, o in
                      (("ndjson", ndjson), ("chat", chat), ("completion", completion),
                       ("non-streamed", whole))}
            print("seconds from the worker's SIGKILL to each request's end:", waited)
            assert all(0 <= s < 5 for s in waited.values()), waited

            # the ndjson stream: text, then one error line, the last
            assert ndjson.status == 200 and not ndjson.error, ndjson
            lines = [json.loads(x) for x in ndjson.body.decode().splitlines() if x.strip()]
            assert "text" in lines[0] and all("error" not in x for x in lines[:-1])
            assert lines[-1]["error"]["code"] == 500, lines[-1]
            assert "worker process died" in lines[-1]["error"]["message"]
            assert len(lines) - 1 < TOKENS  # cut short, not finished

            # the SSE streams: deltas, then one error event and [DONE], nothing after
            for stream in (chat, completion):
                assert stream.status == 200 and not stream.error, stream
                events = sse_events(stream.body)
                assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
                error = json.loads(events[-2])["error"]
                assert error["code"] == 500 and "worker process died" in error["message"]
                assert all("error" not in json.loads(e) for e in events[:-2])

            # the non-streamed answer: a 500 with the error, once
            assert whole.status == 500 and not whole.error, whole
            assert "worker process died" in json.loads(whole.body)["error"]["message"]

            # the engine process of the dead worker is gone; TorchServe restarts the worker
            engine.wait(10)
            assert wait_for_workers(server, 2, 120)
            after = post(server, name, {"prompt": "The quick brown fox", "max_new_tokens": 8,
                                        "stream": False})
            assert after.status == 200, after.body
            assert after.json()["completion_tokens"] == 8

            reloaded = _events(root, 2)
            assert [e["event"] for e in reloaded] == ["compile", "load"]  # no recompilation
            new_worker = psutil.Process(reloaded[1]["pid"]).parent()
            assert new_worker.pid != worker.pid
            assert reloaded[1]["visible_cores"] == reloaded[0]["visible_cores"]
        except (AssertionError, httpx.HTTPError):
            print(logs(server.run_dir))
            raise
