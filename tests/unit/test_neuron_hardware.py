"""On a real Inf2 with the Neuron SDK: the tiny model compiles, caches, reloads and generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from handlers.backends.base import SamplingParams
from handlers.config import parse_config

HAS_NEURON = (Path("/dev/neuron0").exists()
              and importlib.util.find_spec("transformers_neuronx") is not None
              and "fakes" not in str(importlib.util.find_spec("transformers_neuronx").origin))
pytestmark = [pytest.mark.neuron,
              pytest.mark.skipif(not HAS_NEURON, reason="needs /dev/neuron0 and the real "
                                 "transformers-neuronx (an Inf2 instance with the Neuron SDK)")]


def test_compile_cache_reload_and_generate(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from handlers.backends.neuron_backend import NeuronBackend
    from handlers.backends.torch_backend import TorchBackend

    cfg = parse_config({"handler": {
        "backend": "neuron", "batch_size": 2, "max_length": 128, "max_new_tokens_limit": 64,
        "defaults": {"max_new_tokens": 16},
        "neuron": {"tp_degree": 2, "amp": "f32", "cache_dir": str(tmp_path / "cache"),
                   "core_lock_dir": str(tmp_path / "locks")}}}).handler
    prompt = [1, 50, 60, 70, 80]
    first = NeuronBackend(tiny_checkpoint, cfg, tmp_path)
    assert first.start.compiled
    first.close()
    backend = NeuronBackend(tiny_checkpoint, cfg, tmp_path)
    assert not backend.start.compiled
    tokens = backend.prefill([0], [prompt], [SamplingParams()])
    tokens += [backend.decode([0])[0] for _ in range(7)]
    backend.close()

    ref = TorchBackend(tiny_checkpoint, parse_config({"handler": {
        "batch_size": 1, "max_length": 128, "max_new_tokens_limit": 64}}).handler)
    expected = ref.prefill([0], [prompt], [SamplingParams()])
    expected += [ref.decode([0])[0] for _ in range(7)]
    assert tokens == expected
