"""Fake LlamaForSampling: the real signatures and rules, computed on CPU with transformers.

Lenient where the real class is: unknown constructor keywords are swallowed, attention
heads that tp_degree does not divide are padded, K/V heads are replicated with a
warning. Strict where it is: see base.py (inputs, serialization) and config.py.
Features the fake does not simulate raise NotImplementedError (a fake limit, not a
library rule). Citations are to
aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/.
"""

from __future__ import annotations

import copy
import warnings

import torch

from transformers_neuronx import bucket
from transformers_neuronx.base import NeuronModelBase
from transformers_neuronx.config import NeuronConfig
from transformers_neuronx.constants import GQA

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
NOT_SIMULATED = ("sparse_attn", "quant", "kv_cache_quant", "on_device_generation",
                 "shard_over_sequence", "output_all_logits", "log_softmax_scores",
                 "is_eagle_target", "is_eagle_draft", "sequence_parallel_norm")


def _gqa_fallback(nc: NeuronConfig, n_head: int, n_kv: int, tp: int, batch_sizes: list[int],
                  head_size: int) -> None:
    """Pick a GQA sharding that works, warning when it changes (decoder.py:L100-L176)."""
    gqa = nc.group_query_attention
    if gqa is None:
        if n_head == n_kv:
            return  # MHA: Q heads are padded to a multiple of tp, silently (utils.py:L325-L399)
        nc.group_query_attention = GQA.SHARD_OVER_HEADS
    if gqa == GQA.REPLICATED_HEADS:
        return
    if gqa == GQA.SHARD_OVER_BATCH:
        bad = [b for b in batch_sizes if b % tp]
        for b in bad:
            warnings.warn(f'Cannot enable "{gqa}" when a batch size ({b} in {batch_sizes}) is not '
                          f"evenly divisible by the tensor parallel degree ({tp})", stacklevel=3)
            nc.group_query_attention = GQA.SHARD_OVER_HEADS
        if not bad:
            return
    if gqa == GQA.ALL_GATHER_HEADS:
        if (n_kv * head_size) % tp:
            warnings.warn(f'Cannot enable "{gqa}" when the hidden size of KV ({n_kv} x '
                          f"{head_size}) is not evenly divisible by the tensor parallel degree "
                          f"({tp})", stacklevel=3)
            nc.group_query_attention = GQA.SHARD_OVER_HEADS
        if n_head % tp == 0 or (-n_head % tp) % n_kv == 0:
            return
        warnings.warn(f'Cannot enable "{gqa}" when the number of padding {-n_head % tp} need for '
                      f"query attention heads ({n_head}) with the tensor parallel degree ({tp}) "
                      f"is not divisible by KV heads ({n_kv})", stacklevel=3)
        nc.group_query_attention = GQA.SHARD_OVER_HEADS
    if n_kv % tp:
        warnings.warn(f"KV head replication will be enabled since the number of KV heads ({n_kv}) "
                      f"is not evenly divisible by the tensor parallel degree ({tp})", stacklevel=3)
        nc.group_query_attention = GQA.REPLICATED_HEADS


