"""What transformers-neuronx 0.13 needs of each family, beyond its class.

One place for the neuron backend's per-family rules, so the neuron backend stays one code
path: Llama, Mistral and Mixtral share NeuronModelBase's forward, buckets, continuous
batching and sampling, and differ in what their config and HLO read. `problems` lists
every setting or checkpoint field the SDK would refuse, ignore or compute differently
from the checkpoint, one line each with the fix; `validate`, `package` and the backend's
start run it. The fakes under tests/fakes enforce the same lines.

Citations: aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/.
"""

from __future__ import annotations

from typing import Any

from handlers.config import HandlerConfig
from handlers.errors import ConfigError
from handlers.families import family_for, model_class_for, rope_scaling
from neuron_cache.key import context_buckets

#: families whose attention is MistralForSamplingNoEmbeddingHlo.attention (mixtral/hlo.py:
#: L26-L36 asserts Mixtral keeps it)
MISTRAL_ATTENTION = ("mistral", "mixtral")


def _head_dim(model_config: dict[str, Any]) -> int | None:
    value = model_config.get("head_dim")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def check_family(config: HandlerConfig, model_config: dict[str, Any],
                 draft_config: dict[str, Any] | None = None) -> str:
    """The class the backend builds this checkpoint with, after every rule below: the
    backend's start runs it before compiling anything."""
    found = problems(config, model_config, draft_config)
    if found:
        raise ConfigError("; ".join(found))
    return model_class_for("neuron", model_config, config.neuron.model_class_name)


def problems(config: HandlerConfig, model_config: dict[str, Any],
             draft_config: dict[str, Any] | None = None) -> list[str]:
    """Every reason backend neuron cannot run this checkpoint with these settings."""
    try:
        model_class_for("neuron", model_config, config.neuron.model_class_name)
    except ValueError as exc:
        return [str(exc)]
    family = family_for(model_config.get("model_type"))
    out: list[str] = []
    n, sp = config.neuron, config.neuron.speculation
    if draft_config is not None and family_for(draft_config.get("model_type")) != family:
        # the backend builds the draft with the model's class (FusedSpeculativeDecoder takes
        # two models of one decoder type, fused_speculation.py:L281-L325)
        out.append(f"handler.neuron.speculation: the draft is a "
                   f"{draft_config.get('model_type')!r} checkpoint, the model "
                   f"{family.name!r}; backend neuron builds both with the model's class: use a "
                   f"draft of the model's family")
    if family.name not in MISTRAL_ATTENTION:
        return out
    name = family.name.capitalize()
    heads, hidden = model_config.get("num_attention_heads"), model_config.get("hidden_size")
    head_dim = _head_dim(model_config)
    if head_dim and isinstance(heads, int) and isinstance(hidden, int) and heads \
            and head_dim != hidden // heads:
        # MistralConfig: attention_head_size = hidden_size // num_attention_heads
        # (mistral/config.py:L32; mixtral/config.py:L32), head_dim is not read
        out.append(f"config.json: head_dim {head_dim} != hidden_size {hidden} / "
                   f"num_attention_heads {heads}; transformers-neuronx's {name} sizes heads as "
                   "hidden_size // num_attention_heads and would misread it; use backend nxdi")
    if scaling := rope_scaling(model_config):
        # MistralConfig reads rope_theta only (mistral/config.py:L42-L44)
        out.append(f"config.json: rope_scaling {scaling!r}; transformers-"
                   f"neuronx's {name} reads no rope_scaling and would run unscaled RoPE; use "
                   "backend nxdi or torch")
    window = model_config.get("sliding_window")
    top = context_buckets(config)[-1]
    if isinstance(window, int) and window and top > window:
        # a prefill attends to the window + 1 last positions (build_sliding_window_mask keeps
        # j >= i - window, sparse_attn_utils.py:L55-L69, applied at mistral/hlo.py:L140-L149),
        # the checkpoint (and the decode path, hlo.py:L3980-L4010) to the last `window`
        out.append(f"handler.neuron.context_length_estimate: a prefill bucket of {top} exceeds "
                   f"config.json's sliding_window {window}; transformers-neuronx's {name} "
                   f"prefill attends to {window + 1} positions where the checkpoint attends to "
                   f"{window}; keep every prefill bucket <= {window} (decode honours the window)")
    if sp.enabled:
        # the verify step runs k + 1 tokens, which this attention refuses: "Only supporting
        # decode mode (q_seq_len=1) or self-attention mode" (mistral/hlo.py:L131-L133)
        out.append(f"handler.neuron.speculation: transformers-neuronx's {name} attention runs "
                   "one token or a whole context, not the k + 1 a speculative step verifies "
                   "(mistral/hlo.py:L131-L133); use backend nxdi, or no speculation")
    q = n.quantization
    if q.skip_modules:
        # only LlamaForSampling passes is_unit_scale to its layers (llama/model.py:L124-L128);
        # mistral/model.py:L70 and mixtral/model.py:L76 call new_layer() without it
        out.append(f"handler.neuron.quantization.skip_modules: transformers-neuronx's {name} "
                   "reads no no_quantize_list (its layers get no is_unit_scale); remove it")
    if family.name == "mixtral":
        out += _mixtral(config, model_config)
    return out


def _mixtral(config: HandlerConfig, model_config: dict[str, Any]) -> list[str]:
    out = []
    tp, experts = config.neuron.tp_degree, model_config.get("num_local_experts")
    if not isinstance(experts, int) or experts < 1:
        return [f"config.json: num_local_experts {experts!r}; a Mixtral config names its "
                "experts (MixtralConfig reads it, mixtral/config.py:L46-L47)"]
    if experts % tp and tp % experts:
        # mixtral/config.py:L58-L62: experts split over cores or cores over experts
        fits = [t for t in (1, 2, 4, 8, 24) if not experts % t or not t % experts]
        out.append(f"handler.neuron.tp_degree: {tp} with {experts} experts; transformers-"
                   "neuronx's Mixtral needs tp_degree to divide the experts or be a multiple "
                   f"of them (mixtral/config.py:L58-L62): use one of {fits}")
    elif config.neuron.quantization.weights and tp < experts:
        # with several experts per core, each expert's weight slice is passed with the
        # scales of all the core's experts (mixtral/hlo.py:L110-L144): not one scale per
        # output channel of the slice
        out.append(f"handler.neuron.quantization.weights: {config.neuron.quantization.weights} "
                   f"with {experts // tp} experts per NeuronCore (tp_degree {tp}); transformers-"
                   "neuronx's Mixtral slices each expert's weights but not their scales "
                   f"(mixtral/hlo.py:L110-L144): use tp_degree {experts} or more, or no "
                   "quantized weights")
    return out
