"""NeuronConfig and friends with the real constructor signatures (keyword-only)."""

from __future__ import annotations

from transformers_neuronx.constants import GQA, Layout


class ContinuousBatchingConfig:
    def __init__(self, batch_size_for_shared_caches):
        self.batch_size_for_shared_caches = batch_size_for_shared_caches


class GenerationConfig:
    def __init__(self, *, max_length=None, do_sample=False, top_k=50, top_p=1.0,
                 top_p_min_tokens=1, global_top_k=None, eos_token_id=None, temperature=1.0,
                 dynamic=False, deterministic=False):
        self.__dict__.update(locals())
        del self.__dict__["self"]


class NeuronConfig:
    def __init__(self, *, sparse_attn=None, quant=None, continuous_batching=None,
                 attention_layout=Layout.HSB, collectives_layout=Layout.HSB,
                 cache_layout=Layout.SBH, padding_side="left", group_query_attention=None,
                 sequence_parallel_norm=False, sequence_parallel_norm_threshold=2048,
                 on_device_embedding=False, on_device_generation=None, all_reduce_dtype=None,
                 cast_logits_dtype="float32", fuse_qkv=False, qkv_tiling=False,
                 weight_tiling=False, log_softmax_scores=False, shard_over_sequence=False,
                 output_all_logits=False, attn_output_transposed=False, **kwargs):
        if kwargs:  # the real class asserts the same
            raise AssertionError(f"Unexpected NeuronConfig keyword arguments: {kwargs}")
        if padding_side not in ("left", "right"):
            raise AssertionError(f"The `padding_side={padding_side}` argument must be either "
                                 "'left' or 'right'")
        if continuous_batching is not None and not isinstance(continuous_batching,
                                                              ContinuousBatchingConfig):
            raise TypeError("continuous_batching must be a ContinuousBatchingConfig")
        self.continuous_batching = continuous_batching
        self.group_query_attention = (GQA(group_query_attention)
                                      if group_query_attention is not None else None)
        self.padding_side = padding_side
        self.lhs_aligned = padding_side == "right" or continuous_batching is not None
        self.on_device_generation = on_device_generation
        self.cast_logits_dtype = cast_logits_dtype
        self.fuse_qkv = fuse_qkv
        self.attention_layout = attention_layout
        self.sparse_attn, self.quant = sparse_attn, quant

    @property
    def use_2d_cache_ids(self):
        return self.lhs_aligned

    def spec(self) -> dict:
        """What changes the compiled graph (used for the fake NEFF names)."""
        cb = self.continuous_batching
        return {"continuous_batching": cb.batch_size_for_shared_caches if cb else None,
                "gqa": self.group_query_attention.value if self.group_query_attention else None,
                "padding_side": self.padding_side, "fuse_qkv": self.fuse_qkv}
