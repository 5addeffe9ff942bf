"""How transformers-neuronx lays a Llama model out on Inf2, and what that costs.

Pure arithmetic that mirrors the real library's rules, each cited, so `validate`
can say what a real `to_neuron()` will do before anyone rents an instance: which
tensor-parallel degrees an instance can host, how heads are padded and K/V heads
replicated, device memory per NeuronCore, and host memory while loading and
compiling. The host figures are estimates and say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from handlers.errors import ConfigError

# tp degrees the Neuron runtime supports on Inf2: transformers-neuronx developer guide,
# "Tensor-parallelism support" (aws-neuron/aws-neuron-sdk@81ce03ae:archive/transformers-neuronx/
# transformers-neuronx-developer-guide.rst:L116-118); AWS's LLM inference guide lists 2, 4, 8,
# 12 and 24 (about-neuron/transformers/generative-llm-inference-with-neuron.rst:L238), so 12 is
# accepted with a warning.
INF2_TP_DEGREES = (1, 2, 4, 8, 24)
INF2_TP_DEGREES_LLM_GUIDE = (12,)


@dataclass(frozen=True)
class Instance:
    cores: int  # NeuronCores: 2 per Inferentia2 chip
    host_gib: int  # host memory


# chips and host memory per size: aws-neuron/aws-neuron-sdk@81ce03ae:about-neuron/arch/
# neuron-hardware/inf2-arch.rst:L17-68; two NeuronCore-v2 per chip: inferentia2.rst:L6
INSTANCES = {
    "inf2.xlarge": Instance(2, 16), "inf2.8xlarge": Instance(2, 128),
    "inf2.24xlarge": Instance(12, 384), "inf2.48xlarge": Instance(24, 768),
}

AMP_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
GIB = 2**30

# Host-memory assumptions. Not measured on Inf2 by us; the message prints them.
#: one neuronx-cc compilation of one fully unrolled graph; the compiler's footprint grows with
#: the graph (layers, batch, bucket length) and is not documented, so this is a round figure
COMPILER_GIB_PER_GRAPH = 4.0
#: a worker process before weights: Python, torch, transformers, transformers-neuronx, runtime
WORKER_PROCESS_GIB = 2.0
#: the OS and TorchServe's frontend (JVM)
HOST_RESERVED_GIB = 2.0


@dataclass(frozen=True)
class Arch:
    """A decoder's shape: what the sizing arithmetic needs of its config.json.

    The first fields are every Llama-class model's; the rest default to Llama and hold what
    the other families change: an explicit head_dim (Qwen3, Mistral: `head_dim` key),
    tied input and output embeddings (Qwen2.5 0.5B-3B, Qwen3 0.6B-4B: one matrix in the
    checkpoint, while on the device both Neuron SDKs hold a LM head beside the embedding:
    NxD Inference copies it, aws-neuron/neuronx-distributed-inference@cd3abf3:src/
    neuronx_distributed_inference/models/qwen2/modeling_qwen2.py:L230-231), Qwen2's q/k/v
    bias, Qwen3's q/k norms, and Mixtral's experts (`num_local_experts` MLPs of
    `intermediate_size` each, `num_experts_per_tok` of them per token, and a router).
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int
    max_positions: int
    source_dtype: str = ""  # checkpoint dtype from config.json; "" = unknown
    family: str = "llama"  # config.json's model_type
    head_size: int = 0  # config.json's head_dim where it is given; 0 = hidden // heads
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: int = 0  # 0 = a dense MLP
    experts_per_token: int = 0
    sliding_window: int = 0  # 0 = full attention

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def mlp_params(self, intermediate: int | None = None) -> int:
        """One layer's MLP (every expert's, plus the router), at `intermediate` (padded)."""
        inter = self.intermediate if intermediate is None else intermediate
        if not self.experts:
            return 3 * self.hidden * inter
        return self.experts * 3 * self.hidden * inter + self.hidden * self.experts

    def attn_params(self, heads: int, kv_heads: int) -> int:
        """One layer's attention projections (and their bias) for these head counts."""
        q, kv = heads * self.head_dim, kv_heads * self.head_dim
        bias = q + 2 * kv if self.qkv_bias else 0
        return 2 * self.hidden * q + 2 * self.hidden * kv + bias

    @property
    def layer_params(self) -> int:
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return self.attn_params(self.heads, self.kv_heads) + self.mlp_params() + norms

    @property
    def params(self) -> int:
        embeddings = (1 if self.tied_embeddings else 2) * self.vocab * self.hidden
        return self.layers * self.layer_params + embeddings + self.hidden

    @property
    def active_params(self) -> int:
        """Parameters one token runs through (all of them, but for Mixtral's idle experts)."""
        if not self.experts:
            return self.params
        idle = (self.experts - self.experts_per_token) * 3 * self.hidden * self.intermediate
        return self.params - self.layers * idle


