"""NeuronBackend with quantized weights / KV cache and on-device sampling, on the fake.

The fake (tests/fakes/transformers_neuronx) quantizes at load and samples per seq id as
transformers-neuronx does (tests/unit/test_neuron_quant_fake.py shows its rules).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from handlers.errors import ConfigError, RequestError
from tests.unit.fakes import one_each

PROMPTS = [[1, 50, 60, 70, 80], [1, 90, 100, 110, 120, 130, 140, 150]]
ON_DEVICE = {"on_device_sampling": True, "global_top_k": 64}
INT8 = {"quantization": {"weights": "int8"}}


@pytest.fixture
def checkpoint(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint  # tests/conftest.py: the demo model, built once per session



def _config(tmp_path: Path, batch_size: int = 2, **neuron):
    settings = {"tp_degree": 2, "cores_per_instance": 4, "cache_dir": str(tmp_path / "cache"),
                "core_lock_dir": str(tmp_path / "locks"), **neuron}
    return parse_config({"handler": {"backend": "neuron", "batching": "continuous",
                                     "batch_size": batch_size, "max_length": 128,
                                     "dtype": "float32", "max_new_tokens_limit": 64,
                                     "defaults": {"max_new_tokens": 16},
                                     "neuron": settings}}).handler


def _backend(checkpoint: Path, tmp_path: Path, batch_size: int = 2, **neuron):
    from handlers.backends.neuron_backend import NeuronBackend

    return NeuronBackend(checkpoint, _config(tmp_path, batch_size, **neuron), tmp_path)


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _run(backend, slots: list[int], prompts: list[list[int]], params: list[SamplingParams],
         n: int) -> list[list[int]]:
    """Prefill every slot, then n-1 decodes of all of them together."""
    rows = [[t] for t in backend.prefill(slots, prompts, params)]
    for _ in range(n - 1):
        for row, token in zip(rows, one_each(backend.decode(slots)), strict=True):
            row.append(token)
    backend.release(slots)
    return rows


def _count_updates(model, monkeypatch) -> list:
    calls: list = []
    original = model.update_generation_config

    def update(config):
        calls.append((list(config.top_k), list(config.top_p), list(config.temperature)))
        return original(config)

    monkeypatch.setattr(model, "update_generation_config", update)
    return calls


def test_on_device_greedy_equals_host_greedy(checkpoint, tmp_path, fake_sdk) -> None:
    """The device's token ids ([n, 1], base.py:L712-L713) for greedy requests (top_k 1) are
    the host's argmax, a joiner mid-decode included."""
    outs = []
    for name, neuron in (("host", {}), ("device", ON_DEVICE)):
        b = _backend(checkpoint, tmp_path / name, **neuron)
        a = b.prefill([0], [PROMPTS[0]], [SamplingParams()])
        a += one_each(b.decode([0]))
        c = b.prefill([1], [PROMPTS[1]], [SamplingParams()])
        for _ in range(5):
            x, y = one_each(b.decode([0, 1]))
            a.append(x)
            c.append(y)
        b.release([0, 1])
        outs.append((a, c))
        b.close()
    assert outs[0] == outs[1]


def test_parameters_go_per_slot_and_are_written_on_change(checkpoint, tmp_path, fake_sdk,
                                                          monkeypatch) -> None:
    """Each line samples with the parameters at its seq id (layers/generation.py:L107-L113):
    the backend keeps one (top_k, top_p, temperature) per slot and writes the lists only
    when a prefill changes its slot's (decoder.py:L1107-L1114); top_k 0 is global_top_k."""
    b = _backend(checkpoint, tmp_path, batch_size=3, **ON_DEVICE)
    updates = _count_updates(b.model, monkeypatch)
    hot = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)
    greedy = _run(b, [0], [PROMPTS[0]], [SamplingParams()], 3)
    assert updates == []  # every line starts greedy
    b.model.sampled.clear()
    rows = _run(b, [2, 0], [PROMPTS[1], PROMPTS[0]], [hot, SamplingParams()], 4)
    assert updates == [([1, 1, 3], [1.0, 1.0, 0.9], [1.0, 1.0, 0.7])]
    assert rows[1] == greedy[0] + rows[1][3:]  # slot 0 stayed greedy beside a sampled slot
    assert {s for s in b.model.sampled if s[0] == 2} == {(2, 3, 0.9, 0.7)}
    assert {s for s in b.model.sampled if s[0] == 0} == {(0, 1, 1.0, 1.0)}
    _run(b, [2], [PROMPTS[0]], [hot], 2)  # the slot holds these already: nothing written
    assert len(updates) == 1
    _run(b, [1], [PROMPTS[0]], [SamplingParams(temperature=1.0)], 2)  # top_k off: global
    assert updates[-1][0] == [1, 64, 3]
    b.close()


