"""A model process that stops without dying never hangs a request, through a real
TorchServe.

SIGSTOP is what a wedged runtime or a process frozen by the kernel looks like from outside:
it neither answers nor exits, so its pipe never closes. The worker's watchdog
(handlers/engine/client.py) hears its heartbeat fall silent while it holds requests, kills
it and answers for it as after a death. Four requests run on the Neuron fake -- a native
ndjson stream, two OpenAI SSE streams (chat, completions) and a native non-streamed one --
when the engine process is stopped: each must end within 5 s with one error, nothing
repeated, the stopped process must be gone, and the next requests must succeed on a new
engine process that loads from the compile cache.
"""

from __future__ import annotations

import signal

import httpx
import psutil
import pytest

from tests.e2e._kill_helpers import (
    assert_each_ended_once_with_an_error,
    assert_prefixes_of_greedy_answers,
    assert_reloaded_from_cache,
    engine_process,
    signal_mid_stream,
)
from tests.e2e.harness import build_store, logged, logs, running_server
from tests.e2e.test_neuron_e2e import _env, _neuron_spec

pytestmark = pytest.mark.e2e


def test_a_stopped_model_process_is_killed_ends_every_request_and_returns_from_the_cache(
        tiny_checkpoint, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("engine-stall")
    name = "tiny-neuron-stall"
    store = build_store(root, tiny_checkpoint, [_neuron_spec(name, root)])
    with running_server(store, root / "run", [name], env=_env(root)) as server:
        engine: psutil.Process | None = None
        try:
            engine, loaded = engine_process(root)
            outcomes, waited = signal_mid_stream(server, name, engine.pid, signal.SIGSTOP)

            # the worker killed it: a stopped process cannot exit by itself
            engine.wait(10)
            assert logged(server.run_dir, f"engine process {engine.pid} sent nothing for")

            streamed = assert_each_ended_once_with_an_error(outcomes, waited,
                                                            "hung (sent nothing for")
            assert_prefixes_of_greedy_answers(server, name, streamed)  # the next requests
            assert_reloaded_from_cache(root, loaded, engine.pid)
        except (AssertionError, httpx.HTTPError, psutil.TimeoutExpired, TimeoutError):
            print(logs(server.run_dir))
            raise
        finally:  # never leave a stopped process behind, whatever failed
            if engine is not None and engine.is_running():
                engine.kill()
