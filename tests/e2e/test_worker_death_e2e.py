"""A model process that dies never hangs a request (issue 12), through a real TorchServe.

The neuron archive runs on the transformers-neuronx fake, whose event log names the
process that compiled or loaded the model: the engine process, a child of the
TorchServe worker. Four streams run; that process gets SIGKILL (what an OOM kill or a
Neuron runtime abort looks like); each stream must end with an in-band error within
5 s, the next request must succeed, and the model must come back by loading from the
compile cache, not by compiling again.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.e2e.harness import build_store, logs, post, running_server
from tests.e2e.test_neuron_e2e import _env, _events, _neuron_spec

pytestmark = pytest.mark.e2e

#: long enough to be running when the kill lands (EOS suppressed: min_new_tokens)
LONG = {"prompt": "Once upon a time", "max_new_tokens": 250, "min_new_tokens": 250,
        "stream_format": "ndjson"}


def stream(server, model: str, body: dict, started: threading.Event) -> tuple[int, list, float]:
    """POST and read the ndjson stream; `started` is set at the first chunk."""
    lines, buffer = [], b""
    headers = {"Authorization": f"Bearer {server.inference_token}"}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.inference_url}/predictions/{model}",
                           headers=headers, json=body) as r:
            for chunk in r.iter_raw():
                started.set()
                buffer += chunk
            status = r.status_code
    ended = time.monotonic()
    lines = [json.loads(x) for x in buffer.decode().splitlines() if x.strip()]
    return status, lines, ended


def test_a_killed_model_process_ends_every_stream_and_returns_from_the_cache(
        tiny_checkpoint, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("worker-death")
    name = "tiny-neuron-death"
    store = build_store(root, tiny_checkpoint, [_neuron_spec(name, root)])
    with running_server(store, root / "run", [name], env=_env(root)) as server:
        try:
            loaded = _events(root, 1)
            assert [e["event"] for e in loaded] == ["compile"]
            holder = psutil.Process(loaded[0]["pid"])  # the process holding the model...
            assert "model_service_worker" in " ".join(holder.parent().cmdline())  # ...a child

            started = [threading.Event() for _ in range(4)]
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(stream, server, name, LONG, s) for s in started]
                assert all(s.wait(60) for s in started)
                killed_at = time.monotonic()
                os.kill(holder.pid, signal.SIGKILL)
                results = [f.result() for f in futures]

            for status, lines, ended in results:
                assert status == 200  # the stream had started: the error is in band
                assert "text" in lines[0]
                error = lines[-1]["error"]
                assert error["code"] == 500 and "SIGKILL" in error["message"], lines[-1]
                assert len(lines) - 1 < LONG["max_new_tokens"]  # cut short, not finished
                assert ended - killed_at < 5, ended - killed_at

            after = post(server, name, {"prompt": "The quick brown fox", "max_new_tokens": 8,
                                        "stream": False})
            assert after.status == 200, after.body
            assert after.json()["completion_tokens"] == 8

            reloaded = _events(root, 2)
            assert [e["event"] for e in reloaded] == ["compile", "load"]  # no recompilation
            assert reloaded[1]["pid"] != holder.pid
            assert reloaded[1]["visible_cores"] == reloaded[0]["visible_cores"]
        except AssertionError:
            print(logs(server.run_dir))
            raise
