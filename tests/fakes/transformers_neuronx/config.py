"""NeuronConfig and friends with the real signatures, defaults and asserts.

Every rule cites aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/config.py.
"""

from __future__ import annotations

import warnings

from transformers_neuronx.constants import GQA, Layout

VALID_DTYPES = ("float32", "float16", "bfloat16")


class ContinuousBatchingConfig:
    """Keyword-only; max_num_seqs, else batch_size_for_shared_caches (config.py:L78-L87)."""

    def __init__(self, **kwargs):
        def take(name, default):
            return kwargs.pop(name) if kwargs.get(name) is not None else default

        # neither given: KeyError 'batch_size_for_shared_caches' (config.py:L79)
        self.max_num_seqs = (kwargs.pop("max_num_seqs") if kwargs.get("max_num_seqs") is not None
                             else kwargs.pop("batch_size_for_shared_caches"))
        self.max_model_len = take("max_model_len", None)
        self.optimized_paged_attention = take("optimized_paged_attention", False)
        self.enable_chunked_prefill = take("enable_chunked_prefill", False)
        if self.enable_chunked_prefill:  # config.py:L83-L84
            assert self.optimized_paged_attention, ("chunked prefill is only supported with "
                                                    "optimized paged attention")
        self.block_size = None
        self.num_blocks = None
        assert len(kwargs) == 0, f"unexpected key word arguments: {kwargs.keys()}"  # config.py:L87

    @property
    def batch_size_for_shared_caches(self) -> int:  # config.py:L89-L91
        return self.max_num_seqs

    @property
    def _paged_attention(self) -> bool:  # config.py:L93-L98
        return bool(self.block_size and self.max_model_len and self.block_size < self.max_model_len)


class GenerationConfig:
    """On-device sampling settings (config.py:L108-L131); the fake does not run them."""

    def __init__(self, *, max_length=None, do_sample=False, top_k=50, top_p=1.0,
                 top_p_min_tokens=1, global_top_k=None, eos_token_id=None, temperature=1.0,
                 dynamic=False, deterministic=False, per_batch_line=False):
        self.max_length, self.do_sample, self.per_batch_line = max_length, do_sample, per_batch_line
        self.top_k, self.top_p, self.temperature = top_k, top_p, temperature
        self.top_p_min_tokens, self.global_top_k = top_p_min_tokens, global_top_k
        self.eos_token_id, self.dynamic, self.deterministic = eos_token_id, dynamic, deterministic