def _window(data: dict[str, Any]) -> int:
    """The attention window the checkpoint needs; 0 = full attention. Qwen2's config keeps a
    `sliding_window` value that `use_sliding_window: false` switches off."""
    if data.get("use_sliding_window") is False:
        return 0
    return int(data.get("sliding_window") or 0)


def arch_from_config_json(data: dict[str, Any]) -> Arch:
    """A checkpoint's shape, with what its family changes (see Arch)."""
    try:
        heads = int(data["num_attention_heads"])
        family = str(data.get("model_type") or "llama")
        return Arch(int(data["num_hidden_layers"]), int(data["hidden_size"]), heads,
                    int(data.get("num_key_value_heads") or heads), int(data["vocab_size"]),
                    int(data["intermediate_size"]),
                    int(data.get("max_position_embeddings") or 0),
                    str(data.get("torch_dtype") or data.get("dtype") or ""),
                    family=family, head_size=int(data.get("head_dim") or 0),
                    tied_embeddings=bool(data.get("tie_word_embeddings", False)),
                    # Qwen2 has the bias without a key; Llama's attention_bias adds o_proj's
                    qkv_bias=family == "qwen2" or bool(data.get("attention_bias")),
                    qk_norm=family in ("qwen3", "qwen3_moe"),
                    experts=int(data.get("num_local_experts") or 0),
                    experts_per_token=int(data.get("num_experts_per_tok") or 0),
                    sliding_window=_window(data))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"config.json: missing or invalid {exc}; expected a Llama-style config "
                          "(num_hidden_layers, hidden_size, num_attention_heads, ...)") from exc


def round_up(value: int, divisor: int) -> int:
    return math.ceil(value / divisor) * divisor


def tp_degrees_for(instance: Instance) -> list[int]:
    """Supported degrees (both AWS lists) that fit on the instance's cores."""
    return sorted(t for t in INF2_TP_DEGREES + INF2_TP_DEGREES_LLM_GUIDE if t <= instance.cores)


@dataclass(frozen=True)
class HeadLayout:
    """Attention heads as transformers-neuronx shards them over `tp` NeuronCores."""

    heads: int
    kv_heads: int
    tp: int
    gqa: str  # the strategy in effect after the library's fallbacks ("" = plain MHA)
    heads_padded: int  # Q (and O) heads after zero-padding to a multiple of tp
    kv_heads_used: int  # K/V heads after replication
    kv_weight_heads: int  # K/V heads in the weights (padded like Q when K/V match Q)
    kv_cache_heads: int  # K/V heads in the KV cache
    fallbacks: tuple[str, ...]  # strategies the library dropped (it warns), and why

    @property
    def padding(self) -> float:
        """Extra attention compute from zero heads (0.125 = +12.5%)."""
        return self.heads_padded / self.heads - 1

    @property
    def replication(self) -> float:
        return self.kv_heads_used / self.kv_heads


