"""The fake's decoder models (LlamaForSampling, MistralForSampling, MixtralForSampling): the
real signatures and rules, computed on CPU with transformers.

The three real classes are separate NeuronModelBase subclasses with the same constructor,
decoder (DecoderLmHeadForSamplingNoEmbedding: GQA fallback, padding, buckets), forward and
on-device generation; what differs (config reads, RoPE, attention, weights) is in
llama/, mistral/ and mixtral/model.py. Lenient where the real class is: unknown
constructor keywords are swallowed, attention heads that tp_degree does not divide are
padded, K/V heads are replicated with a warning. Strict where it is: see base.py
(inputs, serialization) and config.py. Quantized weights are rounded at load as the
real quantizer rounds them (held dequantized), a quantized KV cache is a cast of the
cached positions, and on-device generation returns token ids sampled with each line's
(seq id's) parameters. Features the fake does not simulate raise NotImplementedError (a
fake limit, not a
library rule). Citations are to
aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/.
"""

from __future__ import annotations

import copy
import warnings

import torch

from transformers_neuronx import bucket
from transformers_neuronx.base import DecoderLmHead, NeuronModelBase
from transformers_neuronx.config import NeuronConfig, validate_generation_configs
from transformers_neuronx.constants import GQA, FpBounds

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
#: dtypes.to_torch_dtype (dtypes.py:L18-L26)
TORCH_DTYPES = {**DTYPES, "s8": torch.int8, "f8e4m3fn": torch.float8_e4m3fn}
NOT_SIMULATED = ("sparse_attn", "shard_over_sequence", "output_all_logits", "log_softmax_scores",
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


class DecoderForSampling(NeuronModelBase):
    #: the transformers class the fake computes with
    HF_CLASS = "LlamaForCausalLM"
    #: the theta the config class reads when config.json has none (llama/config.py:L43)
    ROPE_THETA_DEFAULT = 10000

    # unknown keywords land in **kwargs and are ignored (llama/model.py:L32-L34)
    def __init__(self, config, *, n_positions=2048, batch_size=1, amp="f32", tp_degree=2,
                 context_length_estimate=None, context_unroll=None, unroll=None,
                 neuron_config=None, prefixed_length=0, **kwargs):
        self.rope_theta = getattr(config, "rope_theta", self.ROPE_THETA_DEFAULT)
        self.dtype = {**DTYPES, "s8": None, "f8e4m3fn": None}[amp]  # KeyError (dtypes.py:L18-L26)
        if self.dtype is None:
            raise NotImplementedError(f"fake: amp {amp!r} is not simulated")
        self.neuron_config = neuron_config if neuron_config else NeuronConfig()  # L40
        nc = self.neuron_config
        if nc.on_device_generation:  # llama/model.py:L54-L55
            nc.on_device_generation.vocab_size = config.vocab_size
        used = [f for f in NOT_SIMULATED if getattr(nc, f, None)]
        if used or prefixed_length or nc.use_1d_query:
            raise NotImplementedError(f"fake: {used or 'this NeuronConfig'} is not simulated")
        # on_device_embedding only moves the embedding into the graph (llama/model.py:L279-L288):
        # the same token ids go in, so the fake computes the same; it is in the NEFF names
        self.config, self.amp, self.tp_degree = config, amp, tp_degree
        self.token_buckets = bucket.token_sizes(n_positions)  # llama/model.py:L68-L69
        # what FusedSpeculativeDecoder reads of the token decoder (llama/model.py:L99-L108)
        self.decoder_lm_head = DecoderLmHead(tp_degree, self.token_buckets)
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
        self._sampling: dict[str, list] | None = None  # the device's dynamic parameters
        self._rng = torch.Generator()
        self._rng.seed()  # the device draws with its own RNG, no seed input (hlo.py:L2422-L2456)
        self.sampled: list[tuple[int, int, float, float]] = []  # test hook: (line, k, p, t)

    def _build_hf(self, weights):
        # the rotary theta the real library reads, even where transformers 5 keeps it only in
        # rope_parameters (llama/config.py:L43)
        cfg = copy.deepcopy(self._checkpoint_config)
        if isinstance(getattr(cfg, "rope_parameters", None), dict):
            cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": self.rope_theta}
        self._checkpoint_config = cfg
        hf = super()._build_hf(weights)
        if self.neuron_config.kv_cache_quant:
            for layer in hf.model.layers:
                for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.register_forward_hook(self._kv_cache_round_trip)
        return hf

    # --- quantization ----------------------------------------------------------------------
    #: per layer: the checkpoint weights quantized as attention (q/k/v/o, decoder.py:
    #: L1591-L1614) and as MLP extras (decoder.py:L1672-L1683), with the dimension their
    #: scales are taken over (the contracted one: 1 for an HF [out, in] weight)
    ATTENTION_WEIGHTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                         "self_attn.o_proj")
    MLP_WEIGHTS: tuple[tuple[str, int], ...] = (("mlp.gate_proj", 1), ("mlp.up_proj", 1),
                                                ("mlp.down_proj", 1))
    #: whether the class passes is_unit_scale to its layers (llama/model.py:L124-L128)
    UNIT_SCALE_LAYERS = True

    def _check_active_tokens(self, n_active: int, n_positions: int) -> None:
        """What the attention HLO builds for n_active tokens at once: Llama's any number."""

    def _mlp_weights(self, layer_id: int) -> list[tuple[str, int]]:
        return list(self.MLP_WEIGHTS)

    def _quantize_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """load_weights (llama/model.py:L115-L192): each layer's attention, then MLP weights,
        quantized as DecoderLayer.to_neuron does (decoder.py:L1581-L1614, L1672-L1683), and
        held dequantized in float32 here: the device converts them to the activations' dtype
        and rescales after the dot (hlo.py:L323-L333, L1681-L1689)."""
        q = self.neuron_config.quant
        if not q:
            return
        for layer_id in range(self.config.num_hidden_layers):
            prefix = f"model.layers.{layer_id}."
            unit = q.is_unit_scale(layer_id) if self.UNIT_SCALE_LAYERS else False
            if q.quantize_attn:  # q/k/v/o without is_unit_scale (decoder.py:L1591-L1614)
                assert "self_attn" not in q.no_quantize_list, ("self attn quantization not "
                                                               "allowed for this model")
                for name in self.ATTENTION_WEIGHTS:
                    key = f"{prefix}{name}.weight"
                    tensors[key] = _quantized(tensors[key], q, False)
            for name, dim in self._mlp_weights(layer_id):  # extras (L1672-L1683)
                key = f"{prefix}{name}.weight"
                tensors[key] = _quantized(tensors[key], q, unit, dim)

    def _kv_cache_round_trip(self, module, inputs, output):
        """K/V of cached positions went through the cache's dtype and back: Convert, no scale
        (layers/attention.py:L232-L234, llama/hlo.py:L614-L626, hlo.py:L1691-L1701). Fake:
        cast before the rotary embedding; the real cache holds K after it."""
        kv = self.neuron_config.kv_cache_quant
        if not self._cached:
            return output
        out = output.clone()
        prior = out[:, : self._cached]
        prior = prior.to(TORCH_DTYPES[kv.quant_dtype]).to(TORCH_DTYPES[kv.dequant_dtype])
        out[:, : self._cached] = prior.to(output.dtype)
        return out

    # --- on-device generation --------------------------------------------------------------
    def _build_graphs(self) -> None:
        """What building the HLO checks, at compile and at load (the NEFF name is its hash)."""
        nc = self.neuron_config
        dequant = [nc.kv_cache_quant.dequant_dtype] if nc.kv_cache_quant else []
        if nc.quant and nc.quant.quantize_method == "vector_dynamic":  # with scales only
            dequant.append(nc.quant.dequant_dtype)
        for name in dequant:  # getattr(scribe, dequant_dtype) (hlo.py:L1684, L1699); inferred:
            if name not in TORCH_DTYPES:  # a name the scribe lacks fails building the graph
                raise AttributeError(f"scribe has no dtype {name!r}")
        gen = nc.on_device_generation
        if not gen:
            return
        # DecoderLmHead.to_neuron validates against itself (decoder.py:L343-L346)
        validate_generation_configs(gen, gen, self.batch_sizes)
        if gen.dynamic or gen.do_sample:  # greedy otherwise (layers/generation.py:L19-L30)
            if gen.global_top_k is not None:  # layers/generation.py:L47-L48, L139-L140
                assert gen.dynamic is True, ("Dynamic on device generation must be enabled "
                                             "when global_top_k is set.")
            if gen.per_batch_line and nc.continuous_batching and not gen.dynamic:
                # inferred: index_select(config.top_k, 0, seq_id) on a Python list
                # (layers/generation.py:L107-L113, hlo.py index_select reads tensor.dtype)
                raise AttributeError("'list' object has no attribute 'dtype'")
        names = ("top_k", "top_p", "temperature", "top_p_min_tokens")
        # device tensors when dynamic (decoder.py:L368-L379); baked into the graph otherwise
        self._sampling = {n: getattr(gen, n) for n in names}

    def update_generation_config(self, generation_config) -> None:
        """base.py:L761-L762 -> decoder.py:L1107-L1114: validate, then write the dynamic
        parameter tensors on every core."""
        nc = self.neuron_config
        validate_generation_configs(generation_config, nc.on_device_generation,
                                    self.batch_sizes)
        if not (nc.on_device_generation and nc.on_device_generation.dynamic
                and self._sampling is not None):
            # inferred: self.top_k exists only after to_neuron with dynamic=True
            # (decoder.py:L368-L377), so parallel_write(self.top_k, ...) fails (L1111)
            raise AttributeError("'DecoderLmHeadForSamplingNoEmbedding' object has no "
                                 "attribute 'top_k'")
        self._sampling = {"top_k": [int(k) for k in _as_list(generation_config.top_k)],
                          "top_p": _as_list(generation_config.top_p),
                          "temperature": _as_list(generation_config.temperature),
                          "top_p_min_tokens": [int(m) for m in
                                               _as_list(generation_config.top_p_min_tokens)]}

    def _device_tokens(self, logits: list[torch.Tensor], lines: list[int]) -> torch.Tensor:
        """layers/generation.py:L17-L199 on each row; token ids [rows, 1], int32 like the
        graph's indices (decoder.py:L365)."""
        gen = self.neuron_config.on_device_generation
        tokens = [self._device_sample(row.float(), line, gen) for row, line in
                  zip(logits, lines, strict=True)]
        return torch.tensor(tokens, dtype=torch.int32).reshape(-1, 1)

    def _device_sample(self, logits: torch.Tensor, line: int, gen) -> int:
        probs, indices = self._device_distribution(logits, line, gen)
        if len(indices) == 1:  # greedy: nothing drawn
            return int(indices[0])
        if gen.deterministic:  # a fixed 0.5 draw (hlo.py:L2422-L2456)
            pick = int(torch.searchsorted(torch.cumsum(probs, -1), torch.tensor(0.5)))
            return int(indices[min(pick, len(indices) - 1)])
        return int(indices[int(torch.multinomial(probs, 1, generator=self._rng))])

    def device_probs(self, logits: torch.Tensor, line: int) -> torch.Tensor:
        """The distribution the device samples a line from, over the whole vocabulary: what
        `generate(..., return_probs=True)` hands speculation (layers/generation.py:L17-L30,
        L137-L198); greedy is 1.0 on the argmax (L21-L28)."""
        probs, indices = self._device_distribution(logits.float(), line,
                                                   self.neuron_config.on_device_generation)
        out = torch.zeros(logits.shape[-1], dtype=torch.float32)
        out[indices] = probs.float()
        return out

    def _device_distribution(self, logits: torch.Tensor, line: int, gen
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities, token ids) the device draws from; one id with probability 1 when
        only the best token survives."""
        if not gen.dynamic and not gen.do_sample:  # greedy (layers/generation.py:L19-L20)
            return torch.ones(1), logits.argmax().reshape(1)
        s = self._sampling
        if gen.per_batch_line:  # each line's own, by seq id (layers/generation.py:L107-L113)
            if not all(0 <= line < len(s[n]) for n in s):
                raise IndexError(f"seq_id {line} has no sampling parameters (top_k holds "
                                 f"{len(s['top_k'])}): index_select out of range on device")
            k, p, t, m = (s[n][line] for n in ("top_k", "top_p", "temperature",
                                               "top_p_min_tokens"))
        else:
            k, p, t, m = (s[n] for n in ("top_k", "top_p", "temperature", "top_p_min_tokens"))
        self.sampled.append((line, int(k), float(p), float(t)))
        indices = torch.arange(logits.shape[-1])
        if gen.global_top_k is not None:  # layers/generation.py:L55-L56, L147-L148
            logits, indices = torch.topk(logits, min(gen.global_top_k, logits.shape[-1]))
        if int(k) == 1:  # only the best survives top-k (layers/generation.py:L153-L176)
            return torch.ones(1), indices[int(logits.argmax())].reshape(1)
        if t != 1.0:  # layers/generation.py:L166-L169
            logits = logits / t
        logits, order = torch.topk(logits, min(int(k), logits.shape[-1]))  # L172-L176
        indices = indices[order]
        probs = torch.softmax(logits, dim=-1)
        if gen.dynamic or p < 1.0:  # smallest prefix reaching top_p, at least m (L179-L180)
            keep = (torch.cumsum(probs, -1) - probs < p)
            keep[: max(1, int(m))] = True
            probs = torch.where(keep, probs, torch.zeros_like(probs))
            probs = probs / probs.sum()
        return probs, indices

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
        if self.neuron_config.on_device_generation:  # sample_tokens (llama/model.py:L409-L412)
            raise NotImplementedError("fake: sample() with on_device_generation")
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


def _as_list(value) -> list:
    return list(value) if isinstance(value, list) else [value]


def _quantized(weight: torch.Tensor, q, is_unit_scale: bool, dim: int = 1) -> torch.Tensor:
    """quantize.maybe_quantize_weights (quantize.py:L23-L115) of an HF [out, in] weight: scales
    taken over `dim` (the contract dim `in` for dim 1: one scale per output channel), then
    W_q * scales as the device rescales it."""
    tensor = weight.to(torch.float32)  # quantize.py:L69
    if q.quantize_method == "vector_dynamic":
        if q.quant_dtype == "s8":  # quantize.py:L72-L86
            scales = torch.amax(torch.abs(tensor), dim=dim, keepdim=True) / 127
            if scales.count_nonzero() == 0:
                return tensor.to(torch.int8).to(torch.float32)
            quantized = torch.clamp(torch.round(tensor / scales), -128, 127).to(torch.int8)
        else:  # f8e4m3fn (quantize.py:L87-L101): unit scale for no_quantize_list layers
            if is_unit_scale:
                return tensor.to(torch.float8_e4m3fn).to(torch.float32)
            scales = torch.amax(torch.abs(tensor), dim=dim, keepdim=True) / float(FpBounds.max)
            if scales.count_nonzero() == 0:
                return tensor.to(torch.float8_e4m3fn).to(torch.float32)
            quantized = (tensor / scales).to(torch.float8_e4m3fn)
        return quantized.to(torch.float32) * scales
    # direct_cast (quantize.py:L106-L110): casts with the dtype's *name*, which torch reads
    # as a device: RuntimeError "Invalid device string: 's8'", as the real one raises
    warnings.warn(f"direct casting is enabled with dtype {q.quant_dtype}, make sure the values "
                  "are within representable range of the datatype", stacklevel=3)
    return tensor.to(q.quant_dtype).to(torch.float32)
