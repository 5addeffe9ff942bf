"""Does config.json describe its weights? Every tensor's shape, from the safetensors headers.

A config.json with a doubled hidden_size or a halved vocab_size beside unchanged weights
loads nowhere: transformers stops at the first mismatch, and on Inf2 that is after the
compile. The shapes each architecture's modeling code builds from its config are a table
here, one function per `model_type` (the names and shapes of transformers' modeling_*.py,
which the Neuron SDKs' loaders read by the same names), so a family is added by adding a
function to ARCHITECTURES. Each expected shape carries the config keys it comes from, so
a refusal says which value disagrees. Quantized checkpoints (quantization_config) store
other shapes and are not checked; an unknown model_type is not checked either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handlers.errors import ConfigError


@dataclass(frozen=True)
class Expect:
    """One tensor's shape and the config keys it follows, e.g. "vocab_size x hidden_size"."""

    shape: tuple[int, ...]
    why: str
    optional: bool = False  # lm_head.weight of tied embeddings: save_pretrained leaves it out


Shapes = dict[str, Expect]


def _int(c: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = c.get(key, default)
    if value is None and default is not None:  # `head_dim: null` = the default
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key} is {value!r}; expected a positive integer")
    return value


@dataclass(frozen=True)
class Dims:
    """The sizes every decoder-only family here shares, with the family's defaults."""

    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim


