"""Mixtral of the fake: MixtralInferenceConfig's fields, MoENeuronConfig and
NeuronMixtralForCausalLM.

aws-neuron/neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/
models/mixtral/modeling_mixtral.py (ND = aws-neuron/neuronx-distributed@73ab227:
src/neuronx_distributed/).
"""

from __future__ import annotations

from neuronx_distributed_inference.models.config import InferenceConfig, MoENeuronConfig
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM


class MixtralInferenceConfig(InferenceConfig):
    def get_required_attributes(self) -> list[str]:  # L141-L154
        return ["hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                "pad_token_id", "vocab_size", "max_position_embeddings", "rope_theta",
                "num_local_experts", "num_experts_per_tok", "rms_norm_eps"]

    @classmethod
    def get_neuron_config_cls(cls):  # L156-L158
        return MoENeuronConfig


def _scaled(config) -> bool:
    """Fake only: RoPE scaling other than none (5.x's rope_parameters type "default")."""
    values = (getattr(config, "rope_scaling", None), getattr(config, "rope_parameters", None))
    return any(isinstance(v, dict) and v.get("rope_type", v.get("type")) not in (None, "default")
               for v in values)


class NeuronMixtralModel:
    """The traced decoder (L261); the fake computes with transformers' Mixtral."""


class NeuronMixtralForCausalLM(NeuronBaseForCausalLM):
    _model_cls = NeuronMixtralModel  # L307

    @staticmethod
    def load_hf_model(model_path, **kwargs):  # L309-L311
        from transformers import MixtralForCausalLM

        return MixtralForCausalLM.from_pretrained(model_path, **kwargs)

    @classmethod
    def get_config_cls(cls):  # L313-L315
        return MixtralInferenceConfig

    @classmethod
    def check_weights(cls, config) -> None:
        nc = config.neuron_config
        assert nc.glu_mlp is True, "Only GLU MLP is supported for Mixtral Top-K model"  # L56
        tp, inter = nc.tp_degree, config.intermediate_size
        # each expert's gate/up and down projections split over tp without padding
        # (ND modules/moe/moe_parallel_layers.py:L175-L230 -> parallel_layers/layers.py:L630,
        # L888 -> utils.py:L91-L100)
        assert inter % tp == 0, f"{inter} is not divisible by {tp}"
        if nc.quantized:
            # convert_mixtral_to_neuron_state_dict fuses the experts' weights, not their
            # scales (L52-L130): the traced quantized experts find no scale
            raise RuntimeError("fake: quantized Mixtral experts: convert_mixtral_to_neuron_"
                               "state_dict carries no scales into gate_up_proj/down_proj")
        if nc.fused_qkv:
            raise RuntimeError("fake: fused_qkv with Mixtral: no Wqkv is written (L52-L130)")

    @classmethod
    def hf_class(cls, config):
        """Attention with RoPE from rope_theta alone and no sliding window (L161-L176); the
        router's top-k affinities normalized (modules/moe.py:L13, as transformers does)."""
        import transformers

        window = getattr(config, "sliding_window", None)
        if window and window < config.neuron_config.max_length:
            raise NotImplementedError("fake: a binding sliding window, which this class ignores")
        if _scaled(config):
            raise NotImplementedError("fake: rope_scaling, which this class ignores")
        return transformers.MixtralForCausalLM
