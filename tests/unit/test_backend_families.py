"""Each family on each Neuron backend, through the fakes (which enforce the real rules):
greedy tokens equal transformers' in continuous batching with a request joining mid-decode,
the class the family names is the one built, and the compile-cache entry is keyed on both.

Tiny checkpoints are built with transformers itself (tests/family_checkpoints.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from handlers.errors import ConfigError
from tests.family_checkpoints import build_family_checkpoint, greedy_reference, has_family
from tests.unit.fakes import one_each

PROMPTS = [[1, 50, 60, 70, 80], [1, 90, 100, 110, 120, 130, 140, 150]]
#: the families each backend runs, and the SDK class each is built with
NEURON = {"mistral": "MistralForSampling", "mixtral": "MixtralForSampling"}
NXDI = {"qwen2": "NeuronQwen2ForCausalLM", "qwen3": "NeuronQwen3ForCausalLM",
        "mistral": "NeuronLlamaForCausalLM", "mixtral": "NeuronMixtralForCausalLM"}


def _handler(backend: str, tmp_path: Path, batching: str = "continuous", max_length: int = 128,
             nxdi: dict | None = None, **neuron):
    settings = {"tp_degree": 2, "cores_per_instance": 4,
                "cache_dir": str(tmp_path / "cache"), "core_lock_dir": str(tmp_path / "locks"),
                **neuron}
    handler = {"backend": backend, "batching": batching, "batch_size": 2,
               "max_length": max_length, "dtype": "float32",
               "max_new_tokens_limit": min(64, max_length // 2),
               "defaults": {"max_new_tokens": 16}, "neuron": settings}
    if backend == "nxdi":
        handler["nxdi"] = nxdi or {}
    return parse_config({"handler": handler}).handler


def _backend(backend: str, checkpoint: Path, tmp_path: Path, **kw):
    config = _handler(backend, tmp_path, **kw)
    if backend == "neuron":
        from handlers.backends.neuron_backend import NeuronBackend

        return NeuronBackend(checkpoint, config, tmp_path)
    from handlers.backends.nxdi_backend import NxdiBackend

    return NxdiBackend(checkpoint, config, tmp_path)


def _joined(b, n: int = 6) -> tuple[list[int], list[int]]:
    """Slot 0 alone for two tokens, then slot 1 joins and both decode together."""
    a = b.prefill([0], [PROMPTS[0]], [SamplingParams()])
    a += one_each(b.decode([0]))
    c = b.prefill([1], [PROMPTS[1]], [SamplingParams()])
    for _ in range(n - 1):
        x, y = one_each(b.decode([0, 1]))
        a.append(x)
        c.append(y)
    b.release([0, 1])
    return a, c


def _checkpoint(tmp_path: Path, family: str, tiny_checkpoint: Path, **overrides) -> Path:
    if not has_family(family):
        pytest.skip(f"this transformers has no {family} (NxD Inference 0.8 pins 4.57)")
    return build_family_checkpoint(tmp_path / family, family, tiny_checkpoint, **overrides)


@pytest.mark.parametrize("backend,family", [*(("neuron", f) for f in NEURON),
                                            *(("nxdi", f) for f in NXDI)])
def test_each_family_is_greedy_equal_to_transformers_with_a_join(
        backend, family, tmp_path, tiny_checkpoint, request) -> None:
    request.getfixturevalue("fake_sdk" if backend == "neuron" else "fake_nxdi")
    checkpoint = _checkpoint(tmp_path, family, tiny_checkpoint)
    b = _backend(backend, checkpoint, tmp_path)
    try:
        assert type(b.model).__name__ == (NEURON if backend == "neuron" else NXDI)[family]
        a, c = _joined(b)
    finally:
        b.close()
    assert a == greedy_reference(checkpoint, PROMPTS[0], 7)
    assert c == greedy_reference(checkpoint, PROMPTS[1], 6)
    entry = b.start.entry
    assert entry.name.startswith(f"{'nxdi-' if backend == 'nxdi' else ''}{family}-")


def test_mistral_micro_batches_through_its_own_sample(tmp_path, tiny_checkpoint,
                                                      fake_sdk) -> None:
    """MistralForSampling.sample takes no cache_ids and no **kwargs (mistral/model.py:
    L141-L142): the micro runner passes only what it takes."""
    checkpoint = _checkpoint(tmp_path, "mistral", tiny_checkpoint)
    b = _backend("neuron", checkpoint, tmp_path, batching="micro")
    try:
        first = b.prefill([0, 1], PROMPTS, [SamplingParams()] * 2)
        rows = [[t] for t in first]
        for _ in range(4):
            for row, t in zip(rows, one_each(b.decode([0, 1])), strict=True):
                row.append(t)
        b.release([0, 1])
    finally:
        b.close()
    # left-padded to the longer prompt, each row as it would run alone
    assert rows[1] == greedy_reference(checkpoint, PROMPTS[1], 5)


@pytest.mark.parametrize("backend", ["neuron", "nxdi"])
def test_a_mistral_window_within_max_length_is_honoured(backend, tmp_path, tiny_checkpoint,
                                                        request) -> None:
    """Mistral v0.1 attends to the last 4096 positions. transformers-neuronx honours the
    window in decode (hlo.py:L3980-L4010) and prefills within it; NxD Inference 0.8's Llama
    class reads it (modeling_llama.py:L1010). Here a window of 12 binds after a few tokens:
    both backends give transformers' windowed tokens."""
    request.getfixturevalue("fake_sdk" if backend == "neuron" else "fake_nxdi")
    checkpoint = _checkpoint(tmp_path, "mistral", tiny_checkpoint, sliding_window=12)
    kw = {"context_length_estimate": [8, 12]} if backend == "neuron" else {}
    b = _backend(backend, checkpoint, tmp_path, **kw)
    try:
        a, c = _joined(b, n=14)
    finally:
        b.close()
    assert a == greedy_reference(checkpoint, PROMPTS[0], 15)
    assert c == greedy_reference(checkpoint, PROMPTS[1], 14)
    full = build_family_checkpoint(tmp_path / "full", "mistral", tiny_checkpoint)
    assert greedy_reference(full, PROMPTS[1], 14) != c  # the window changed the answer


