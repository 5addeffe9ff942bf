"""On a real Inf2 with the Neuron SDK: the tiny model compiles, caches, reloads and generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from tests.unit.fakes import one_each

HAS_NEURON = (Path("/dev/neuron0").exists()
              and importlib.util.find_spec("transformers_neuronx") is not None
              and "fakes" not in str(importlib.util.find_spec("transformers_neuronx").origin))
pytestmark = [pytest.mark.neuron,
              pytest.mark.skipif(not HAS_NEURON, reason="needs /dev/neuron0 and the real "
                                 "transformers-neuronx (an Inf2 instance with the Neuron SDK)")]


def test_compile_cache_reload_and_generate(tiny_checkpoint: Path, tmp_path: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from handlers.backends.neuron_backend import NeuronBackend

    cfg = parse_config({"handler": {
        "backend": "neuron", "batch_size": 2, "max_length": 128, "max_new_tokens_limit": 64,
        "defaults": {"max_new_tokens": 16}, "dtype": "float32",
        "neuron": {"tp_degree": 2, "cache_dir": str(tmp_path / "cache"),
                   "core_lock_dir": str(tmp_path / "locks")}}}).handler
    prompt = [1, 50, 60, 70, 80]
    first = NeuronBackend(tiny_checkpoint, cfg, tmp_path)
    assert first.start.compiled
    first.close()
    backend = NeuronBackend(tiny_checkpoint, cfg, tmp_path)
    assert not backend.start.compiled
    tokens = backend.prefill([0], [prompt], [SamplingParams()])
    tokens += [one_each(backend.decode([0]))[0] for _ in range(7)]
    backend.close()

    # the SDK's transformers 4.x has no torch backend: greedy by plain transformers, no EOS stop
    hf = LlamaForCausalLM.from_pretrained(str(tiny_checkpoint)).float().eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(8):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert tokens == ids[len(prompt):]
