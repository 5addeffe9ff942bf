"""The nxdi backend through a real TorchServe, on the NxD Inference fake.

PYTHONPATH puts tests/fakes/nxdi first, so the workers import the fake SDK (it computes
with the real checkpoint on CPU and logs every compile/load to an events file).
Checks: streamed text equals plain transformers' and the torch backend's; 1-token
prompts joining and leaving a running request leave its text unchanged; a restart on the
same archive compiles nothing and loads from the archive's compile cache; two workers
started together compile once and load on disjoint NEURON_RT_VISIBLE_CORES.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.harness import ArchiveSpec, build_store, logs, post, running_server
from tests.e2e.test_neuron_e2e import (
    NEW_TOKENS,
    PROMPTS,
    TORCH_BACKEND,
    _events,
    _generate,
    _joined_by_one_token_prompts,
    _transformers_text,
)

pytestmark = pytest.mark.e2e

NXDI = Path(__file__).resolve().parents[1] / "fakes" / "nxdi"


def _spec(name: str, root: Path, workers: int = 1) -> ArchiveSpec:
    return ArchiveSpec(
        name, {"minWorkers": workers, "maxWorkers": workers, "deviceType": "neuron"},
        {"backend": "nxdi", "batching": "continuous", "batch_size": 4, "threads": 1,
         "dtype": "float32",
         "neuron": {"tp_degree": 2, "cores_per_instance": 4,
                    "context_length_estimate": [16, 64],
                    "core_lock_dir": str(root / "core-locks")}},
        fmt="no-archive")  # a folder: its neuron_cache/ persists across restarts


def _env(root: Path, compile_s: float = 0.0) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(NXDI),
                                                        os.environ.get("PYTHONPATH")])),
            "INF2SERVE_FAKE_NEURON_EVENTS": str(root / "events.jsonl"),
            "INF2SERVE_FAKE_NEURON_DEVICE_DIR": str(root / "device"),
            "INF2SERVE_FAKE_NEURON_COMPILE_S": str(compile_s)}


def test_streams_greedy_text_and_restarts_from_the_cache(tiny_checkpoint,
                                                         tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("nxdi-e2e")
    specs = [_spec("tiny-nxdi", root)]
    if TORCH_BACKEND:
        specs.append(ArchiveSpec("tiny-torch", {}, {"batching": "continuous", "batch_size": 4,
                                                    "threads": 1}))
    store = build_store(root, tiny_checkpoint, specs)
    requirements = (store / "tiny-nxdi" / "requirements.txt").read_text()
    assert "transformers==" not in requirements  # the SDK's transformers 4.57 stays
    with running_server(store, root / "run1", [s.name for s in specs], env=_env(root)) as server:
        try:
            first = _generate(server, "tiny-nxdi")
            assert first == [_transformers_text(tiny_checkpoint, p) for p in PROMPTS]
            if TORCH_BACKEND:
                assert first == _generate(server, "tiny-torch")
            assert any(t.strip() for t in first)
            alone, joined = _joined_by_one_token_prompts(server, "tiny-nxdi")
            assert joined == alone
            one = post(server, "tiny-nxdi", {"prompt": "a", "max_new_tokens": NEW_TOKENS,
                                             "temperature": 0.0})  # "a" is one token
            assert one.text == _transformers_text(tiny_checkpoint, "a")
        except AssertionError:
            print(logs(server.run_dir))
            raise
    events = _events(root, 2)
    assert [e["event"] for e in events] == ["compile", "load"]
    assert events[1]["visible_cores"] == [0, 1]
    entries = [p for p in (store / "tiny-nxdi" / "neuron_cache").iterdir()
               if (p / "metadata.json").exists()]
    assert len(entries) == 1 and entries[0].name.startswith("nxdi-llama-")

    with running_server(store, root / "run2", ["tiny-nxdi"], env=_env(root)) as server:
        assert _generate(server, "tiny-nxdi") == first
    events = _events(root, 3)
    assert [e["event"] for e in events] == ["compile", "load", "load"]  # no second compile
    assert events[2]["directory"] == os.path.join(str((entries[0] / "artifacts").resolve()), "")


def test_two_workers_compile_once_on_disjoint_cores(tiny_checkpoint, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("nxdi-e2e-2w")
    store = build_store(root, tiny_checkpoint, [_spec("tiny-nxdi-2w", root, 2)])
    with running_server(store, root / "run", ["tiny-nxdi-2w"],
                        env=_env(root, compile_s=3.0)) as server:
        events = _events(root, 3)
        try:
            assert sorted(e["event"] for e in events) == ["compile", "load", "load"]
            loads = [e for e in events if e["event"] == "load"]
            assert sorted(tuple(e["visible_cores"]) for e in loads) == [(0, 1), (2, 3)]
            assert len({e["pid"] for e in loads}) == 2
            assert all(r for r in _generate(server, "tiny-nxdi-2w"))
        except AssertionError:
            print(logs(server.run_dir))
            raise