def effective_gqa(arch: Arch, tp: int, gqa: str, batch_size: int) -> tuple[str, list[str]]:
    """The GQA strategy after the library's checks, and why it dropped the one asked for.

    Mirrors aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/decoder.py:L100-176
    (check_gqa_fallback): an unset strategy on a GQA model becomes shard-over-heads, and
    K/V heads that do not divide over tp switch to replicated-heads.
    """
    heads, kv, said = arch.heads, arch.kv_heads, []
    if not gqa and heads == kv:
        return "", said
    if gqa == "replicated-heads":
        return gqa, said
    if gqa == "shard-over-batch":
        if batch_size % tp == 0:
            return gqa, said
        said.append(f"gqa shard-over-batch needs batch_size {batch_size} divisible by tp_degree "
                    f"{tp}; transformers-neuronx falls back to shard-over-heads")
        gqa = "shard-over-heads"
    if gqa == "all-gather-heads":
        if (kv * arch.head_dim) % tp:
            said.append(f"gqa all-gather-heads needs the K/V width {kv} x {arch.head_dim} "
                        f"divisible by tp_degree {tp}; falls back to shard-over-heads")
            gqa = "shard-over-heads"
        if heads % tp == 0 or (round_up(heads, tp) - heads) % kv == 0:
            return gqa, said
        said.append(f"gqa all-gather-heads: {round_up(heads, tp) - heads} padding heads do not "
                    f"divide over {kv} K/V heads; falls back to shard-over-heads")
    if kv % tp:  # the library warns too; `head_layout` gives the numbers
        return "replicated-heads", said
    return gqa or "shard-over-heads", said


def qkv_padding(heads: int, kv: int, tp: int, gqa: str) -> tuple[int, int]:
    """(Q heads, K/V heads) after padding.

    As aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/utils.py:L325-399
    (get_qkv_padding) computes them.
    """
    heads_padded, kv_padded = round_up(heads, tp), kv
    if heads == kv or gqa != "replicated-heads":
        return heads_padded, kv_padded
    extra = heads_padded - heads
    ratio = heads // kv  # full replication: one K/V head per Q head
    if kv < tp and tp % kv == 0 and (heads % tp == 0 or (extra > 0 and extra % kv == 0)):
        ratio = tp // kv  # partial: just enough copies for one per core
    elif heads_padded / tp == heads / kv:
        ratio = 1
    kv_padded = max(kv * ratio, tp)
    if kv_padded == heads:
        kv_padded = heads_padded
    return heads_padded, kv_padded


def head_layout(arch: Arch, tp: int, gqa: str, batch_size: int) -> HeadLayout:
    """Padding and replication as the decoder layer's to_neuron() applies them.

    Replication first (`kv_heads_used` = kv_heads x ratio), then zero-padding: K/V heads that
    now match Q are padded like Q, and the cache rounds up to tp, so `kv_cache_heads` may
    exceed `kv_heads_used` (64 heads / 8 K/V at tp 12: 8x to 64, padded to 72)."""
    gqa, said = effective_gqa(arch, tp, gqa, batch_size)
    heads_padded, kv_padded = qkv_padding(arch.heads, arch.kv_heads, tp, gqa)
    kv, extra = arch.kv_heads, heads_padded - arch.heads
    used = kv
    # replication ratio: aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/
    # decoder.py:L1461-1495
    if kv_padded != kv:
        ratio = kv_padded // kv if kv_padded % kv == 0 else (kv_padded - extra) // kv
        if heads_padded == kv_padded and extra > 0:
            ratio = (kv_padded - extra) // kv
        used = kv_padded if ratio == 0 else kv * ratio
    # K/V weights that match Q are padded like Q (decoder.py:L1497-1502); the cache rounds up
    # to tp unless it is split over the batch (decoder.py:L1761-1768)
    weight_heads = heads_padded if used == arch.heads else used
    cache_heads = used if gqa == "shard-over-batch" else round_up(used, tp)
    return HeadLayout(arch.heads, kv, tp, gqa, heads_padded, used, weight_heads, cache_heads,
                      tuple(said))


