"""A model process that dies never hangs a request (issue 12), through a real TorchServe.

The neuron archive runs on the transformers-neuronx fake, whose event log names the
process that compiled or loaded the model: the engine process, a child of the
TorchServe worker. Four requests run -- a native ndjson stream, two OpenAI SSE streams
(chat, completions) and a native non-streamed one -- when that process gets SIGKILL (what
an OOM kill or a Neuron runtime abort looks like): each must end within 5 s with one error
naming the signal, nothing repeated, the next requests must succeed, and the model must
come back by loading from the compile cache, not by compiling again.
"""

from __future__ import annotations

import signal

import httpx
import pytest

from tests.e2e._kill_helpers import (
    assert_each_ended_once_with_an_error,
    assert_prefixes_of_greedy_answers,
    assert_reloaded_from_cache,
    engine_process,
    signal_mid_stream,
)
from tests.e2e.harness import build_store, logs, running_server
from tests.e2e.test_neuron_e2e import _env, _neuron_spec

pytestmark = pytest.mark.e2e


def test_a_killed_model_process_ends_every_request_and_returns_from_the_cache(
        tiny_checkpoint, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("worker-death")
    name = "tiny-neuron-death"
    store = build_store(root, tiny_checkpoint, [_neuron_spec(name, root)])
    with running_server(store, root / "run", [name], env=_env(root)) as server:
        try:
            engine, loaded = engine_process(root)
            outcomes, waited = signal_mid_stream(server, name, engine.pid, signal.SIGKILL)

            streamed = assert_each_ended_once_with_an_error(outcomes, waited, "SIGKILL")
            assert_prefixes_of_greedy_answers(server, name, streamed)  # the next requests
            assert not engine.is_running()
            assert_reloaded_from_cache(root, loaded, engine.pid)
        except (AssertionError, httpx.HTTPError, TimeoutError):
            print(logs(server.run_dir))
            raise
