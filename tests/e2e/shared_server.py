"""One TorchServe of the tiny torch model for the end-to-end files that only need it.

Each start of a server costs ~19 s of CPU on 2 cores (the frontend JVM ~4 s, and per model
a TorchServe worker and an engine process ~6 s each, mostly importing torch and
transformers). test_answers_e2e, test_bad_input_e2e, test_generation_e2e and
test_torchserve_client_e2e each started their own for the same checkpoint (4 servers, 8
models); they now share this one (1 server, 5 models). Their tests carry the xdist group
GROUP, so `--dist loadgroup` runs them on one pytest worker, one after the other
(tests/conftest.py gives every other file a group of its own, as `--dist loadfile` did);
the server starts with the first of them and stops after the last
(tests/e2e/conftest.py), or at a file outside the group in a run without xdist.

A model here is shared by several files' tests, so its settings are the union of what they
ask: "tiny" has bad input's limits (max_length 64, max_new_tokens_limit 32) and the
TorchServe client's 16 slots.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from archive_tools import serve
from tests.e2e.harness import ArchiveSpec, build_store, running_server

GROUP = "tiny-torch-server"
#: what a file of the group puts in its `pytestmark`
MARKS = [pytest.mark.e2e, pytest.mark.xdist_group(GROUP)]

FAULTY_ENTRY = '''
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "runtime"))

from handlers.backends import load_backend  # noqa: E402
from handlers.torchserve.generation_handler import GenerationHandler  # noqa: E402
from handlers.engine.start import load_tokenizer  # noqa: E402


class FaultyHandler(GenerationHandler):
    """Injected by the test: prefill raises for any micro-batch holding a prompt with FAIL."""

    def make_backend(self, config, model_dir):
        backend = load_backend(config.handler, model_dir)
        tok = load_tokenizer(model_dir / config.handler.checkpoint)
        real = backend.prefill

        def prefill(slots, prompts, params):
            if any("FAIL" in tok.decode(p) for p in prompts):
                raise RuntimeError("injected failure")
            return real(slots, prompts, params)

        backend.prefill = prefill
        return backend
'''

MICRO = {"batching": "micro", "batch_size": 8, "micro_batch_size": 4, "batch_delay_ms": 100,
         "threads": 1}
SPECS = [
    # bad input's limits (tests/unit/test_bad_input.py's: "hi " * 600 does not fit in 64),
    # 16 slots for 16 concurrent TorchServe-client streams
    ArchiveSpec("tiny", handler={"batching": "continuous", "batch_size": 16, "max_queue": 64,
                                 "threads": 1, "max_length": 64, "max_new_tokens_limit": 32,
                                 "defaults": {"max_new_tokens": 8}}),
    ArchiveSpec("tiny-micro", handler=MICRO),
    ArchiveSpec("tiny-cont", handler={"batching": "continuous", "batch_size": 8, "threads": 1}),
    ArchiveSpec("tiny-faulty", handler=MICRO, fmt="no-archive", entry_source=FAULTY_ENTRY),
    # one slot, one queue place: a third request is refused with 503
    ArchiveSpec("tiny-tight", handler={"batching": "continuous", "batch_size": 1, "max_queue": 1,
                                       "max_new_tokens_limit": 500, "threads": 1},
                fmt="zip-store"),
]


class SharedServer:
    """The group's server: started on first use, stopped when the group's tests are done."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self._server: serve.Server | None = None

    def get(self, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> serve.Server:
        if self._server is None:
            root = tmp_path_factory.mktemp("tiny-server-e2e")
            store = build_store(root, checkpoint, SPECS)
            with contextlib.ExitStack() as stack:
                self._server = stack.enter_context(
                    running_server(store, root / "run", [s.name for s in SPECS]))
                self._stack = stack.pop_all()
        return self._server

    def stop(self) -> None:
        stack, self._stack, self._server = self._stack, None, None
        if stack is not None:
            stack.close()


SHARED = SharedServer()


def in_group(item: pytest.Item | None) -> bool:
    return item is not None and any(GROUP in m.args for m in item.iter_markers("xdist_group"))
