"""NxdiBackend with quantized weights, an fp8 KV cache and async mode, on the NxD Inference fake.

The quantized checkpoint is written once, before the first compile, into the cache entry
(published and checksummed with the compiled graphs); a start from the cache reads it
there and neither compiles nor quantizes. Async mode with on-device sampling answers the
tokens host sampling does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from handlers.errors import CacheError, ConfigError
from neuron_cache.key import key_inputs, read_model_config
from tests.unit.fakes import one_each
from tests.unit.test_nxdi_backend import (
    PROMPTS,
    _backend,
    _config,
    _events,
    _greedy,
    _reference,
)

INT8 = {"quantization": {"weights": "int8"}}



def _entry_checkpoint(backend) -> Path:
    return backend.start.entry.artifacts / "quantized" / "v1"


def test_quantized_compiles_saves_and_loads_from_the_cache_without_requantizing(
        tiny_checkpoint, tmp_path, fake_nxdi) -> None:
    from neuron_cache.store import verify

    b = _backend(tiny_checkpoint, tmp_path, **INT8)
    assert b.start.compiled
    first = _greedy(b, 0, PROMPTS[0], 6)
    entry = b.start.entry
    saved = _entry_checkpoint(b)
    assert sorted(p.name for p in saved.iterdir()) == ["model.safetensors"]
    assert "artifacts/quantized/v1/model.safetensors" in entry.metadata["files"]
    assert verify(entry) == []
    compiled = json.loads((entry.artifacts / "neuron_config.json").read_text())["neuron_config"]
    assert compiled["quantized"] and compiled["quantized_checkpoints_path"] == str(saved)
    assert b.model.neuron_config.quantized_checkpoints_path == str(saved)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp-")]
    b.close()
    events = _events(fake_nxdi)
    assert [e["event"] for e in events] == ["quantize", "compile", "load"]
    assert events[2]["quantized_checkpoint"] != str(saved)  # the staged copy, moved since

    b = _backend(tiny_checkpoint, tmp_path, **INT8)
    assert not b.start.compiled and b.start.entry.name == entry.name
    assert _greedy(b, 0, PROMPTS[0], 6) == first
    b.close()
    events = _events(fake_nxdi)
    assert [e["event"] for e in events] == ["quantize", "compile", "load", "load"]
    assert events[3]["quantized_checkpoint"] == str(saved)


def test_a_damaged_quantized_checkpoint_is_not_loaded(tiny_checkpoint, tmp_path,
                                                      fake_nxdi) -> None:
    b = _backend(tiny_checkpoint, tmp_path, **INT8)
    path = _entry_checkpoint(b) / "model.safetensors"
    b.close()
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(CacheError, match="quantized/v1/model.safetensors"):
        _backend(tiny_checkpoint, tmp_path, **INT8)


def test_the_quantized_checkpoint_is_written_under_a_temporary_name_then_renamed(
        tiny_checkpoint, tmp_path, fake_nxdi, monkeypatch) -> None:
    from neuronx_distributed_inference.models.llama.modeling_llama import NeuronLlamaForCausalLM

    real = NeuronLlamaForCausalLM.save_quantized_state_dict.__func__
    seen = []

    def watch(cls, model_path, config):
        target = Path(config.neuron_config.quantized_checkpoints_path)
        seen.append(target)
        assert target.is_dir() and target.name.startswith(".tmp-v1.")  # a directory: safetensors
        assert not (target.parent / "v1").exists()
        real(cls, model_path, config)

    monkeypatch.setattr(NeuronLlamaForCausalLM, "save_quantized_state_dict", classmethod(watch))
    b = _backend(tiny_checkpoint, tmp_path, **INT8)
    assert len(seen) == 1 and not seen[0].exists() and _entry_checkpoint(b).is_dir()
    b.close()

    def crash(cls, model_path, config):  # a half-written checkpoint, then the process fails
        path = Path(config.neuron_config.quantized_checkpoints_path) / "model.safetensors"
        path.write_bytes(b"partial")
        raise MemoryError("host out of memory")

    monkeypatch.setattr(NeuronLlamaForCausalLM, "save_quantized_state_dict", classmethod(crash))
    with pytest.raises(MemoryError):
        _backend(tiny_checkpoint, tmp_path, quantization={"weights": "fp8"})
    cache = tmp_path / "cache"
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
    assert [p.name for p in cache.iterdir() if (p / "metadata.json").exists()] == [
        b.start.entry.name]  # only the int8 entry


def test_cache_entry_names_differ_with_quantization(tiny_checkpoint, tmp_path) -> None:
    from handlers.backends.nxdi_backend import quantized_key

    model = read_model_config(tiny_checkpoint)
    names = set()
    for q in [{}, {"weights": "int8"}, {"weights": "fp8"},
              {"weights": "int8", "method": "per_tensor"},
              {"weights": "int8", "skip_modules": ["lm_head"]}, {"kv_cache": "fp8"},
              {"weights": "int8", "kv_cache": "fp8"}]:
        inputs = quantized_key(key_inputs(_config(tmp_path, quantization=q), model),
                               tiny_checkpoint)
        names.add(inputs.entry_name)
        assert inputs.entry_name.startswith("nxdi-llama-l2-h64-tp2-b2-n128-f32-cb-")
    assert len(names) == 7


def test_quantized_keys_name_the_weights_they_were_made_from(tiny_checkpoint, tmp_path) -> None:
    """Two fine-tunes share config.json; a shared cache must not serve one's int8 weights
    for the other's. Unquantized entries hold no weights, so their key stays."""
    from safetensors.torch import load_file, save_file

    from handlers.backends.nxdi_backend import quantized_key

    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other)
    sd = load_file(other / "model.safetensors")
    sd["model.norm.weight"] = sd["model.norm.weight"] * 1.01
    save_file(sd, other / "model.safetensors", metadata={"format": "pt"})
    model = read_model_config(tiny_checkpoint)
    for q, differ in [({}, False), ({"weights": "int8"}, True)]:
        cfg = _config(tmp_path, quantization=q)
        a, b = (quantized_key(key_inputs(cfg, model), c) for c in (tiny_checkpoint, other))
        assert (a.digest != b.digest) is differ


