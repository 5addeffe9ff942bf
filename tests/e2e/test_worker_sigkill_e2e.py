"""A TorchServe worker process that dies never hangs a request (issue 30), through a real
TorchServe.

The worker's guardian holds a duplicate of the worker's socket to the frontend; when the
worker gets SIGKILL, it writes each request's last words there (an in-band error for a
stream, a 500 for an answer not yet started) and starts a worker that takes the socket
over (handlers/torchserve/takeover.py): TorchServe never restarts it. Four requests run on
the Neuron fake -- a native ndjson stream, two OpenAI SSE streams (chat, completions) and a
native non-streamed one -- when the *worker* (the engine process's parent) is killed: each
must end with its error within 5 s, once, and the next request must succeed on a new
worker whose model loads from the compile cache. A worker that is stopped instead
(SIGSTOP: it neither dies nor reads) is killed by the engine process after 2 s
(handlers/engine/process.py watch_worker), and the same follows. Then the worker that took
over is killed under steady traffic (a request every 0.1 s): every request ends, and the
model serves again while they keep coming, which TorchServe's own restart never managed.
The workers start as if in a crash loop, so each takeover comes after the guardian's wait.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e._kill_helpers import (
    assert_each_ended_once_with_an_error,
    assert_prefixes_of_greedy_answers,
    assert_reloaded_from_cache,
    assert_steady_traffic_survives_a_kill,
    engine_process,
    signal_mid_stream,
    wait_for_workers,
)
from tests.e2e.harness import build_store, logs, running_server
from tests.e2e.test_neuron_e2e import _env, _events, _neuron_spec

pytestmark = pytest.mark.e2e


#: TorchServe's worker starts as if two workers before it had died soon after taking
#: over (handlers/engine/guardian.py SHORT_LIVED_ENV), so every takeover here backs off
CRASH_LOOP = {"INF2SERVE_TAKEOVER_SHORT_LIVED": "2"}


def log_text(run_dir: Path, name: str) -> str:
    """A TorchServe log of the run, whole (`logs` has its tail only)."""
    path = run_dir / "logs" / name
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_killed_or_stopped_worker_ends_every_request_and_comes_back_from_the_cache(
        sig, tiny_checkpoint, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("worker-sigkill")
    name = "tiny-neuron-worker-kill"
    worker = successor = None
    store = build_store(root, tiny_checkpoint, [_neuron_spec(name, root)])
    with running_server(store, root / "run", [name], env={**_env(root), **CRASH_LOOP}) as server:
        try:
            engine, loaded = engine_process(root)  # the process holding the model...
            worker = engine.parent()  # ...and the TorchServe worker, its parent
            outcomes, waited = signal_mid_stream(server, name, worker.pid, sig)

            streamed = assert_each_ended_once_with_an_error(outcomes, waited,
                                                            "worker process died")
            # the engine process of the dead worker is gone; a worker takes its socket over
            engine.wait(10)
            assert wait_for_workers(server, 2, 120)
            assert_prefixes_of_greedy_answers(server, name, streamed)  # the next requests
            reloaded = assert_reloaded_from_cache(root, loaded, engine.pid)
            assert psutil.Process(reloaded["pid"]).parent().pid != worker.pid
            if sig == signal.SIGSTOP:
                assert "has been stopped for" in logs(server.run_dir)  # killed by its engine
            else:  # the worker now serving is the one that took the socket over: kill it
                taken = psutil.Process(reloaded["pid"]).parent()  # under steady traffic
                assert "takeover" in " ".join(taken.cmdline())
                assert_steady_traffic_survives_a_kill(server, root, name, taken)
                # a crash loop (CRASH_LOOP): each takeover came after a wait, 1 s then 2 s
                log = log_text(server.run_dir, "model_log.log")
                for n, wait in ((3, 1), (4, 2)):
                    assert f"{n} workers in a row died within 60 s of taking over: the next " \
                           f"one starts in {wait} s" in log
                assert "Received more than 1 control command" not in log_text(
                    server.run_dir, "ts_log.log")
                successor = psutil.Process(_events(root, 3)[-1]["pid"]).parent()
                # the workers that took over kept the dead one's id: one set of metric files
                ids = {f.stem.rsplit("_", 1)[-1] for f in (server.run_dir / "metrics").glob("*.db")}
                assert len(ids) == 1, ids
        except (AssertionError, httpx.HTTPError, TimeoutError):
            print(logs(server.run_dir))
            raise
        finally:
            if worker is not None and worker.is_running():  # never leave a stopped process
                worker.kill()
    if successor is not None:  # TorchServe stopped: the worker that took over ends with it
        successor.wait(10)
