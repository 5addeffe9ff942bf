"""NeuronBackend on the transformers-neuronx fake: torch-identical tokens, cached starts."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from handlers.errors import ConfigError, NeuronUnavailableError, RequestError

FAKES = Path(__file__).resolve().parents[1] / "fakes"
RT_VARS = ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "NEURON_CC_FLAGS",
           "NEURON_COMPILE_CACHE_URL")
FAKE_PACKAGES = ("transformers_neuronx", "torch_neuronx")
PROMPTS = [[1, 50, 60, 70, 80], [1, 90, 100, 110, 120, 130, 140, 150]]


@pytest.fixture
def checkpoint(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint  # tests/conftest.py: the demo model, built once per session


@pytest.fixture
def fake_sdk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The fake on sys.path, its event log in tmp_path; the Neuron variables restored after."""
    monkeypatch.syspath_prepend(str(FAKES))
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("INF2SERVE_FAKE_NEURON_EVENTS", str(events))
    monkeypatch.setenv("INF2SERVE_FAKE_NEURON_DEVICE_DIR", str(tmp_path / "device"))
    for var in RT_VARS:
        monkeypatch.setenv(var, "")  # the backend sets them; monkeypatch restores them
    yield events
    for name in [m for m in sys.modules if m.split(".")[0] in FAKE_PACKAGES]:
        del sys.modules[name]  # later tests must not find the fake through sys.modules


def _config(tmp_path: Path, batching: str = "continuous", **neuron):
    settings = {"tp_degree": 2, "cores_per_instance": 4, "amp": "f32",
                "cache_dir": str(tmp_path / "cache"), "core_lock_dir": str(tmp_path / "locks"),
                **neuron}
    return parse_config({"handler": {"backend": "neuron", "batching": batching, "batch_size": 2,
                                     "max_length": 128, "max_new_tokens_limit": 64,
                                     "defaults": {"max_new_tokens": 16},
                                     "neuron": settings}}).handler


def _backend(checkpoint: Path, tmp_path: Path, batching: str = "continuous", **neuron):
    from handlers.backends.neuron_backend import NeuronBackend

    return NeuronBackend(checkpoint, _config(tmp_path, batching, **neuron), tmp_path)


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _torch_reference(checkpoint: Path, prompt: list[int], n: int) -> list[int]:
    from handlers.backends.torch_backend import TorchBackend

    cfg = parse_config({"handler": {"batch_size": 1, "max_length": 128,
                                    "max_new_tokens_limit": 64}}).handler
    ref = TorchBackend(checkpoint, cfg)
    out = ref.prefill([0], [prompt], [SamplingParams()])
    out += [ref.decode([0])[0] for _ in range(n - 1)]
    return out


def test_continuous_matches_torch_and_admits_mid_decode(checkpoint, tmp_path, fake_sdk) -> None:
    b = _backend(checkpoint, tmp_path)
    assert b.start.compiled and b.eos_token_ids == frozenset({2})
    a = b.prefill([0], [PROMPTS[0]], [SamplingParams()])
    a += b.decode([0])
    c = b.prefill([1], [PROMPTS[1]], [SamplingParams()])  # joins while slot 0 runs
    for _ in range(5):
        x, y = b.decode([0, 1])
        a.append(x)
        c.append(y)
    assert a == _torch_reference(checkpoint, PROMPTS[0], 7)
    assert c == _torch_reference(checkpoint, PROMPTS[1], 6)
    b.release([0, 1])
    b.close()


def test_micro_streams_through_sample(checkpoint, tmp_path, fake_sdk) -> None:
    b = _backend(checkpoint, tmp_path, "micro")
    b.warmup()
    first = b.prefill([0, 1], PROMPTS, [SamplingParams(), SamplingParams()])
    rows = [[first[0]], [first[1]]]
    for _ in range(4):
        x, y = b.decode([0, 1])
        rows[0].append(x)
        rows[1].append(y)
    b.release([0])
    rows[1].append(b.decode([1])[0])
    b.release([1])  # the last slot: stops the sample() thread
    assert rows[0] == _torch_reference(checkpoint, PROMPTS[0], 5)
    assert rows[1] == _torch_reference(checkpoint, PROMPTS[1], 6)
    assert b.prefill([0], [PROMPTS[0]], [SamplingParams()]) == rows[0][:1]  # next batch
    b.close()


def test_second_start_loads_from_cache_and_frees_cores(checkpoint, tmp_path, fake_sdk) -> None:
    first = _backend(checkpoint, tmp_path)
    first.close()
    second = _backend(checkpoint, tmp_path)
    assert not second.start.compiled and second.start.entry == first.start.entry
    assert [e["event"] for e in _events(fake_sdk)] == ["compile", "load"]
    assert [e["visible_cores"] for e in _events(fake_sdk)] == [[0, 1], [0, 1]]
    second.warmup()
    second.close()


def test_two_workers_get_disjoint_cores(checkpoint, tmp_path, fake_sdk) -> None:
    import os

    one = _backend(checkpoint, tmp_path)
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "0-1"
    two = _backend(checkpoint, tmp_path)
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "2-3"
    with pytest.raises(ConfigError, match="at most 2 worker"):
        _backend(checkpoint, tmp_path)
    one.close()
    two.close()


def test_seeded_sampling_is_reproducible_per_request(checkpoint, tmp_path, fake_sdk) -> None:
    b = _backend(checkpoint, tmp_path)
    p = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7)

    def run(slot: int) -> list[int]:
        out = b.prefill([slot], [PROMPTS[0]], [p])
        out += [b.decode([slot])[0] for _ in range(6)]
        b.release([slot])
        return out

    assert run(0) == run(1)
    b.close()


def test_prompt_limits(checkpoint, tmp_path, fake_sdk) -> None:
    b = _backend(checkpoint, tmp_path, context_length_estimate=[16, 32])
    with pytest.raises(RequestError, match="largest prefill bucket 32"):
        b.prefill([0], [[1] * 40], [SamplingParams()])
    with pytest.raises(RequestError, match="expected 1 to 127"):
        b.prefill([0], [[1] * 128], [SamplingParams()])
    b.close()


def test_missing_sdk_names_the_install(checkpoint, tmp_path, fake_sdk, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers_neuronx", None)
    with pytest.raises(NeuronUnavailableError, match="pip.repos.neuron.amazonaws.com"):
        _backend(checkpoint, tmp_path)
    monkeypatch.delitem(sys.modules, "transformers_neuronx")
    _backend(checkpoint, tmp_path).close()  # the failed start released its cores


def test_unknown_model_class(checkpoint, tmp_path, fake_sdk) -> None:
    with pytest.raises(ConfigError, match="model_class_name"):
        _backend(checkpoint, tmp_path, model_class_name="llama.model.LlamaForSamplin")
