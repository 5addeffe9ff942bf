"""Head padding, K/V replication, buckets and host memory as transformers-neuronx does them.

Expected layouts were worked through the real code (aws-neuron/transformers-neuronx@1ade6d7:
src/transformers_neuronx/decoder.py:L100-176 check_gqa_fallback, utils.py:L325-399
get_qkv_padding, decoder.py:L1461-1502 replication, L1761-1768 cache heads).
"""

from __future__ import annotations

import pytest

from archive_tools.neuron_sizing import (
    COMPILER_GIB_PER_GRAPH,
    GIB,
    INSTANCES,
    Arch,
    device_bytes_per_core,
    effective_gqa,
    head_layout,
    host_memory,
    qkv_padding,
    token_buckets,
    tp_degrees_for,
)

L7 = Arch(32, 4096, 32, 32, 32000, 11008, 4096)
L70 = Arch(80, 8192, 64, 8, 32000, 28672, 4096)


@pytest.mark.parametrize("arch,tp,gqa,expect", [
    # (gqa in effect, Q heads padded, K/V heads used, K/V weight heads, K/V cache heads)
    (L70, 8, "", ("shard-over-heads", 64, 8, 8, 8)),
    (L70, 16, "", ("replicated-heads", 64, 16, 16, 16)),  # partial replication: 2x
    (L70, 24, "", ("replicated-heads", 72, 24, 24, 24)),  # the standard 70B deployment
    (L70, 12, "", ("replicated-heads", 72, 64, 72, 72)),  # 12 % 8: full replication
    (L70, 24, "replicated-heads", ("replicated-heads", 72, 24, 24, 24)),
    (L7, 8, "", ("", 32, 32, 32, 32)),
    (L7, 24, "", ("", 48, 32, 48, 48)),  # MHA: K/V padded like Q
    (L7, 12, "", ("", 36, 32, 36, 36)),
])
def test_head_layout_matches_the_library(arch: Arch, tp: int, gqa: str, expect: tuple) -> None:
    lay = head_layout(arch, tp, gqa, batch_size=1)
    assert (lay.gqa, lay.heads_padded, lay.kv_heads_used, lay.kv_weight_heads,
            lay.kv_cache_heads) == expect


def test_padding_and_replication_ratios() -> None:
    lay = head_layout(L70, 24, "", 8)
    assert lay.padding == pytest.approx(0.125) and lay.replication == 3


@pytest.mark.parametrize("gqa,batch,expect", [
    ("shard-over-batch", 8, "shard-over-batch"),
    ("shard-over-batch", 4, "shard-over-heads"),  # batch % tp: falls back, warns
    ("all-gather-heads", 4, "all-gather-heads"),
])
def test_gqa_fallbacks(gqa: str, batch: int, expect: str) -> None:
    arch = Arch(32, 4096, 32, 8, 128256, 14336, 8192)
    got, said = effective_gqa(arch, 8, gqa, batch)
    assert got == expect and bool(said) == (expect != gqa)


def test_qkv_padding_without_replication_keeps_kv_heads() -> None:
    assert qkv_padding(64, 8, 24, "shard-over-heads") == (72, 8)
    assert qkv_padding(64, 8, 24, "replicated-heads") == (72, 24)


def test_device_memory_counts_padded_heads_and_replicated_cache() -> None:
    w24, kv24 = device_bytes_per_core(L70, head_layout(L70, 24, "", 8), "bf16", 8, 4096)
    w8, kv8 = device_bytes_per_core(L70, head_layout(L70, 8, "", 8), "bf16", 8, 4096)
    assert w24 > w8 / 3  # 72 padded heads cost more than a third of 64 over 8 cores
    assert kv24 == kv8  # one K/V head per core either way: 2 x 80 x 8 x 4096 x 128 x 2 bytes
    assert kv8 == 2 * 80 * 8 * 4096 * 128 * 2


@pytest.mark.parametrize("max_length,buckets", [
    (4096, [128, 256, 512, 1024, 2048, 4096]), (2048, [128, 256, 512, 1024, 2048]),
    (1000, [128, 256, 512, 1000]), (100, [100]),
])
def test_token_buckets_double_from_128(max_length: int, buckets: list[int]) -> None:
    assert token_buckets(max_length) == buckets


def test_tp_degrees_per_instance() -> None:
    assert tp_degrees_for(INSTANCES["inf2.xlarge"]) == [1, 2]
    assert tp_degrees_for(INSTANCES["inf2.24xlarge"]) == [1, 2, 4, 8, 12]
    assert tp_degrees_for(INSTANCES["inf2.48xlarge"]) == [1, 2, 4, 8, 12, 24]
    assert {n: i.host_gib for n, i in INSTANCES.items()} == {
        "inf2.xlarge": 16, "inf2.8xlarge": 128, "inf2.24xlarge": 384, "inf2.48xlarge": 768}


def test_compile_memory_grows_with_graphs_compiled_at_once() -> None:
    one = host_memory(L7, "bf16", workers=1, graphs=10, worker_count=1)
    every = host_memory(L7, "bf16", workers=1, graphs=10, worker_count=0)
    four = host_memory(L7, "bf16", workers=1, graphs=10, worker_count=4)
    assert (one.concurrent, four.concurrent, every.concurrent) == (1, 4, 10)
    assert every.compile_gib - one.compile_gib == pytest.approx(9 * COMPILER_GIB_PER_GRAPH)
    assert one.load_gib == every.load_gib


def test_eager_bin_loads_the_whole_model_per_worker() -> None:
    lazy = host_memory(L70, "bf16", 1, 10, 1, "model.safetensors.index.json")
    eager = host_memory(L70, "bf16", 1, 10, 1, "pytorch_model.bin")
    sharded = host_memory(L70, "bf16", 1, 10, 1, "pytorch_model.bin.index.json", 10 * GIB)
    assert lazy.load_gib < 10  # one layer at a time
    assert eager.load_gib > 128  # 69e9 params x 2 bytes
    assert sharded.load_gib == pytest.approx(eager.load_gib + 10, abs=0.5)
    two = host_memory(L70, "bf16", 2, 10, 1, "pytorch_model.bin")
    assert two.compile_gib - eager.compile_gib > 128  # a waiting worker holds its CPU model