def test_per_tensor_with_skipped_modules_is_refused(tiny_checkpoint, tmp_path,
                                                    fake_nxdi) -> None:
    with pytest.raises(ConfigError, match="skip_modules: NxD Inference's per-tensor"):
        _backend(tiny_checkpoint, tmp_path, quantization={
            "weights": "int8", "method": "per_tensor", "skip_modules": ["lm_head"]})


def test_per_channel_skips_modules_and_fp8_weights_set_the_fp8_environment(
        tiny_checkpoint, tmp_path, fake_nxdi) -> None:
    import torch
    from safetensors.torch import load_file

    b = _backend(tiny_checkpoint, tmp_path,
                 quantization={"weights": "fp8", "skip_modules": ["lm_head"]})
    sd = load_file(_entry_checkpoint(b) / "model.safetensors")
    assert sd["layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert sd["lm_head.weight"].dtype == torch.float32
    assert os.environ["XLA_HANDLE_SPECIAL_SCALAR"] == "1"
    assert len(_greedy(b, 0, PROMPTS[1], 4)) == 4
    b.close()


def test_fp8_kv_cache_on_0_8_passes_kv_quant_config(tiny_checkpoint, tmp_path,
                                                    fake_nxdi) -> None:
    import torch

    b = _backend(tiny_checkpoint, tmp_path, quantization={"kv_cache": "fp8"})
    nc = b.model.neuron_config
    assert nc.kv_cache_quant and nc.kv_quant_config.quant_dtype == torch.float8_e4m3fn
    assert nc.kv_quant_config.direct_cast
    assert [e["kv_cache_dtype"] for e in _events(fake_nxdi) if e["event"] == "load"] == [
        "float8_e4m3fn"]
    assert len(_greedy(b, 0, PROMPTS[0], 4)) == 4
    b.close()


def test_fp8_kv_cache_on_0_7_relies_on_kv_cache_quant(tiny_checkpoint, tmp_path, fake_nxdi,
                                                      monkeypatch, caplog) -> None:
    """Up to 0.7 NeuronConfig has no kv_quant_config: it logs and drops it, and
    kv_cache_quant alone makes the cache fp8 (facts: kv_cache_manager.py at 2.27)."""
    from neuronx_distributed_inference.models.config import NeuronConfig

    real = NeuronConfig.__init__

    def init_0_7(self, **kwargs):
        dropped = kwargs.pop("kv_quant_config", None)
        real(self, **kwargs)
        if dropped is not None:
            logging.warning(f"NeuronConfig init: Unexpected keyword arguments: "
                            f"{{'kv_quant_config': {dropped}}}")

    monkeypatch.setattr(NeuronConfig, "__init__", init_0_7)
    with caplog.at_level(logging.INFO):
        b = _backend(tiny_checkpoint, tmp_path, quantization={"kv_cache": "fp8"})
    assert b.model.neuron_config.kv_cache_quant and b.model.neuron_config.kv_quant_config is None
    assert "kv_cache_quant alone makes the KV cache fp8" in caplog.text
    b.close()


def test_async_on_device_greedy_answers_what_host_sampling_does(tiny_checkpoint, tmp_path,
                                                                fake_nxdi) -> None:
    """Joins and leaves with async mode and on-device sampling: each sequence keeps the
    checkpoint's greedy tokens, as host sampling gives them."""
    def run(b) -> list[list[int]]:
        a = b.prefill([2], [PROMPTS[0]], [SamplingParams()])
        a += one_each(b.decode([2]))
        c = b.prefill([0], [PROMPTS[1]], [SamplingParams()])
        d = b.prefill([1], [[5]], [SamplingParams()])
        for _ in range(4):
            x, y, z = one_each(b.decode([2, 0, 1]))
            a.append(x)
            c.append(y)
            d.append(z)
        b.release([0])
        for _ in range(4):
            x, z = one_each(b.decode([1, 2]))[::-1]
            a.append(x)
            d.append(z)
        for s in (1, 2):
            b.release([s])
        return [a, c, d]

    host = _backend(tiny_checkpoint, tmp_path / "host", batch_size=3)
    want = run(host)
    host.close()
    b = _backend(tiny_checkpoint, tmp_path / "async", batch_size=3, on_device_sampling=True,
                 nxdi={"async_mode": True})
    assert b.model.neuron_config.async_mode
    assert os.environ["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "2"
    assert run(b) == want
    assert want[0] == _reference(tiny_checkpoint, PROMPTS[0], 10)
    b.warmup()
    b.close()
    loads = [e for e in _events(fake_nxdi) if e["event"] == "load"]
    assert [e["warmup_call"] for e in loads] == ["forward", "forward_async"]


def test_async_mode_alone_is_refused_by_the_config(tmp_path) -> None:
    with pytest.raises(ConfigError, match="async_mode: needs handler.neuron.on_device_sampling"):
        parse_config({"handler": {"backend": "nxdi", "nxdi": {"async_mode": True}}})


def test_the_staging_dir_stays_fresh_through_a_long_compile(tmp_path) -> None:
    """`inf2serve cache prune` removes `.tmp-*` idle for an hour; a compile can take longer."""
    import time

    from handlers.backends.nxdi_backend import _kept_fresh

    os.utime(tmp_path, (0, 0))
    with _kept_fresh(tmp_path, every_s=0.01):
        deadline = time.monotonic() + 5
        while tmp_path.stat().st_mtime == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert tmp_path.stat().st_mtime > 0