def device_bytes_per_core(arch: Arch, layout: HeadLayout, amp: str, batch_size: int,
                          positions: int, weight_bytes: float | None = None,
                          kv_bytes: float | None = None) -> tuple[float, float]:
    """(weights, KV cache) bytes on each NeuronCore, padding included.

    The embedding stays on the host (no on_device_embedding); the MLP and the vocabulary are
    padded to multiples of tp (decoder.py:L1662-1670, L346-352). `weight_bytes`: the decoder
    layers' matrices quantized (1 byte for int8/fp8; the SDK quantizes attention and MLP,
    the LM head and norms stay at amp: decoder.py:L1581-L1614, L1672-L1683); `kv_bytes`: a
    quantized KV cache.
    """
    tp, d, h, b = layout.tp, arch.head_dim, arch.hidden, AMP_BYTES[amp]
    attn = arch.attn_params(layout.heads_padded, layout.kv_weight_heads)
    mlp = arch.mlp_params(round_up(arch.intermediate, tp))  # Mixtral: every expert's
    layers = arch.layers * (attn + mlp) * (b if weight_bytes is None else weight_bytes)
    sharded = layers + h * round_up(arch.vocab, tp) * b
    duplicated = (2 * arch.layers + 1) * h * b  # RMSNorm weights live on every core
    weights = sharded / tp + duplicated
    if layout.gqa == "shard-over-batch":  # kept only when batch_size divides by tp
        kv_elems = positions * (batch_size // tp) * layout.kv_cache_heads * d
    else:
        kv_elems = positions * batch_size * (layout.kv_cache_heads // tp) * d
    return weights, 2 * arch.layers * kv_elems * (b if kv_bytes is None else kv_bytes)


def token_buckets(max_length: int) -> list[int]:
    """Token-generation graphs for an integer n_positions: 128, 256, ... up to it.

    aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/bucket.py:L21-39 and
    utils.py:L59-66.
    """
    sizes, size = [], 128
    while size < max_length:
        sizes.append(size)
        size *= 2
    return sizes + [max_length]


@dataclass(frozen=True)
class HostMemory:
    """Host GiB at the two peaks of a worker start: loading weights, then compiling graphs."""

    workers: int
    fmt: str  # checkpoint format: how the real loader reads it
    load_gib: float  # all workers loading at once
    compile_gib: float  # one worker compiling, the others waiting
    graphs: int
    concurrent: int


def checkpoint_load_gib(arch: Arch, amp: str, fmt: str, largest_file: int) -> tuple[float, float]:
    """(peak while loading, held while another worker compiles) per worker, in GiB.

    Safetensors and the split directory load lazily, one layer at a time
    (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/module.py:L199-224,
    L63-85; llama/model.py:L115-193: materialize, to_neuron, nullify). A pytorch_model.bin is
    torch.load()ed whole into the CPU model at amp before to_neuron (module.py:L178-197,
    L118-127). The CPU embedding is float32 (no dtype: llama/modules.py:L40, module.py:L301-318).
    """
    a = AMP_BYTES[amp]
    src = DTYPE_BYTES.get(arch.source_dtype, a)
    embedding = arch.vocab * arch.hidden * 4
    model_amp = (arch.params - arch.vocab * arch.hidden) * a + embedding
    if fmt == "pytorch_model.bin":  # the whole file, freed tensor by tensor as it is copied
        return max(arch.params * src, model_amp) / GIB, model_amp / GIB
    if fmt == "pytorch_model.bin.index.json":  # one shard at a time into the full CPU model
        return (model_amp + largest_file) / GIB, model_amp / GIB
    # lazy: a materialized layer plus its padded, sharded copy on the way to the device
    chunk = max(arch.layer_params, arch.vocab * arch.hidden) * a
    return (embedding + 2 * chunk) / GIB, 0.0


def host_memory(arch: Arch, amp: str, workers: int, graphs: int, worker_count: int,
                fmt: str = "safetensors", largest_file: int = 0) -> HostMemory:
    """Estimate both peaks.

    to_neuron() loads the weights, then compiles every graph in a ProcessPoolExecutor of
    compilation_worker_count processes, all of them when it is unset
    (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/base.py:L55-64, L77-88).
    Workers starting together compile once under the cache lock and then all load.
    """
    peak, held = checkpoint_load_gib(arch, amp, fmt, largest_file)
    embedding = arch.vocab * arch.hidden * 4 / GIB
    concurrent = min(worker_count or graphs, graphs)
    load = HOST_RESERVED_GIB + workers * (WORKER_PROCESS_GIB + peak)
    compile_ = (HOST_RESERVED_GIB + WORKER_PROCESS_GIB + embedding
                + (workers - 1) * (WORKER_PROCESS_GIB + held)
                + concurrent * COMPILER_GIB_PER_GRAPH)
    return HostMemory(workers, fmt, load, compile_, graphs, concurrent)
