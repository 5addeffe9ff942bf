"""Fake LlamaForSampling (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/
llama/model.py): the fake's shared decoder model with what LlamaConfig reads."""

from __future__ import annotations

from transformers_neuronx._sampling_model import DecoderForSampling


class LlamaForSampling(DecoderForSampling):
    HF_CLASS = "LlamaForCausalLM"

    # unknown keywords land in **kwargs and are ignored (llama/model.py:L32-L34)
    def __init__(self, config, *, n_positions=2048, batch_size=1, amp="f32", tp_degree=2,
                 context_length_estimate=None, context_unroll=None, unroll=None,
                 neuron_config=None, prefixed_length=0, **kwargs):
        scaling = getattr(config, "rope_scaling", None)  # llama/config.py:L45-L48
        kind = scaling.get("rope_type", scaling.get("type")) if scaling is not None else None
        if scaling is not None and kind not in {"default", "llama3"}:
            raise ValueError("Only default and llama3 ropes scaling types are currently "
                             f"supported. Received {kind}")
        super().__init__(config, n_positions=n_positions, batch_size=batch_size, amp=amp,
                         tp_degree=tp_degree, context_length_estimate=context_length_estimate,
                         neuron_config=neuron_config, prefixed_length=prefixed_length)
