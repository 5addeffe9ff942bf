"""Fixtures the Neuron backends' tests share: a fake SDK on sys.path for one test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

FAKES = Path(__file__).resolve().parents[1] / "fakes"
#: what the backends set in the process environment; each test gets them restored
NEURON_VARS = ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "NEURON_CC_FLAGS",
               "NEURON_COMPILE_CACHE_URL")
NXDI_VARS = NEURON_VARS + ("NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS",
                           "NEURON_RT_IO_RING_CACHE_SIZE", "XLA_HANDLE_SPECIAL_SCALAR",
                           "UNSAFE_FP8FNCAST")


def _fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: Path,
          env_vars: tuple[str, ...], packages: tuple[str, ...]) -> Iterator[Path]:
    """The fake at `where` on sys.path, its event log in tmp_path; the Neuron variables
    restored after, and its modules dropped so later tests cannot find it in sys.modules."""
    monkeypatch.syspath_prepend(str(where))
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("INF2SERVE_FAKE_NEURON_EVENTS", str(events))
    monkeypatch.setenv("INF2SERVE_FAKE_NEURON_DEVICE_DIR", str(tmp_path / "device"))
    for var in env_vars:
        monkeypatch.setenv(var, "")  # the backend sets them; monkeypatch restores them
    yield events
    for name in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[name]


@pytest.fixture
def fake_sdk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """transformers-neuronx's fake (backend neuron)."""
    yield from _fake(monkeypatch, tmp_path, FAKES, NEURON_VARS,
                     ("transformers_neuronx", "torch_neuronx"))


@pytest.fixture
def fake_nxdi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """NxD Inference's fake (backend nxdi)."""
    yield from _fake(monkeypatch, tmp_path, FAKES / "nxdi", NXDI_VARS,
                     ("neuronx_distributed_inference", "neuronx_distributed"))
