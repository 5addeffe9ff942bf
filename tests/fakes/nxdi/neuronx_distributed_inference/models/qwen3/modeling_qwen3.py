"""Qwen3 of the fake: Qwen3InferenceConfig's fields and NeuronQwen3ForCausalLM.

aws-neuron/neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/
models/qwen3/modeling_qwen3.py.
"""

from __future__ import annotations

from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM


class Qwen3NeuronConfig(NeuronConfig):  # L50-L54
    pass


class Qwen3InferenceConfig(InferenceConfig):
    def get_required_attributes(self) -> list[str]:  # L62-L75: head_dim is required
        return ["hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                "head_dim", "pad_token_id", "vocab_size", "max_position_embeddings",
                "rope_theta", "rms_norm_eps", "hidden_act"]

    @classmethod
    def get_neuron_config_cls(cls):  # L77-L79
        return Qwen3NeuronConfig


def _scaled(config) -> bool:
    """Fake only: RoPE scaling other than none (5.x's rope_parameters type "default")."""
    values = (getattr(config, "rope_scaling", None), getattr(config, "rope_parameters", None))
    return any(isinstance(v, dict) and v.get("rope_type", v.get("type")) not in (None, "default")
               for v in values)


class NeuronQwen3Model:
    """The traced decoder (L156); the fake computes with transformers' Qwen3."""


class NeuronQwen3ForCausalLM(NeuronBaseForCausalLM):
    _model_cls = NeuronQwen3Model  # L199

    @staticmethod
    def load_hf_model(model_path, **kwargs):  # L201-L203
        from transformers import Qwen3ForCausalLM

        return Qwen3ForCausalLM.from_pretrained(model_path, **kwargs)

    @classmethod
    def get_config_cls(cls):  # L239-L241
        return Qwen3InferenceConfig

    @classmethod
    def check_weights(cls, config) -> None:
        """convert_hf_to_neuron_state_dict renames q_norm/k_norm and fuses nothing
        (L206-L233): with fused_qkv the traced attention's Wqkv has no weight."""
        if config.neuron_config.fused_qkv:
            raise RuntimeError("fake: fused_qkv with Qwen3: the traced attention reads "
                               "qkv_proj.Wqkv, which convert_hf_to_neuron_state_dict never "
                               "writes (L206-L233)")

    @classmethod
    def hf_class(cls, config):
        """Attention with q/k RMS norms over head_dim, no bias, RoPE from rope_theta alone
        (L82-L101)."""
        import transformers

        if _scaled(config) or getattr(config, "attention_bias", False):
            raise NotImplementedError("fake: rope_scaling or attention_bias, which this class "
                                      "ignores")
        if getattr(config, "use_sliding_window", False):
            raise NotImplementedError("fake: a sliding window, which this class ignores")
        return transformers.Qwen3ForCausalLM
