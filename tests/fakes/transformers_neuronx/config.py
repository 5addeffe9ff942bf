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


class QuantizationConfig:
    """Weight quantization (config.py:L29-L55); dequant_dtype is not checked there."""

    def __init__(self, quant_dtype="s8", dequant_dtype="f16", quantize_method="vector_dynamic",
                 quantize_attn=True, no_quantize_list=[]):  # noqa: B006 (the real default)
        quant_dtypes, methods = ["s8", "f8e4m3fn"], ["vector_dynamic", "direct_cast"]
        self.quant_dtype = quant_dtype
        if self.quant_dtype not in quant_dtypes:  # config.py:L38-L40 (the line break's spaces too)
            raise NotImplementedError(f"{self.quant_dtype} is not implemented. {_GAP}Available "
                                      f"options are {','.join(quant_dtypes)}")
        self.dequant_dtype = dequant_dtype
        self.quantize_method = quantize_method
        if self.quantize_method not in methods:  # config.py:L46-L48
            raise NotImplementedError(f"{self.quantize_method} is not implemented. {_GAP}"
                                      f"Available options are {','.join(methods)}")
        self.quantize_attn = quantize_attn
        self.no_quantize_list = no_quantize_list

    def is_unit_scale(self, layer_num) -> bool:  # config.py:L54-L55
        return f"model.layers.{layer_num}" in self.no_quantize_list


class KVCacheQuantizationConfig:
    """KV-cache quantization, a cast without scales (config.py:L57-L71)."""

    def __init__(self, quant_dtype="s8", dequant_dtype="bf16", quantize_method="direct_cast"):
        quant_dtypes, methods = ["s8", "f16", "bf16", "f8e4m3fn"], ["direct_cast"]
        self.quant_dtype = quant_dtype
        if self.quant_dtype not in quant_dtypes:  # config.py:L64-L66
            raise NotImplementedError(f"{self.quant_dtype} is not implemented. Available options "
                                      f"are {','.join(quant_dtypes)}")
        self.dequant_dtype = dequant_dtype
        self.quantize_method = quantize_method
        if self.quantize_method not in methods:  # config.py:L69-L71
            raise NotImplementedError(f"{self.quantize_method} is not implemented.  Available "
                                      f"options are {','.join(methods)}")


#: the indentation a backslash line continuation leaves inside the real message (config.py:L39)
_GAP = " " * 38


class GenerationConfig:
    """On-device sampling settings (config.py:L106-L139). Validated against the batch size
    when the model compiles or updates them (validate_generation_configs, below)."""

    def __init__(self, *, max_length=None, do_sample=False, top_k=50, top_p=1.0,
                 top_p_min_tokens=1, global_top_k=None, eos_token_id=None, temperature=1.0,
                 dynamic=False, deterministic=False, per_batch_line=False):
        self.max_length, self.do_sample, self.per_batch_line = max_length, do_sample, per_batch_line
        self.top_k = top_k  # stored as given (config.py:L124)
        # floats, or lists of floats (config.py:L125-L126, L138-L139)
        self.top_p = [float(p) for p in top_p] if isinstance(top_p, list) else float(top_p)
        self.temperature = ([float(t) for t in temperature] if isinstance(temperature, list)
                            else float(temperature))
        self.top_p_min_tokens, self.global_top_k = top_p_min_tokens, global_top_k
        self.eos_token_id, self.dynamic, self.deterministic = eos_token_id, dynamic, deterministic

    def __eq__(self, value: object) -> bool:  # config.py:L133-L136 (so: unhashable)
        if not isinstance(value, GenerationConfig):
            return False
        return self.__dict__ == value.__dict__

    def spec(self) -> dict:
        """What the graph bakes in: the values too unless dynamic (generation.py:L32-L45,
        decoder.py:L368-L379)."""
        out = {"do_sample": self.do_sample, "dynamic": self.dynamic,
               "per_batch_line": self.per_batch_line, "global_top_k": self.global_top_k,
               "deterministic": self.deterministic}
        if not self.dynamic:
            out.update(top_k=self.top_k, top_p=self.top_p, temperature=self.temperature,
                       top_p_min_tokens=self.top_p_min_tokens)
        return out


def validate_generation_configs(new: GenerationConfig, current: GenerationConfig | None,
                                batch_size) -> None:
    """DecoderLmHead.validate_generation_configs (decoder.py:L1065-L1105): scalars broadcast to
    the batch under per_batch_line, lists refused without it; mutates `new` as the real one."""
    if current:  # decoder.py:L1067-L1070 (its message keeps the continuation lines' indent)
        gap = "\n" + " " * 13
        assert new.per_batch_line == current.per_batch_line, (
            f"Invalid new generation config. {gap}Recieved new generation config with "
            f"per_batch_line = {new.per_batch_line},{gap}while current generation config has "
            f"per_batch_line = {current.per_batch_line}")
    batch_size = batch_size if isinstance(batch_size, int) else batch_size[0]  # L1072
    names = ("top_k", "top_p", "temperature", "top_p_min_tokens")
    if new.per_batch_line:  # decoder.py:L1074-L1099
        for name in names:
            if not isinstance(getattr(new, name), list):
                setattr(new, name, [getattr(new, name)] * batch_size)
        k, p, t, m = (len(getattr(new, n)) for n in names)
        gap = " " * 19
        assert k == p == t == m == batch_size, (
            f"For per batch-line sampling, sampling parameters top_k, top_p, {gap}"
            f"top_p_min_tokens, temperature must be of same size as bach_size. \n {gap}"
            f"Recieved len(top_k):  {k} \n {gap}len(top_p): {p} \n {gap}"
            f"len(top_p_min_tokens): {m} \n {gap}len(temperature): {t} \n {gap}"
            f"batch_size: {batch_size}")
    else:  # decoder.py:L1100-L1105
        assert not any(isinstance(getattr(new, n), list) for n in names), (
            "Sampling parameters cannot be of type list when per_batch_line = False")


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
        out = {"continuous_batching": cb.max_num_seqs if cb else None,
               "gqa": gqa.value if gqa else None, "padding_side": self.padding_side,
               "fuse_qkv": self.fuse_qkv, "cast_logits_dtype": self.cast_logits_dtype}
        q, kv, gen = self.quant, self.kv_cache_quant, self.on_device_generation
        if q:  # weight dtypes and scale inputs (decoder.py:L1581-L1614); no_quantize_list only
            # changes scale values, not the graph (quantize.py:L88-L90)
            out["quant"] = [q.quant_dtype, q.dequant_dtype, q.quantize_method, q.quantize_attn]
        if kv:  # the cache buffers' dtype (decoder.py:L1327-L1330) and converts (hlo.py:L1691)
            out["kv_cache_quant"] = [kv.quant_dtype, kv.dequant_dtype, kv.quantize_method]
        if gen:  # token ids out instead of logits (generation.py:L17-L104)
            out["on_device_generation"] = gen.spec()
        if self.on_device_embedding:  # the embedding in the graph (decoder.py:L908-L915)
            out["on_device_embedding"] = True
        return out
