"""Model families: which checkpoint is which family, and where each family runs.

A checkpoint's config.json `model_type` names its family; the family names the SDK class
each Neuron backend builds it with, or says in one line why that backend cannot run it
and what to use instead. `torch` runs every family (and any causal LM transformers
loads). What each family needs beyond its class (a sliding window, q/k/v bias, experts
against tp_degree, which speedups its SDK code honours) lives with each backend:
handlers/backends/neuron_families.py and nxdi_families.py, each rule citing the SDK line.

Named architectures (`handler.neuron.architecture`, a speculation draft's
`draft_architecture`) are config.json subsets of published checkpoints, so `validate`
reads a name exactly as it reads a checkpoint's config.json. This module imports nothing
of the runtime: config, the backends, `validate` and the compile cache's callers read it.

Sources: aws-neuron/transformers-neuronx@1ade6d7 (0.13, the last release, SDK 2.21-2.26)
and aws-neuron/neuronx-distributed-inference@cd3abf3 (0.8, SDK 2.28, the last with Inf2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ARCHITECTURES", "FAMILIES", "Family", "Support", "family_for", "family_name",
           "known_architecture", "model_class_for", "rope_scaling"]

#: the backends whose SDK builds a family with a class of its own
SDK_BACKENDS = ("neuron", "nxdi")


@dataclass(frozen=True)
class Support:
    """How one Neuron backend runs a family: the SDK class (relative to the SDK package, the
    form handler.neuron.model_class_name / handler.nxdi.model_class take), or "" with the
    reason it cannot, naming what to use."""

    model_class: str = ""
    reason: str = ""

    @property
    def supported(self) -> bool:
        return bool(self.model_class)


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json model_type values
    neuron: Support  # transformers-neuronx 0.13
    nxdi: Support  # NxD Inference 0.8
    summary: str = ""  # what sets it apart, for `inspect` and `validate` notes

    def support(self, backend: str) -> Support | None:
        """The backend's support, or None for a backend without SDK classes (torch)."""
        return getattr(self, backend) if backend in SDK_BACKENDS else None


_NO_QWEN_TNX = ("transformers-neuronx 0.13 has no {name} model (its classes: bloom, gpt2, "
                "gpt_neox, gptj, llama, mistral, mixtral, opt; modeling_auto.py:L5-L15); use "
                "handler.backend: nxdi (NxD Inference 0.8, Neuron SDK 2.28) or torch")

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",),
           Support("llama.model.LlamaForSampling"),
           Support("models.llama.modeling_llama.NeuronLlamaForCausalLM"),
           "Llama 2/3/3.1/3.2 (GQA, llama3 RoPE scaling)"),
    # NxD Inference 0.8 has no Mistral class: its model reference runs Mistral through the
    # Llama class (aws-neuron/aws-neuron-sdk@81ce03ae:libraries/nxd-inference/
    # developer_guides/model-reference.rst:L52-L75), which reads sliding_window from 0.7 on
    # (neuronx-distributed-inference@cd3abf3:models/llama/modeling_llama.py:L1010, L1350)
    Family("mistral", ("mistral",),
           Support("mistral.model.MistralForSampling"),
           Support("models.llama.modeling_llama.NeuronLlamaForCausalLM"),
           "Mistral 7B (v0.1: 4096-token sliding window; v0.3: none); nxdi runs it through "
           "the Llama class"),
    Family("mixtral", ("mixtral",),
           Support("mixtral.model.MixtralForSampling"),
           Support("models.mixtral.modeling_mixtral.NeuronMixtralForCausalLM"),
           "Mixtral MoE (num_local_experts experts, num_experts_per_tok per token)"),
    Family("qwen2", ("qwen2",),
           Support(reason=_NO_QWEN_TNX.format(name="Qwen2")),
           Support("models.qwen2.modeling_qwen2.NeuronQwen2ForCausalLM"),
           "Qwen2/Qwen2.5 and DeepSeek-R1-Distill-Qwen (q/k/v bias, tied embeddings in the "
           "small sizes)"),
    Family("qwen3", ("qwen3",),
           Support(reason=_NO_QWEN_TNX.format(name="Qwen3")),
           Support("models.qwen3.modeling_qwen3.NeuronQwen3ForCausalLM"),
           "Qwen3 dense (q/k RMS norms, explicit head_dim)"),
    Family("qwen3_moe", ("qwen3_moe",),
           Support(reason=_NO_QWEN_TNX.format(name="Qwen3-MoE")),
           Support(reason="inf2serve does not run NxD Inference's Qwen3-MoE yet (its expert "
                          "and tensor parallel settings are not wired); use handler.backend: "
                          "torch"),
           "Qwen3 mixture of experts"),
)

_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def family_for(model_type: str | None) -> Family | None:
    """The family of a config.json model_type; None for one the table does not know."""
    return _BY_TYPE.get(str(model_type or ""))


