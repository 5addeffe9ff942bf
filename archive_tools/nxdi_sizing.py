"""How NxD Inference lays a Llama model out on Inf2, and what `validate` checks for it.

Pure arithmetic after the real library's rules, each cited at aws-neuron/
neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/. The memory
figures are estimates (not measured on Inf2) and the messages say so.
"""

from __future__ import annotations

from dataclasses import dataclass

from archive_tools.neuron_sizing import (
    AMP_BYTES,
    GIB,
    HOST_RESERVED_GIB,
    WORKER_PROCESS_GIB,
    Arch,
    round_up,
)

CORE_MEMORY = 16 * 2**30  # bytes of device memory per NeuronCore (32 GiB per Inferentia2 chip)
HEADROOM = 0.15  # runtime, scratchpad, collectives and I/O buffers


@dataclass(frozen=True)
class NxdiHeads:
    heads: int
    kv_heads: int
    tp: int
    heads_padded: int
    kv_heads_used: int
    strategy: str  # "", "replicate-to-tp-degree" or "convert-to-mha"


def nxdi_heads(arch: Arch, tp: int) -> NxdiHeads:
    """Q heads padded to a multiple of tp; K/V heads replicated to tp when tp is a multiple
    of them, else converted to MHA with a warning (modules/attention/gqa.py:L89-L127; the
    padding is neuronx-distributed's get_number_of_extra_heads, taken as round-up to tp)."""
    padded = round_up(arch.heads, tp)
    if arch.heads == arch.kv_heads:
        return NxdiHeads(arch.heads, arch.kv_heads, tp, padded, padded, "")
    if arch.kv_heads >= tp and arch.kv_heads % tp == 0:
        return NxdiHeads(arch.heads, arch.kv_heads, tp, padded, arch.kv_heads, "")
    if tp % arch.kv_heads == 0:
        return NxdiHeads(arch.heads, arch.kv_heads, tp, padded, tp, "replicate-to-tp-degree")
    return NxdiHeads(arch.heads, arch.kv_heads, tp, padded, padded, "convert-to-mha")


def head_warnings(h: NxdiHeads) -> list[str]:
    out = []
    if h.heads_padded != h.heads:
        out.append(f"tp_degree {h.tp}: {h.heads} attention heads are padded to {h.heads_padded} "
                   f"({h.heads_padded - h.heads} zero heads, "
                   f"+{h.heads_padded / h.heads - 1:.1%} attention weights and compute)")
    if h.strategy == "convert-to-mha":
        out.append(f"tp_degree {h.tp}: {h.kv_heads} K/V heads do not divide over {h.tp} cores "
                   f"and {h.tp} is no multiple of them; NxD Inference converts to MHA "
                   f"({h.kv_heads_used} K/V heads, {h.kv_heads_used / h.kv_heads:g}x the KV "
                   "cache)")
    elif h.strategy == "replicate-to-tp-degree" and h.kv_heads_used != h.kv_heads:
        out.append(f"tp_degree {h.tp}: {h.kv_heads} K/V heads are replicated to {h.tp} (one per "
                   f"NeuronCore, {h.tp / h.kv_heads:g}x the KV cache)")
    return out


def device_bytes_per_core(arch: Arch, h: NxdiHeads, amp: str, batch: int,
                          max_length: int, weight_bytes: float | None = None,
                          kv_bytes: float | None = None) -> tuple[float, float]:
    """(weights, KV cache) bytes on one NeuronCore: every weight sharded over tp, one KV-cache
    line of max_length positions per batch slot (kv_cache_batch_size = batch_size,
    models/config.py:L167). `weight_bytes`: the decoder layers' linear weights quantized
    (the LM head too unless in modules_to_not_convert; counted at amp here, the larger);
    `kv_bytes`: a quantized KV cache."""
    b, d = AMP_BYTES[amp], arch.head_dim
    q = b if weight_bytes is None else weight_bytes
    attn = arch.attn_params(h.heads_padded, h.kv_heads_used)
    layer = (attn + arch.mlp_params()) * q + 2 * arch.hidden * b  # Mixtral: every expert's
    # the embedding and the LM head both on the device (tied ones as a copy: see Arch)
    weights = (arch.layers * layer + (2 * arch.vocab * arch.hidden + arch.hidden) * b) / h.tp
    kv = (2 * arch.layers * batch * max_length * max(h.kv_heads_used // h.tp, 1) * d
          * (b if kv_bytes is None else kv_bytes))
    return weights, kv


def host_load_gib(arch: Arch, amp: str, workers: int) -> float:
    """Host memory while workers start together: each reads the checkpoint's state dict and
    shards it on the host at every load (application_base.py:L403-L405), so about twice the
    weights per worker, plus the process and the OS."""
    lm_head_copy = arch.vocab * arch.hidden if arch.tied_embeddings else 0  # see Arch
    weights = (arch.params + lm_head_copy) * AMP_BYTES[amp] / GIB
    return workers * (2 * weights + WORKER_PROCESS_GIB) + HOST_RESERVED_GIB
