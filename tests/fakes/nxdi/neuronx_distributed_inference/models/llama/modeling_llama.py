"""Llama of the fake: LlamaInferenceConfig's required fields and NeuronLlamaForCausalLM.

aws-neuron/neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/
models/llama/modeling_llama.py.
"""

from __future__ import annotations

from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM


class LlamaInferenceConfig(InferenceConfig):
    def get_required_attributes(self) -> list[str]:  # L321-L333
        return ["hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                "pad_token_id", "vocab_size", "max_position_embeddings", "rope_theta",
                "rms_norm_eps", "hidden_act"]

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return NeuronConfig


class NeuronLlamaModel:
    """The traced decoder (L1336): FusedSpecNeuronConfig names it as worker_cls; the fake
    computes with the HF model instead."""


class NeuronLlamaForCausalLM(NeuronBaseForCausalLM):
    _model_cls = NeuronLlamaModel  # L1447

    @classmethod
    def get_config_cls(cls):  # L1572-L1574
        return LlamaInferenceConfig

    @staticmethod
    def load_hf_model(model_path, **kwargs):  # L1449-L1451: the whole HF model on the host
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM.from_pretrained(model_path, **kwargs)