def family_name(model_config: dict[str, Any]) -> str:
    """The family a config.json belongs to, or its bare model_type when the table has no
    family for it (torch still runs it)."""
    model_type = str(model_config.get("model_type") or "")
    family = family_for(model_type)
    return family.name if family else model_type or "unknown"


def model_class_for(backend: str, model_config: dict[str, Any], setting: str = "") -> str:
    """The SDK class a Neuron backend builds this checkpoint with: the config's setting
    when it names one, else the family's. Raises ValueError, with the reason, where the
    backend cannot run the family (even under a named class: a Llama class would drop a
    Qwen checkpoint's q/k/v bias)."""
    model_type = model_config.get("model_type")
    family = family_for(model_type)
    if family is None:
        known = ", ".join(sorted(_BY_TYPE))
        raise ValueError(f"config.json model_type {model_type!r} is not a family backend "
                         f"{backend} runs (known: {known}); use handler.backend: torch")
    support = family.support(backend)
    if support is None:
        raise ValueError(f"backend {backend} builds no SDK model class")
    if not support.supported:
        raise ValueError(f"{family.name} on backend {backend}: {support.reason}")
    return setting or support.model_class


#: published config.json fields of the architectures `validate` knows by name (no weights
#: needed): meta-llama/Llama-2-{7b,13b,70b}-hf; TinyLlama/TinyLlama-1.1B (Llama-2's
#: tokenizer) and meta-llama/Llama-3.2-1B as speculation drafts; meta-llama/Meta-Llama-3-8B
#: (rope_theta 500000, no scaling) and Llama-3.1-8B/70B (llama3 RoPE scaling)
ARCHITECTURES: dict[str, dict[str, Any]] = {}


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, vocab: int, inter: int,
           positions: int, dtype: str = "") -> None:
    ARCHITECTURES[name] = {
        "model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "intermediate_size": inter, "max_position_embeddings": positions,
        **({"torch_dtype": dtype} if dtype else {})}


_llama("llama-2-7b", 32, 4096, 32, 32, 32000, 11008, 4096)
_llama("llama-2-13b", 40, 5120, 40, 40, 32000, 13824, 4096)
_llama("llama-2-70b", 80, 8192, 64, 8, 32000, 28672, 4096)
_llama("tinyllama-1.1b", 22, 2048, 32, 4, 32000, 5632, 2048)
_llama("llama-3.2-1b", 16, 2048, 32, 8, 128256, 8192, 131072, "bfloat16")
_llama("llama-3-8b", 32, 4096, 32, 8, 128256, 14336, 8192, "bfloat16")
_llama("llama-3.1-8b", 32, 4096, 32, 8, 128256, 14336, 131072, "bfloat16")
_llama("llama-3.1-70b", 80, 8192, 64, 8, 128256, 28672, 131072, "bfloat16")

#: the other families' ready configs, each its published config.json (the fields sizing and
#: the family rules read; bfloat16, rope_theta 1e6 throughout):
#: Qwen/Qwen2.5-7B-Instruct and -32B-Instruct (vocabulary 151,936 padded to 152,064 from 7B
#: up; the window is off: use_sliding_window false; untied from 7B up; q/k/v bias without a key)
ARCHITECTURES["qwen2.5-7b-instruct"] = {
    "model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
ARCHITECTURES["qwen2.5-32b-instruct"] = {
    "model_type": "qwen2", "num_hidden_layers": 64, "hidden_size": 5120,
    "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
    "intermediate_size": 27648, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 70,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
#: Qwen/Qwen3-8B (head_dim 128, q/k norms without a key, untied; the 0.6B-4B tie)
ARCHITECTURES["qwen3-8b"] = {
    "model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "rope_theta": 1000000, "attention_bias": False, "sliding_window": None,
    "use_sliding_window": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
#: mistralai/Mistral-7B-Instruct-v0.3 (vocabulary 32,768; sliding_window null: v0.1's
#: 4096-token window is gone)
ARCHITECTURES["mistral-7b-instruct-v0.3"] = {
    "model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32768,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
#: mistralai/Mixtral-8x7B-Instruct-v0.1 (8 experts of intermediate_size, 2 per token)
ARCHITECTURES["mixtral-8x7b-instruct"] = {
    "model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def rope_scaling(model_config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's RoPE scaling, None for none: 4.x writes `rope_scaling` (null, or a
    dict), 5.x `rope_parameters` whose rope_type "default" means none."""
    for key in ("rope_scaling", "rope_parameters"):
        value = model_config.get(key)
        if isinstance(value, dict) and value.get("rope_type", value.get("type")) not in (
                None, "default"):
            return value
    return None


def known_architecture(name: str) -> dict[str, Any] | None:
    """A named architecture's config.json fields (a copy), or None."""
    found = ARCHITECTURES.get(name)
    return dict(found) if found is not None else None