def dims(c: Mapping[str, Any], kv_default: int | None = None,
         head_dim_default: int | None = None) -> Dims:
    """Sizes from config.json. `kv_default` / `head_dim_default`: the family's config class
    defaults (None: num_attention_heads, hidden_size // num_attention_heads)."""
    hidden, heads = _int(c, "hidden_size"), _int(c, "num_attention_heads")
    return Dims(vocab=_int(c, "vocab_size"), hidden=hidden, inter=_int(c, "intermediate_size"),
                layers=_int(c, "num_hidden_layers"), heads=heads,
                kv_heads=_int(c, "num_key_value_heads", kv_default or heads),
                head_dim=_int(c, "head_dim", head_dim_default or hidden // heads),
                tied=bool(c.get("tie_word_embeddings", False)))


def embeddings(d: Dims) -> Shapes:
    """Token embeddings, the final norm and the LM head (left out when tied)."""
    return {"model.embed_tokens.weight": Expect((d.vocab, d.hidden), "vocab_size x hidden_size"),
            "model.norm.weight": Expect((d.hidden,), "hidden_size"),
            "lm_head.weight": Expect((d.vocab, d.hidden), "vocab_size x hidden_size",
                                     optional=d.tied)}


def attention(d: Dims, i: int, qkv_bias: bool = False, o_bias: bool = False,
              qk_norm: bool = False) -> Shapes:
    """q/k/v/o projections (GQA: k and v have num_key_value_heads heads), optional biases,
    optional per-head q/k norms (Qwen3), and the two RMSNorms of the layer."""
    p = f"model.layers.{i}."
    q_why = "num_attention_heads x head_dim"
    kv_why = "num_key_value_heads x head_dim"
    out = {p + "self_attn.q_proj.weight": Expect((d.q, d.hidden), f"({q_why}) x hidden_size"),
           p + "self_attn.k_proj.weight": Expect((d.kv, d.hidden), f"({kv_why}) x hidden_size"),
           p + "self_attn.v_proj.weight": Expect((d.kv, d.hidden), f"({kv_why}) x hidden_size"),
           p + "self_attn.o_proj.weight": Expect((d.hidden, d.q), f"hidden_size x ({q_why})"),
           p + "input_layernorm.weight": Expect((d.hidden,), "hidden_size"),
           p + "post_attention_layernorm.weight": Expect((d.hidden,), "hidden_size")}
    if qkv_bias:
        out[p + "self_attn.q_proj.bias"] = Expect((d.q,), q_why)
        out[p + "self_attn.k_proj.bias"] = Expect((d.kv,), kv_why)
        out[p + "self_attn.v_proj.bias"] = Expect((d.kv,), kv_why)
    if o_bias:
        out[p + "self_attn.o_proj.bias"] = Expect((d.hidden,), "hidden_size")
    if qk_norm:
        out[p + "self_attn.q_norm.weight"] = Expect((d.head_dim,), "head_dim")
        out[p + "self_attn.k_norm.weight"] = Expect((d.head_dim,), "head_dim")
    return out


def dense_mlp(d: Dims, i: int, bias: bool = False) -> Shapes:
    """SwiGLU MLP: gate and up [intermediate, hidden], down [hidden, intermediate]."""
    p = f"model.layers.{i}.mlp."
    up = "intermediate_size x hidden_size"
    out = {p + "gate_proj.weight": Expect((d.inter, d.hidden), up),
           p + "up_proj.weight": Expect((d.inter, d.hidden), up),
           p + "down_proj.weight": Expect((d.hidden, d.inter), "hidden_size x intermediate_size")}
    if bias:
        out |= {p + "gate_proj.bias": Expect((d.inter,), "intermediate_size"),
                p + "up_proj.bias": Expect((d.inter,), "intermediate_size"),
                p + "down_proj.bias": Expect((d.hidden,), "hidden_size")}
    return out


def mixtral_moe(d: Dims, i: int, experts: int) -> Shapes:
    """Mixtral's sparse MoE as checkpoints store it: a router [experts, hidden] and per
    expert w1/w3 [intermediate, hidden], w2 [hidden, intermediate]."""
    p = f"model.layers.{i}.block_sparse_moe."
    out = {p + "gate.weight": Expect((experts, d.hidden), "num_local_experts x hidden_size")}
    up, down = "intermediate_size x hidden_size", "hidden_size x intermediate_size"
    for e in range(experts):
        out |= {p + f"experts.{e}.w1.weight": Expect((d.inter, d.hidden), up),
                p + f"experts.{e}.w2.weight": Expect((d.hidden, d.inter), down),
                p + f"experts.{e}.w3.weight": Expect((d.inter, d.hidden), up)}
    return out


# One function per model_type: transformers/models/<type>/modeling_<type>.py (5.x; the 4.x
# lines build the same parameters), with each config class's defaults for absent keys.

def llama(c: Mapping[str, Any]) -> Shapes:
    """LlamaAttention (attention_bias on q/k/v/o), LlamaMLP (mlp_bias)."""
    d = dims(c)
    out = embeddings(d)
    bias = bool(c.get("attention_bias", False))
    for i in range(d.layers):
        out |= attention(d, i, qkv_bias=bias, o_bias=bias)
        out |= dense_mlp(d, i, bias=bool(c.get("mlp_bias", False)))
    return out


def mistral(c: Mapping[str, Any]) -> Shapes:
    """No biases; MistralConfig defaults num_key_value_heads to 8."""
    d = dims(c, kv_default=8)
    out = embeddings(d)
    for i in range(d.layers):
        out |= attention(d, i) | dense_mlp(d, i)
    return out


def qwen2(c: Mapping[str, Any]) -> Shapes:
    """Qwen2Attention: q/k/v with bias, o without."""
    d = dims(c, kv_default=32)
    out = embeddings(d)
    for i in range(d.layers):
        out |= attention(d, i, qkv_bias=True) | dense_mlp(d, i)
    return out


def qwen3(c: Mapping[str, Any]) -> Shapes:
    """Qwen3Attention: per-head RMSNorms on q and k (q_norm, k_norm [head_dim]), biases
    only with attention_bias; Qwen3Config defaults head_dim to 128."""
    d = dims(c, kv_default=32, head_dim_default=128)
    out = embeddings(d)
    bias = bool(c.get("attention_bias", False))
    for i in range(d.layers):
        out |= attention(d, i, qkv_bias=bias, o_bias=bias, qk_norm=True) | dense_mlp(d, i)
    return out


def mixtral(c: Mapping[str, Any]) -> Shapes:
    """Mistral's attention with a sparse MoE in place of the MLP."""
    d = dims(c, kv_default=8)
    experts = _int(c, "num_local_experts", 8)
    out = embeddings(d)
    for i in range(d.layers):
        out |= attention(d, i) | mixtral_moe(d, i, experts)
    return out


#: config.json model_type -> the tensors its modeling code builds from the config
ARCHITECTURES: dict[str, Callable[[Mapping[str, Any]], Shapes]] = {
    "llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3, "mixtral": mixtral}


def _shape(shape: tuple[int, ...] | list[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def check_shapes(model_config: Mapping[str, Any], tensors: Mapping[str, tuple[list[int], Path]],
                 config_path: Path) -> None:
    """Refuse (ConfigError) the first tensor config.json does not account for: a shape that
    differs, a tensor missing, or a layer past num_hidden_layers. `tensors`: name -> (shape,
    file). Other tensors (a saved rotary_emb.inv_freq) are left to the loaders, which ignore
    them."""
    kind = model_config.get("model_type")
    rule = ARCHITECTURES.get(kind) if isinstance(kind, str) else None
    if rule is None or model_config.get("quantization_config"):
        return
    try:
        expected = rule(model_config)
    except ConfigError as exc:
        raise ConfigError(f"{config_path}: {exc} (model_type {kind!r}); restore the config.json "
                          "saved with these weights") from None
    fix = (f"the checkpoint's weights and {config_path} do not belong together: restore the "
           "config.json saved with these weights")
    for name, want in expected.items():
        if name not in tensors:
            if want.optional:
                continue
            why = (" and tie_word_embeddings is false" if name == "lm_head.weight" else "")
            raise ConfigError(f"{config_path}: model_type {kind!r} needs tensor {name!r} "
                              f"{_shape(want.shape)}, which no weight file holds{why}; {fix}")
        shape, path = tensors[name]
        if tuple(shape) != want.shape:
            raise ConfigError(f"{path}: tensor {name!r} is {_shape(shape)}, but {config_path} "
                              f"implies {_shape(want.shape)} ({want.why}, with "
                              f"{_values(want.why, model_config)}); {fix}")
    layers = model_config.get("num_hidden_layers")
    beyond = sorted(n for n in tensors if n.startswith("model.layers.") and n not in expected
                    and _layer(n) is not None and _layer(n) >= layers)
    if beyond:
        raise ConfigError(f"{tensors[beyond[0]][1]}: holds {beyond[0]!r}, a layer past "
                          f"num_hidden_layers {layers} of {config_path}; {fix}")
    return []


def _layer(name: str) -> int | None:
    part = name.split(".")[2]
    return int(part) if part.isdigit() else None


def _values(why: str, c: Mapping[str, Any]) -> str:
    """'hidden_size 128, intermediate_size 344' for the keys a shape follows (their values
    as config.json has them; a key it leaves out shows the family's default)."""
    keys = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "num_local_experts") if k in why]
    return ", ".join(f"{k} {c.get(k, 'default')}" for k in keys)
