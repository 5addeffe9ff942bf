"""On a real Inf2 with NxD Inference (SDK 2.23-2.28): the tiny model compiles, caches, reloads
and generates the checkpoint's greedy tokens, a 1-token prompt and a joiner included."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from tests.unit.fakes import one_each

SPEC = importlib.util.find_spec("neuronx_distributed_inference")
HAS_NXDI = (Path("/dev/neuron0").exists() and SPEC is not None
            and "fakes" not in str(SPEC.origin))
pytestmark = [pytest.mark.neuron,
              pytest.mark.skipif(not HAS_NXDI, reason="needs /dev/neuron0 and the real "
                                 "neuronx-distributed-inference (an Inf2 instance, SDK 2.23-2.28)")]


def _greedy(checkpoint: Path, prompt: list[int], n: int) -> list[int]:
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(checkpoint)).float().eval()
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_compile_cache_reload_and_generate(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from handlers.backends.nxdi_backend import NxdiBackend

    cfg = parse_config({"handler": {
        "backend": "nxdi", "batch_size": 2, "max_length": 128, "max_new_tokens_limit": 64,
        "defaults": {"max_new_tokens": 16}, "dtype": "float32",
        "neuron": {"tp_degree": 2, "context_length_estimate": [16, 64],
                   "cache_dir": str(tmp_path / "cache"),
                   "core_lock_dir": str(tmp_path / "locks")}}}).handler
    first = NxdiBackend(tiny_checkpoint, cfg, tmp_path)
    assert first.start.compiled
    first.close()
    backend = NxdiBackend(tiny_checkpoint, cfg, tmp_path)
    assert not backend.start.compiled
    long, short = [1, 50, 60, 70, 80], [5]
    a = backend.prefill([1], [long], [SamplingParams()])
    a += one_each(backend.decode([1]))
    b = backend.prefill([0], [short], [SamplingParams()])
    for _ in range(6):
        x, y = one_each(backend.decode([1, 0]))
        a.append(x)
        b.append(y)
    backend.close()
    assert a == _greedy(tiny_checkpoint, long, 8)
    assert b == _greedy(tiny_checkpoint, short, 7)
