"""Qwen2 of the fake: Qwen2InferenceConfig's fields and NeuronQwen2ForCausalLM.

aws-neuron/neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/
models/qwen2/modeling_qwen2.py.
"""

from __future__ import annotations

from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM


class Qwen2NeuronConfig(NeuronConfig):  # L50-L54: names the Qwen2 attention class
    pass


class Qwen2InferenceConfig(InferenceConfig):
    def add_derived_config(self):  # L59-L62: q/k/v carry a bias, o does not
        self.num_cores_per_group = 1
        self.qkv_bias = True
        self.o_bias = False

    def get_required_attributes(self) -> list[str]:  # L64-L76
        return ["hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                "pad_token_id", "vocab_size", "max_position_embeddings", "rope_theta",
                "rms_norm_eps", "hidden_act"]

    @classmethod
    def get_neuron_config_cls(cls):  # L78-L80
        return Qwen2NeuronConfig


def _scaled(config) -> bool:
    """Fake only: RoPE scaling other than none (5.x's rope_parameters type "default")."""
    values = (getattr(config, "rope_scaling", None), getattr(config, "rope_parameters", None))
    return any(isinstance(v, dict) and v.get("rope_type", v.get("type")) not in (None, "default")
               for v in values)


class NeuronQwen2Model:
    """The traced decoder (L156); the fake computes with transformers' Qwen2."""


class NeuronQwen2ForCausalLM(NeuronBaseForCausalLM):
    _model_cls = NeuronQwen2Model  # L197

    @staticmethod
    def load_hf_model(model_path, **kwargs):  # L199-L201
        from transformers import Qwen2ForCausalLM

        return Qwen2ForCausalLM.from_pretrained(model_path, **kwargs)

    @classmethod
    def get_config_cls(cls):  # L233-L235
        return Qwen2InferenceConfig

    @classmethod
    def hf_class(cls, config):
        """Attention with q/k/v bias and RoPE from rope_theta alone (L83-L101: no rope_scaling,
        no sliding window); fused q/k/v concatenates weights and biases (L222-L223,
        L245-L283), which computes the same. The lm_head is the embedding's copy when
        tie_word_embeddings (L229-L231 with application_base.py:L729-L730)."""
        import transformers

        if _scaled(config):
            raise NotImplementedError("fake: rope_scaling, which this class ignores")
        if getattr(config, "use_sliding_window", False):
            raise NotImplementedError("fake: a sliding window, which this class ignores")
        return transformers.Qwen2ForCausalLM
