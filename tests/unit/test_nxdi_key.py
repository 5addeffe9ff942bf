"""The nxdi compile-cache key: every NeuronConfig input and every NxDI SDK version changes it."""

from __future__ import annotations

import pytest

from handlers.config import parse_config
from handlers.families import family_name, model_class_for
from neuron_cache.key import NXDI_SDK_DISTRIBUTIONS, SDK_DISTRIBUTIONS, key_inputs, sdk_versions

MODEL = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
         "rope_theta": 10000.0, "eos_token_id": 2, "torch_dtype": "float32"}
# tests/fakes/nxdi: Neuron SDK 2.28.1 (tests/fakes/README.md)
SDK = {"neuronx-cc": "2.23.6484.0", "libneuronxla": "2.2.15515.0",
       "torch-neuronx": "2.9.0.2.12.22436", "neuronx-distributed": "0.17.26814",
       "neuronx-distributed-inference": "0.8.16251"}


def _key(handler: dict | None = None, sdk: dict | None = None, model: dict | None = None):
    h = parse_config({"handler": {"backend": "nxdi", **(handler or {})}}).handler
    model = model or MODEL  # the class as the backend resolves it
    return key_inputs(h, model, sdk or SDK,
                      model_class=model_class_for("nxdi", model, h.nxdi.model_class),
                      family=family_name(model))


BASE = _key()


@pytest.mark.parametrize("handler", [
    {"batch_size": 8},
    {"max_length": 1024},
    {"neuron": {"tp_degree": 8}},
    {"dtype": "float16"},
    {"neuron": {"context_length_estimate": [128, 512]}},
    {"neuron": {"compiler_flags": ["--model-type=transformer", "-O1"]}},
    {"nxdi": {"token_generation_buckets": [512, 2048]}},
    {"nxdi": {"max_context_length": 1024}},
    {"neuron": {"on_device_sampling": True}},
    {"nxdi": {"fused_qkv": True}},
    {"nxdi": {"sequence_parallel_enabled": True}},
    {"nxdi": {"model_class": "models.mistral.modeling_mistral.NeuronMistralForCausalLM"}},
])
def test_key_changes_with_each_graph_setting(handler: dict) -> None:
    assert _key(handler).digest != BASE.digest


def test_global_topk_is_in_the_key_only_with_on_device_sampling() -> None:
    on = {"on_device_sampling": True}
    assert _key({"neuron": {**on, "global_top_k": 64}}).digest != _key({"neuron": on}).digest
    assert _key({"neuron": {"global_top_k": 64}}).digest == BASE.digest


@pytest.mark.parametrize("dist", NXDI_SDK_DISTRIBUTIONS)
def test_key_changes_with_each_sdk_version(dist: str) -> None:
    assert _key(sdk={**SDK, dist: "0.0.1"}).digest != BASE.digest


def test_key_changes_with_the_architecture() -> None:
    assert _key(model={**MODEL, "num_key_value_heads": 4}).digest != BASE.digest


def test_settings_of_the_other_backend_leave_it_alone() -> None:
    assert _key({"neuron": {"gqa": "shard-over-heads"}}).digest == BASE.digest
    neuron = key_inputs(parse_config({"handler": {"backend": "neuron"}}).handler, MODEL)
    assert set(neuron.sdk) == set(SDK_DISTRIBUTIONS)
    assert neuron.digest == key_inputs(parse_config({"handler": {
        "backend": "neuron", "nxdi": {"fused_qkv": True}}}).handler, MODEL).digest


def test_the_key_reads_the_installed_nxdi_stack() -> None:
    inputs = key_inputs(
        parse_config({"handler": {"backend": "nxdi"}}).handler, MODEL)
    assert set(inputs.sdk) == set(NXDI_SDK_DISTRIBUTIONS)
    assert inputs.sdk == sdk_versions(NXDI_SDK_DISTRIBUTIONS)
    assert inputs.model_class.startswith("nxdi:") and inputs.entry_name.startswith("nxdi-llama")
    assert inputs.neuron_config["ctx_batch_size"] == 1
    assert inputs.neuron_config["is_continuous_batching"] is True