def test_on_device_capabilities_refuse_what_the_device_cannot_do(checkpoint, tmp_path,
                                                                 fake_sdk) -> None:
    """No seed input (hlo.py:L2422-L2456), no logits back (base.py:L712-L713): seeds,
    min_new_tokens, penalties and logprobs are refused naming the setting; top_k is bounded
    by global_top_k. The backend's capabilities are capabilities_for's."""
    from handlers.backends import capabilities_for
    from handlers.backends.capabilities import check_sampling

    b = _backend(checkpoint, tmp_path, **ON_DEVICE)
    caps = b.capabilities
    assert caps == capabilities_for(_config(tmp_path, **ON_DEVICE))
    assert capabilities_for(_config(tmp_path)) != caps  # host sampling: seeds and all
    refused = {"seed": SamplingParams(temperature=0.8, seed=3),
               "min_new_tokens": SamplingParams(min_new_tokens=2),
               "repetition_penalty": SamplingParams(repetition_penalty=1.2),
               "frequency_penalty": SamplingParams(frequency_penalty=0.5),
               "presence_penalty": SamplingParams(presence_penalty=0.5),
               "logprobs": SamplingParams(logprobs=1),
               "prompt_logprobs": SamplingParams(prompt_logprobs=1)}
    for field, params in refused.items():
        with pytest.raises(RequestError, match="handler.neuron.on_device_sampling") as err:
            check_sampling(params, caps)
        assert err.value.field == field
    with pytest.raises(RequestError, match="handler.neuron.global_top_k") as err:
        check_sampling(SamplingParams(temperature=1.0, top_k=65), caps)
    assert err.value.field == "top_k"
    check_sampling(SamplingParams(seed=3, ignore_eos=True), caps)  # greedy ignores a seed
    with pytest.raises(RequestError, match="seed"):  # checked again at the backend
        b.prefill([0], [PROMPTS[0]], [SamplingParams(temperature=0.8, seed=3)])
    b.close()


def test_int8_weights_differ_from_unquantized_by_rounding(checkpoint, tmp_path, fake_sdk) -> None:
    """Quantized at every load from the checkpoint as it is (decoder.py:L1581-L1683): the
    first token's log-probabilities are close to the unquantized model's, not equal."""
    got = []
    for name, neuron in (("plain", {}), ("int8", INT8)):
        b = _backend(checkpoint, tmp_path / name, **neuron)
        b.prefill([0], [PROMPTS[1]], [SamplingParams(logprobs=5)])
        got.append(b.token_logprobs(0))
        b.close()
    top, qtop = dict(got[0][1]), dict(got[1][1])
    common = sorted(set(top) & set(qtop))
    assert len(common) >= 4
    assert [qtop[t] for t in common] == pytest.approx([top[t] for t in common], abs=0.05)
    assert all(qtop[t] != top[t] for t in common)


def test_quantized_on_device_model_loads_from_the_cache(checkpoint, tmp_path, fake_sdk) -> None:
    """compile -> save -> a fresh backend loads the same entry and compiles nothing; weights
    are quantized again at that load (base.py:L95-L98), so it answers the same."""
    neuron = {**ON_DEVICE, "quantization": {"weights": "int8", "kv_cache": "fp8"}}
    first = _backend(checkpoint, tmp_path, **neuron)
    nc = first.model.neuron_config  # what build_neuron_config made of the settings
    assert (nc.quant.quant_dtype, nc.quant.dequant_dtype, nc.quant.quantize_method) == (
        "s8", "f32", "vector_dynamic")
    assert (nc.kv_cache_quant.quant_dtype, nc.kv_cache_quant.dequant_dtype) == ("f8e4m3fn", "f32")
    gen = nc.on_device_generation
    assert (gen.do_sample, gen.dynamic, gen.per_batch_line, gen.global_top_k) == (
        True, True, True, 64)
    assert (gen.top_k, gen.top_p, gen.temperature) == ([1, 1], [1.0, 1.0], [1.0, 1.0])
    want = _run(first, [0, 1], PROMPTS, [SamplingParams()] * 2, 6)
    first.close()
    second = _backend(checkpoint, tmp_path, **neuron)
    assert first.start.compiled and not second.start.compiled
    assert second.start.entry == first.start.entry
    assert [e["event"] for e in _events(fake_sdk)] == ["compile", "load"]
    # fp8 as NeuronCore-v2 runs it (handlers/backends/neuron_env.py)
    assert "fp8e4m3fn-as-fp8e4m3" in _events(fake_sdk)[1]["cc_flags"]
    assert _run(second, [0, 1], PROMPTS, [SamplingParams()] * 2, 6) == want
    second.close()


def test_features_change_the_cache_key(checkpoint, tmp_path, fake_sdk) -> None:
    """Each feature compiles other graphs, so each is its own cache entry."""
    variants = [{}, INT8, {"quantization": {"weights": "fp8"}},
                {"quantization": {"kv_cache": "int8"}}, ON_DEVICE,
                {"on_device_sampling": True, "global_top_k": 32}]
    entries = []
    for neuron in variants:
        b = _backend(checkpoint, tmp_path, **neuron)
        assert b.start.compiled
        entries.append(b.start.entry.path.name)
        b.close()
    assert len(set(entries)) == len(variants)
    assert [e["event"] for e in _events(fake_sdk)] == ["compile"] * len(variants)


def test_what_transformers_neuronx_would_fail_on_is_a_config_error(checkpoint, tmp_path,
                                                                   fake_sdk) -> None:
    """direct_cast weights fail at every load (quantize.py:L106-L110, torch reads 's8' as a
    device); 'self_attn' in no_quantize_list asserts (decoder.py:L1591-L1593); int8 ignores
    no_quantize_list (quantize.py:L71-L90). Refused before anything compiles."""
    cases = {"method: 'direct_cast'": {"weights": "int8", "method": "direct_cast"},
             "refuses 'self_attn'": {"weights": "fp8", "skip_modules": ["self_attn"]},
             "would change nothing": {"weights": "int8", "skip_modules": ["model.layers.0"]}}
    for message, quant in cases.items():
        with pytest.raises(ConfigError, match=message):
            _backend(checkpoint, tmp_path, quantization=quant)
    assert _events(fake_sdk) == []
    b = _backend(checkpoint, tmp_path, quantization={"weights": "fp8",
                                                     "skip_modules": ["model.layers.0"]})
    assert b.model.neuron_config.quant.no_quantize_list == ["model.layers.0"]
    b.close()