def test_qwen_on_neuron_is_refused_in_one_line_naming_nxdi(tmp_path, tiny_checkpoint,
                                                           fake_sdk) -> None:
    checkpoint = _checkpoint(tmp_path, "qwen2", tiny_checkpoint)
    with pytest.raises(ConfigError, match=r"no Qwen2 model .*use handler.backend: nxdi"):
        _backend("neuron", checkpoint, tmp_path)


def test_the_key_names_the_family_and_its_class(tmp_path, tiny_checkpoint, fake_nxdi) -> None:
    from neuron_cache.key import KeyInputs

    checkpoint = _checkpoint(tmp_path, "mistral", tiny_checkpoint)
    b = _backend("nxdi", checkpoint, tmp_path)
    b.close()
    inputs = KeyInputs.from_dict(b.start.entry.inputs.to_dict())
    assert inputs.family == "mistral"
    assert inputs.model_class == "nxdi:models.llama.modeling_llama.NeuronLlamaForCausalLM"
    assert b.start.entry.inputs.to_dict()["family"] == "mistral"


def test_qwen2_speculation_with_a_same_family_draft(tmp_path, tiny_checkpoint,
                                                    fake_nxdi) -> None:
    """Fused speculation builds the draft with the model's class (inference_demo.py:
    L500-L532): a smaller Qwen2 drafts for a Qwen2 (as Qwen2.5-0.5B for Qwen2.5-7B), and
    greedy output is the model's own."""
    checkpoint = _checkpoint(tmp_path, "qwen2", tiny_checkpoint)
    model_dir = tmp_path
    build_family_checkpoint(model_dir / "draft", "qwen2", tiny_checkpoint, seed=1,
                            num_hidden_layers=1)
    b = _backend("nxdi", checkpoint, model_dir, on_device_sampling=True,
                 speculation={"draft_checkpoint": "draft", "length": 3})
    try:
        out = b.prefill([0], [PROMPTS[0]], [SamplingParams()])
        while len(out) < 8:
            out += b.decode([0])[0]
        b.release([0])
    finally:
        b.close()
    assert out[:8] == greedy_reference(checkpoint, PROMPTS[0], 8)


def test_an_nxdi_before_0_7_would_ignore_a_mistral_window(tmp_path, tiny_checkpoint, fake_nxdi,
                                                          monkeypatch) -> None:
    """NxD Inference's Llama class reads sliding_window from 0.7 (SDK 2.27) on: on an older
    one the backend refuses a window within max_length rather than run full attention."""
    from handlers.backends import nxdi_families

    checkpoint = _checkpoint(tmp_path, "mistral", tiny_checkpoint, sliding_window=64)
    monkeypatch.setattr(nxdi_families, "installed_version", lambda: (0, 6, 10598))
    with pytest.raises(ConfigError, match=r"NxD Inference 0.6.10598's Llama class reads no "
                                          r"sliding_window .*max_length <= 64"):
        _backend("nxdi", checkpoint, tmp_path)
    b = _backend("nxdi", checkpoint, tmp_path, max_length=64)  # the window never binds
    b.close()
