"""The family table: model_type -> family -> the class each Neuron backend builds, or why not."""

from __future__ import annotations

import pytest

from handlers.families import (
    ARCHITECTURES,
    FAMILIES,
    family_for,
    family_name,
    known_architecture,
    model_class_for,
)


@pytest.mark.parametrize("model_type,neuron,nxdi", [
    ("llama", "llama.model.LlamaForSampling",
     "models.llama.modeling_llama.NeuronLlamaForCausalLM"),
    ("mistral", "mistral.model.MistralForSampling",
     "models.llama.modeling_llama.NeuronLlamaForCausalLM"),
    ("mixtral", "mixtral.model.MixtralForSampling",
     "models.mixtral.modeling_mixtral.NeuronMixtralForCausalLM"),
    ("qwen2", None, "models.qwen2.modeling_qwen2.NeuronQwen2ForCausalLM"),
    ("qwen3", None, "models.qwen3.modeling_qwen3.NeuronQwen3ForCausalLM"),
])
def test_the_class_follows_the_checkpoints_model_type(model_type, neuron, nxdi) -> None:
    config = {"model_type": model_type}
    assert model_class_for("nxdi", config) == nxdi
    if neuron:
        assert model_class_for("neuron", config) == neuron
    else:  # one line naming the backend that runs it
        with pytest.raises(ValueError, match="no Qwen.* model .*use handler.backend: nxdi"):
            model_class_for("neuron", config)


def test_a_named_class_wins_but_not_over_a_family_the_backend_cannot_run() -> None:
    named = "mistral.model.MyMistralForSampling"
    assert model_class_for("neuron", {"model_type": "mistral"}, named) == named
    with pytest.raises(ValueError, match="qwen2 on backend neuron"):
        model_class_for("neuron", {"model_type": "qwen2"}, "llama.model.LlamaForSampling")


def test_an_unknown_model_type_names_the_known_ones_and_torch() -> None:
    with pytest.raises(ValueError, match=r"'phi3' is not a family .*use handler.backend: torch"):
        model_class_for("nxdi", {"model_type": "phi3"})
    assert family_for("phi3") is None and family_name({"model_type": "phi3"}) == "phi3"
    assert family_name({"model_type": "qwen2"}) == "qwen2"


def test_every_family_says_why_where_it_does_not_run() -> None:
    for family in FAMILIES:
        for backend in ("neuron", "nxdi"):
            support = family.support(backend)
            assert support.supported or support.reason.startswith(("transformers-neuronx",
                                                                   "inf2serve"))
        assert family.support("torch") is None


def test_named_architectures_are_config_json_fields() -> None:
    arch = known_architecture("llama-2-70b")
    assert arch["model_type"] == "llama" and arch["num_key_value_heads"] == 8
    arch["num_key_value_heads"] = 1  # a copy
    assert ARCHITECTURES["llama-2-70b"]["num_key_value_heads"] == 8
    assert known_architecture("nope") is None