class LlamaForSampling(NeuronModelBase):
    # unknown keywords land in **kwargs and are ignored (llama/model.py:L32-L34)
    def __init__(self, config, *, n_positions=2048, batch_size=1, amp="f32", tp_degree=2,
                 context_length_estimate=None, context_unroll=None, unroll=None,
                 neuron_config=None, prefixed_length=0, **kwargs):
        scaling = getattr(config, "rope_scaling", None)  # llama/config.py:L45-L48
        kind = scaling.get("rope_type", scaling.get("type")) if scaling is not None else None
        if scaling is not None and kind not in {"default", "llama3"}:
            raise ValueError("Only default and llama3 ropes scaling types are currently "
                             f"supported. Received {kind}")
        self.rope_theta = getattr(config, "rope_theta", 10000)  # llama/config.py:L43
        self.dtype = {**DTYPES, "s8": None, "f8e4m3fn": None}[amp]  # KeyError (dtypes.py:L18-L26)
        if self.dtype is None:
            raise NotImplementedError(f"fake: amp {amp!r} is not simulated")
        self.neuron_config = neuron_config if neuron_config else NeuronConfig()  # L40
        nc = self.neuron_config
        used = [f for f in NOT_SIMULATED if getattr(nc, f, None)]
        if used or prefixed_length or nc.use_1d_query or nc.on_device_embedding:
            raise NotImplementedError(f"fake: {used or 'this NeuronConfig'} is not simulated")
        self.config, self.amp, self.tp_degree = config, amp, tp_degree
        self.token_buckets = bucket.token_sizes(n_positions)  # llama/model.py:L68-L69
        self.context_buckets = bucket.context_sizes(context_length_estimate, self.token_buckets)
        self.batch_sizes = bucket.batch_sizes(batch_size)  # llama/model.py:L83-L85
        self.batch_size = self.batch_sizes[-1]
        self.context_batch_sizes = [1] if nc.continuous_batching else self.batch_sizes
        n_head = config.num_attention_heads
        n_kv = getattr(config, "num_key_value_heads", None) or n_head
        _gqa_fallback(nc, n_head, n_kv, tp_degree, self.batch_sizes,
                      config.hidden_size // n_head)
        self._weights = self._load_dir = self._neffs = self._hf = None
        self._kv: dict[int, list[list[int]]] = {}
        self.inference_modes: list[bool] = []  # test hook: inference_mode() on each forward

    def _build_hf(self, weights):
        # the rotary theta the real library reads, even where transformers 5 keeps it only in
        # rope_parameters (llama/config.py:L43)
        cfg = copy.deepcopy(self._checkpoint_config)
        if isinstance(getattr(cfg, "rope_parameters", None), dict):
            cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": self.rope_theta}
        self._checkpoint_config = cfg
        return super()._build_hf(weights)

    def forward(self, input_ids, cache_ids=None, start_ids=None, last_token_id=None,
                input_embeddings=None, **kwargs):
        self.inference_modes.append(torch.is_inference_mode_enabled())
        if last_token_id is not None or input_embeddings is not None or kwargs:
            raise NotImplementedError("fake: pre-embedded inputs and paged attention")
        plan = self._prepare(input_ids, cache_ids, start_ids)  # host-side rules first
        self._ready()
        return self._run(plan)

    __call__ = forward  # the real model is a torch.nn.Module

    def sample(self, input_ids, sequence_length, cache_ids=None, start_ids=None, top_k=50,
               top_p=1.0, eos_token_override=None, temperature=1.0, streamer=None,
               stopping_criteria_list=None, no_repeat_ngram_size=None, **kwargs):
        """The real sample_llama loop (sampling.py:L311-L395); extra keywords are ignored."""
        batch, context_length = input_ids.shape
        if batch not in self.batch_sizes:  # llama/model.py:L416-L419
            raise ValueError(f"Model not compiled for batch_size : {batch}. Acceptable "
                             f"batch_size is one of the following {self.batch_sizes}")
        if no_repeat_ngram_size:
            raise NotImplementedError("fake: no_repeat_ngram_size")
        _check_top_k_top_p(top_k, top_p)
        eos = self.config.eos_token_id if eos_token_override is None else eos_token_override
        with torch.no_grad():  # @torch.no_grad() on sample_llama (sampling.py:L381)
            scores = self(input_ids, cache_ids, start_ids)
            if cache_ids is not None and self.neuron_config.use_2d_cache_ids:
                cache_ids = cache_ids.max(dim=1, keepdim=True).values
            return self._sample_loop(input_ids, start_ids, scores, sequence_length, eos, top_k,
                                     top_p, temperature, streamer, stopping_criteria_list,
                                     cache_ids)

    def _sample_loop(self, input_ids, start_ids, scores, sequence_length, eos, top_k, top_p,
                     temperature, streamer, criteria, cache_ids):
        if not isinstance(temperature, float) or not temperature > 0:  # sampling.py:L315-L316
            raise ValueError("temperature has to be a strictly positive float.")
        eos_ids = torch.tensor([eos] if isinstance(eos, int) else eos, dtype=torch.int32)
        done = torch.full((input_ids.size(0), 1), False)
        tokens = [input_ids]
        start = input_ids.shape[1]
        if cache_ids is None:
            cache_ids = torch.as_tensor([start - 1], dtype=torch.int32)
        else:
            start = int(max(cache_ids.flatten())) + 1
        for current in range(start, sequence_length):  # sampling.py:L332-L373
            if temperature != 1.0:
                scores = scores / temperature
            values, indices = torch.topk(scores, min(top_k, scores.shape[-1]))
            probs = torch.softmax(values, dim=-1, dtype=torch.float32)
            if top_p < 1.0:  # keep the smallest prefix whose mass reaches top_p
                cum = torch.cumsum(probs, dim=-1)
                probs = torch.where(cum - probs < top_p, probs, torch.zeros_like(probs))
            inputs = torch.gather(indices, 1, torch.multinomial(probs, 1, replacement=True))
            is_eos = torch.isin(inputs, eos_ids)
            done = done | is_eos
            token = torch.where(done & ~is_eos, eos_ids[0], inputs)
            tokens.append(token)
            if streamer is not None and getattr(streamer, "response_with_prefix", False):
                streamer.put(torch.cat(tokens, dim=-1))
            elif streamer:
                streamer.put(token)
            if current + 1 > sequence_length or bool(done.all()):
                break
            if criteria is not None and criteria(input_ids, probs):
                break
            cache_ids = cache_ids + 1
            scores = self(inputs, cache_ids, start_ids)
        if streamer:
            streamer.end()
        return torch.cat(tokens, dim=-1)


def _check_top_k_top_p(top_k, top_p) -> None:
    # sampling.py:L183-L189
    if top_k is not None and (not isinstance(top_k, int) or not top_k > 0):
        raise ValueError("top_k has to be a strictly positive int.")
    if top_p is not None and (not isinstance(top_p, float) or not 0.0 < top_p <= 1.0):
        raise ValueError("top_p has to be a strictly positive float that less than or equal "
                         "to 1.0.")