class NeuronConfig:
    """The real keyword set (config.py:L206-L241); unknown names fail its final assert."""

    def __init__(self, *, sparse_attn=None, quant=None, kv_cache_quant=None,
                 continuous_batching=None, attention_layout=Layout.HSB,
                 collectives_layout=Layout.HSB, cache_layout=Layout.SBH, padding_side="left",
                 group_query_attention=None, sequence_parallel_norm=False,
                 sequence_parallel_norm_threshold=2048, bf16_rms_norm=False,
                 on_device_embedding=False, on_device_generation=None, all_reduce_dtype=None,
                 cast_logits_dtype="float32", fuse_qkv=False, qkv_tiling=False,
                 weight_tiling=False, mlp_in_weight_tiling_permute_order=(1, 2, 0, 3),
                 mlp_out_weight_tiling_permute_order=(1, 2, 0, 3), log_softmax_scores=False,
                 shard_over_sequence=False, output_all_logits=False, attn_output_transposed=False,
                 fused_rmsnorm_qkv=False, fused_rmsnorm_mlp=False, mlp_out_weight_transpose=False,
                 fuse_mlp=False, is_eagle_target=False, is_eagle_draft=False,
                 has_pre_attention_norm=True, compilation_worker_count=None,
                 duplicate_q_weight_sos=False, **kwargs):
        # config.py:L248-L250
        assert cast_logits_dtype in VALID_DTYPES, (
            f"The `cast_logits_dtype={cast_logits_dtype}` argument must be one of "
            f"{list(VALID_DTYPES)}")
        # config.py:L255-L257
        assert padding_side in ["left", "right"], (
            f"The `padding_side={padding_side}` argument must be either 'left' or 'right'")
        self.lhs_aligned = padding_side == "right"
        for old in ("use_2d_cache_ids", "lhs_aligned"):  # deprecated aliases (config.py:L260-L271)
            if old in kwargs:
                warnings.warn(f"NeuronConfig `{old}` argument is deprecated. Please specify "
                              "`padding_side = 'right'`.", stacklevel=2)
                self.lhs_aligned = kwargs.pop(old, False)
        self.continuous_batching = continuous_batching
        self.padding_side = padding_side
        if self.continuous_batching:  # forced right padding (config.py:L272-L275)
            self.lhs_aligned = True
            self.padding_side = "right"
        self.group_query_attention = (GQA(group_query_attention)  # config.py:L280-L282
                                      if group_query_attention is not None else None)
        # config.py:L285-L287
        assert sequence_parallel_norm_threshold > 0, (
            f"sequence_parallel_norm_threshold={sequence_parallel_norm_threshold} must be "
            "greater than zero")
        if qkv_tiling:  # config.py:L292-L295
            assert fuse_qkv is True, ("QKV weight tiling is currently only supported when QKV "
                                      "fusion is enabled.")
        for order in (mlp_in_weight_tiling_permute_order, mlp_out_weight_tiling_permute_order):
            assert list(order).index(2) < list(order).index(3), (  # config.py:L301-L305
                "original dim 2 has to be front of dim 3 after applying the permute order")
        assert len(kwargs) == 0, f"Unexpected NeuronConfig keyword arguments: {kwargs}"  # L315-L317
        if shard_over_sequence:  # config.py:L353-L356
            assert sparse_attn is None, "sparse attn is not supported with flash decoding"
            if not (continuous_batching and continuous_batching.optimized_paged_attention):
                assert cache_layout == Layout.SBH, ("flash decoding only support SBH layout , "
                                                    f"got {cache_layout}")
        self.sparse_attn, self.quant, self.kv_cache_quant = sparse_attn, quant, kv_cache_quant
        self.attention_layout, self.collectives_layout = attention_layout, collectives_layout
        self.cache_layout = cache_layout
        self.sequence_parallel_norm = sequence_parallel_norm
        self.sequence_parallel_norm_threshold = sequence_parallel_norm_threshold
        self.bf16_rms_norm, self.on_device_embedding = bf16_rms_norm, on_device_embedding
        self.on_device_generation, self.all_reduce_dtype = on_device_generation, all_reduce_dtype
        self.cast_logits_dtype, self.fuse_qkv, self.fuse_mlp = cast_logits_dtype, fuse_qkv, fuse_mlp
        self.qkv_tiling, self.weight_tiling = qkv_tiling, weight_tiling
        self.log_softmax_scores, self.output_all_logits = log_softmax_scores, output_all_logits
        self.shard_over_sequence = shard_over_sequence
        self.attn_output_transposed = attn_output_transposed
        self.is_eagle_target, self.is_eagle_draft = is_eagle_target, is_eagle_draft
        self.compilation_worker_count = compilation_worker_count

    @property
    def use_2d_cache_ids(self) -> bool:  # config.py:L365-L367
        return self.lhs_aligned

    @property
    def vectorize_last_token_id(self) -> bool:  # config.py:L392-L394
        return self.lhs_aligned

    @property
    def use_1d_query(self) -> bool:  # config.py:L369-L371
        return self.cache_layout == Layout.BSH and self.padding_side == "right"

    @property
    def paged_attention(self) -> bool:  # config.py:L373-L377
        cb = self.continuous_batching
        return bool(cb and cb._paged_attention and self.cache_layout == Layout.BSH)

    def spec(self) -> dict:
        """What changes the compiled graph (names the fake's NEFF files)."""
        cb = self.continuous_batching
        gqa = self.group_query_attention
        return {"continuous_batching": cb.max_num_seqs if cb else None,
                "gqa": gqa.value if gqa else None, "padding_side": self.padding_side,
                "fuse_qkv": self.fuse_qkv, "cast_logits_dtype": self.cast_logits_dtype}
