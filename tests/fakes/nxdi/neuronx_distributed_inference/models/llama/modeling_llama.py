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

    @classmethod
    def hf_class(cls, config):
        """The attention reads head_dim, attention_bias and sliding_window from the config
        (L1003-L1010) and the model masks a window as transformers' Mistral does (causal,
        the last `window` positions: models/model_base.py:L245-L307): a Mistral checkpoint
        (which NxD Inference 0.8 runs through this class, model-reference.rst:L52-L75)
        computes as transformers' Mistral, a Llama one as transformers' Llama."""
        import transformers

        if getattr(config, "model_type", "llama") == "mistral":
            nc = config.neuron_config
            if getattr(config, "sliding_window", None) and nc.enable_fused_speculation:
                # modules/attention/attention_base.py:L321-L322
                raise AssertionError("Currently we only support speculative decoding with "
                                     "sliding window attention when the cascaded tkg "
                                     "attention kernel is enabled")
            return transformers.MistralForCausalLM
        return transformers.LlamaForCausalLM

    @staticmethod
    def load_hf_model(model_path, **kwargs):  # L1449-L1451: the whole HF model on the host
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM.from_pretrained(model_path, **kwargs)
