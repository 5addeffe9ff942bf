"""The compile-cache key changes with every input that changes the NEFFs, and only those."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from handlers.config import parse_config
from handlers.families import family_name, model_class_for
from neuron_cache.key import (
    SDK_DISTRIBUTIONS,
    KeyInputs,
    differences,
    graph_config,
    is_build_mismatch,
    key_inputs,
    sdk_versions,
)

FAKES = Path(__file__).resolve().parents[1] / "fakes"
MODEL = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
         "intermediate_size": 172, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
         "torch_dtype": "float32", "architectures": ["LlamaForCausalLM"],
         "transformers_version": "5.23.0", "_name_or_path": "/tmp/x"}
# the fake install under tests/fakes: Neuron SDK 2.21.0 (see tests/fakes/README.md)
SDK = {"neuronx-cc": "2.16.345.0", "libneuronxla": "2.1.681.0",
       "transformers-neuronx": "0.13.322", "torch-neuronx": "2.1.2.2.4.0"}


def _key(handler: dict | None = None, model: dict | None = None, sdk: dict | None = None,
         draft: dict | None = None):
    """The key as the backends compute it: the class and family from the checkpoint."""
    cfg = parse_config({"handler": {"backend": "neuron", **(handler or {})}}).handler
    model = model or MODEL
    setting = cfg.nxdi.model_class if cfg.backend == "nxdi" else cfg.neuron.model_class_name
    return key_inputs(cfg, model, sdk or SDK, draft_model_config=draft,
                      model_class=model_class_for(cfg.backend, model, setting),
                      family=family_name(model))


BASE = _key()


@pytest.mark.parametrize("handler", [
    {"batch_size": 8},
    {"max_length": 1024},
    {"batching": "micro"},
    {"neuron": {"tp_degree": 4}},
    {"dtype": "float16"},
    {"neuron": {"context_length_estimate": [128, 512]}},
    {"neuron": {"gqa": "shard-over-heads"}},
    {"neuron": {"compiler_flags": ["--model-type=transformer", "-O1"]}},
    {"neuron": {"model_class_name": "mistral.model.MistralForSampling"}},
])
def test_key_changes_with_each_compile_setting(handler: dict) -> None:
    assert _key(handler).digest != BASE.digest


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 3), ("hidden_size", 128),
                                         ("num_key_value_heads", 4), ("vocab_size", 2048),
                                         ("rope_theta", 500000.0)])
def test_key_changes_with_the_architecture(field: str, value: object) -> None:
    assert _key(model={**MODEL, field: value}).digest != BASE.digest


def test_the_key_covers_every_package_that_changes_the_neffs() -> None:
    # HLO: transformers-neuronx + torch-neuronx's pyhlo; compile: libneuronxla + neuronx-cc
    assert set(SDK_DISTRIBUTIONS) == {"neuronx-cc", "libneuronxla", "transformers-neuronx",
                                      "torch-neuronx"}
    assert set(BASE.sdk) == set(SDK_DISTRIBUTIONS)


@pytest.mark.parametrize("dist", SDK_DISTRIBUTIONS)
def test_key_changes_with_each_sdk_version(dist: str) -> None:
    other = _key(sdk={**SDK, dist: "9.9.9"})
    assert other.digest != BASE.digest
    assert is_build_mismatch(BASE, other)
    assert list(differences(BASE, other)) == [f"sdk.{dist}"]


@pytest.mark.parametrize("field,value", [("eos_token_id", 7), ("bos_token_id", 9),
                                         ("pad_token_id", 3), ("torch_dtype", "bfloat16"),
                                         ("transformers_version", "4.0"),
                                         ("architectures", ["X"]), ("_name_or_path", "/y")])
def test_key_ignores_fields_that_do_not_change_the_graph(field: str, value: object) -> None:
    assert _key(model={**MODEL, field: value}).digest == BASE.digest


def test_shape_change_is_not_a_build_mismatch() -> None:
    assert not is_build_mismatch(BASE, _key({"batch_size": 8}))
    assert is_build_mismatch(BASE, _key({"neuron": {"compiler_flags": ["-O1"]}}))


def test_entry_name_is_readable_and_round_trips() -> None:
    assert BASE.entry_name.startswith("llama-l2-h64-tp2-b4-n2048-bf16-cb-")
    assert KeyInputs.from_dict(BASE.to_dict()) == BASE
    assert "eos_token_id" not in graph_config(MODEL)


@pytest.mark.parametrize("backend", ["neuron", "nxdi"])
@pytest.mark.parametrize("amp,dtype", [("bf16", "bfloat16"), ("f16", "float16"),
                                       ("f32", "float32")])
def test_dtype_keys_as_the_legacy_amp_did(backend: str, amp: str, dtype: str) -> None:
    """handler.dtype replaced handler.neuron.amp: the key still records the Neuron spelling,
    byte for byte, so caches compiled under either key stay valid."""
    new = _key({"backend": backend, "dtype": dtype})
    with pytest.warns(DeprecationWarning):
        old = _key({"backend": backend, "neuron": {"amp": amp}})
    assert new.to_dict() == old.to_dict() and new.digest == old.digest
    assert new.amp == amp and f"-{amp}-cb-" in new.entry_name
    if dtype == "bfloat16":  # the default of both Neuron backends
        assert _key({"backend": backend}).digest == new.digest


def test_empty_buckets_mean_one_bucket_of_max_length() -> None:
    assert BASE.context_length_estimate == [2048]
    assert dataclasses.replace(BASE).digest == BASE.digest


def test_sdk_versions_absent_without_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if "fakes" not in p])
    assert set(sdk_versions().values()) == {"absent"}


def test_sdk_versions_read_installed_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FAKES))  # the fake ships *.dist-info like a real install
    assert sdk_versions() == SDK


def test_an_entry_from_before_libneuronxla_was_keyed_is_a_build_mismatch() -> None:
    old = _key(sdk={k: v for k, v in SDK.items() if k != "libneuronxla"})
    assert is_build_mismatch(BASE, old)
    assert differences(BASE, old) == {"sdk.libneuronxla": ("2.1.681.0", "absent")}


def test_speculation_keys_the_draft_and_leaves_other_keys_alone():
    from functools import partial

    from neuron_cache.key import key_inputs as key

    key_inputs = partial(key, model_class="llama.model.LlamaForSampling")
    base = {"backend": "neuron", "neuron": {"on_device_sampling": True}}
    plain = parse_config({"handler": base}).handler
    spec = parse_config({"handler": {**base, "neuron": {
        **base["neuron"], "speculation": {"draft_checkpoint": "draft", "length": 4}}}}).handler
    model = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}
    draft = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1}
    sdk = {"transformers-neuronx": "0.13"}
    assert "speculation" not in key_inputs(plain, model, sdk).neuron_config
    a = key_inputs(spec, model, sdk, draft_model_config=draft)
    b = key_inputs(spec, model, sdk, draft_model_config={**draft, "num_hidden_layers": 2})
    assert a.neuron_config["speculation"]["length"] == 4 and a.digest != b.digest
    assert a.digest != key_inputs(plain, model, sdk).digest
    with pytest.raises(ValueError, match="draft_model_config"):
        key_inputs(spec, model, sdk)


NXDI_SDK = {"neuronx-cc": "2.23.6484.0", "libneuronxla": "2.2.15515.0",
            "torch-neuronx": "2.9.0.2.12.22436", "neuronx-distributed": "0.17.26814",
            "neuronx-distributed-inference": "0.8.16251"}
#: digests of Llama keys computed before families were keyed (inf2serve 11864ba): entries
#: already in users' caches must keep loading
LLAMA_DIGESTS = {
    "neuron": ({}, "5732a22021f16173b2d28657581768243b50896ac34ed6c17ac378596543658f"),
    "neuron-micro-tp8": ({"batching": "micro", "neuron": {"tp_degree": 8}},
                         "0e09badf58c31fe0ed3875c62feb23c755c52c613bfa2ee22b8810f0d48252b0"),
    "neuron-int8-ods": ({"neuron": {"quantization": {"weights": "int8", "kv_cache": "fp8"},
                                    "on_device_sampling": True}},
                        "2e19df25baf13f7453cd31cad4594797363ac2ac18fa8e9eff85ecc9a04816f7"),
    "neuron-spec": ({"neuron": {"on_device_sampling": True,
                                "speculation": {"draft_checkpoint": "draft", "length": 4}}},
                    "3b448ff4d206a7ca49c45faf8ae3fb80c9713b23099e5e3fc48633d524a786ef"),
    "nxdi": ({"backend": "nxdi"},
             "3a0f5651123295a80c0beadb1f89ab1d478c7c60857b4d507e90e178152a1356"),
    "nxdi-int8": ({"backend": "nxdi", "neuron": {"quantization": {"weights": "int8"},
                                                 "on_device_sampling": True}},
                  "088bea83a5d54a61a4b3edd90efbf6c0b99da85ca1a4053a2567e7afe1103e65"),
    "nxdi-spec": ({"backend": "nxdi", "neuron": {
        "on_device_sampling": True, "speculation": {"draft_checkpoint": "draft", "length": 4}}},
        "8fa944f206fd4fb815d3638d6d4edfced40dde2b31f430f580e6be7a4871e8bb"),
}


@pytest.mark.parametrize("case", list(LLAMA_DIGESTS))
def test_llama_keys_are_byte_identical_to_before_families(case: str) -> None:
    handler, digest = LLAMA_DIGESTS[case]
    draft = {**MODEL, "num_hidden_layers": 1} if "spec" in case else None
    key = _key(handler, sdk=NXDI_SDK if case.startswith("nxdi") else SDK, draft=draft)
    assert key.family == "llama" and "family" not in key.to_dict()
    assert key.digest == digest


def test_the_family_and_its_class_are_keyed() -> None:
    mistral = {**MODEL, "model_type": "mistral", "sliding_window": None}
    key = _key(model=mistral)
    assert key.model_class == "mistral.model.MistralForSampling"
    assert key.to_dict()["family"] == "mistral" and key.entry_name.startswith("mistral-")
    assert KeyInputs.from_dict(key.to_dict()) == key
    # the same graph settings under another family name are another entry
    assert dataclasses.replace(key, family="mixtral").digest != key.digest
    nxdi = _key({"backend": "nxdi"}, model=mistral, sdk=NXDI_SDK)  # Mistral via the Llama class
    assert nxdi.model_class == "nxdi:models.llama.modeling_llama.NeuronLlamaForCausalLM"
    assert nxdi.digest != _key({"backend": "nxdi"}, sdk=NXDI_SDK).digest


def test_an_entry_written_before_families_reads_as_llama() -> None:
    old = BASE.to_dict()
    assert "family" not in old and KeyInputs.from_dict(old).family == "llama"
