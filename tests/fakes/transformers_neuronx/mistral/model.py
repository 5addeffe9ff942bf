"""Fake MistralForSampling: what the real class reads and refuses, computed with transformers'
MistralForCausalLM (whose sliding window the real token generation honours alike).

aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/mistral/ (config.py,
model.py, hlo.py) and sparse_attn_utils.py.
"""

from __future__ import annotations

from transformers_neuronx._sampling_model import DecoderForSampling

#: what MistralConfig copies from the HF config (mistral/config.py:L30-L45); a missing one
#: is an AttributeError there
MISTRAL_FIELDS = ("intermediate_size", "hidden_size", "num_attention_heads",
                  "num_hidden_layers", "vocab_size", "hidden_act", "bos_token_id",
                  "eos_token_id", "max_position_embeddings", "rms_norm_eps")


def scaled(config) -> bool:
    """Fake only: a RoPE scaling other than none (transformers 5's rope_scaling property
    returns rope_parameters, type "default" for none)."""
    value = getattr(config, "rope_scaling", None)
    return isinstance(value, dict) and value.get("rope_type", value.get("type")) not in (
        None, "default")


def read_mistral_config(config) -> None:
    for name in MISTRAL_FIELDS:
        getattr(config, name)


class MistralForSampling(DecoderForSampling):
    HF_CLASS = "MistralForCausalLM"
    #: new_layer() is called without is_unit_scale (mistral/model.py:L70): no no_quantize_list
    UNIT_SCALE_LAYERS = False

    # the real signature (mistral/model.py:L28-L30): no prefixed_length
    def __init__(self, config, *, n_positions=2048, batch_size=1, amp="f32", tp_degree=2,
                 context_length_estimate=None, context_unroll=None, unroll=None,
                 neuron_config=None, **kwargs):  # real default: NeuronConfig()
        read_mistral_config(config)
        # head size as hidden_size // num_attention_heads, head_dim not read (config.py:L32);
        # rope_scaling not read (config.py:L42-L44): the fake cannot compute either
        head_dim = getattr(config, "head_dim", None)
        if head_dim and head_dim != config.hidden_size // config.num_attention_heads:
            raise NotImplementedError("fake: a head_dim the real class ignores")
        if scaled(config):
            raise NotImplementedError("fake: rope_scaling, which the real class ignores")
        self.sliding_window = getattr(config, "sliding_window", None)  # config.py:L45
        super().__init__(config, n_positions=n_positions, batch_size=batch_size, amp=amp,
                         tp_degree=tp_degree, context_length_estimate=context_length_estimate,
                         neuron_config=neuron_config)

    def _check_active_tokens(self, n_active: int, n_positions: int) -> None:
        """The attention builds only decode (one token) or a whole context
        (mistral/hlo.py:L131-L133), e.g. not a speculative step's k + 1 tokens."""
        assert n_active == 1 or n_active == n_positions, (
            "Only supporting decode mode (q_seq_len=1) or self-attention mode "
            "(q_seq_len=k_seq_len)!")

    def _prepare(self, input_ids, cache_ids, start_ids):
        plan = super()._prepare(input_ids, cache_ids, start_ids)
        window = self.sliding_window
        if window and plan.kind in ("context", "static") and max(plan.ends) > window:
            # a prefill's window mask keeps j >= i - window: window + 1 positions
            # (sparse_attn_utils.py:L55-L69 at mistral/hlo.py:L140-L149), one more than the
            # decode path (hlo.py:L3980-L4010) and transformers attend to
            raise NotImplementedError("fake: a prefill longer than the sliding window (the "
                                      "real context window is one position wider)")
        return plan

    def sample(self, input_ids, sequence_length, start_ids=None, top_k=50, top_p=1.0,
               eos_token_override=None, temperature=1.0, streamer=None,
               stopping_criteria_list=None):
        """The real signature (mistral/model.py:L141-L142): no cache_ids, no **kwargs."""
        return super().sample(input_ids, sequence_length, start_ids=start_ids, top_k=top_k,
                              top_p=top_p, eos_token_override=eos_token_override,
                              temperature=temperature, streamer=streamer,
                              stopping_criteria_list=stopping_criteria_list)
