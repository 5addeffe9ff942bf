"""NeuronBaseForCausalLM of the fake: compile/load, and forward's host-side rules.

The device is a KV cache of `kv_cache_batch_size` lines; each line records, per cache
position, the token written there and its rotary position. Context encoding and token
generation write where the real graphs write (the whole padded bucket of a context; one
position per generated token, on the line the real padding/sorting picks), and logits are
the HF model's over what that line's attention sees, so a call that would corrupt another
sequence's cache on Inf2 changes that sequence's tokens here.

Citations: aws-neuron/neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/
(AB = models/application_base.py, MB = models/model_base.py, MW = models/model_wrapper.py,
KV = modules/kvcache/kv_cache_manager.py, BK = modules/autobucketing.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from math import log2

import torch
from neuronx_distributed.quantization.quantization_config import (
    QuantizationType,
    QuantizedDtype,
)
from neuronx_distributed.quantization.quantization_utils import (
    quantize_pytorch_model_per_channel_symmetric,
    quantize_pytorch_model_per_tensor_symmetric,
)

from neuronx_distributed_inference import _fake_runtime as rt
from neuronx_distributed_inference.models import _fused_spec as fused_spec
from neuronx_distributed_inference.models.config import to_dict
from neuronx_distributed_inference.modules.checkpoint import (
    load_state_dict,
    prune_state_dict,
    save_state_dict_safetensors,
)
from neuronx_distributed_inference.modules.generation import sampling

COMPILED_MODEL_FILE_NAME = "model.pt"  # AB:L47
#: NeuronConfig fields that do not shape a traced graph (the fake compares the rest at load)
NOT_TRACED = ("skip_warmup", "quantized_checkpoints_path")
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
CONTEXT_ENCODING_MODEL_TAG = "context_encoding_model"
TOKEN_GENERATION_MODEL_TAG = "token_generation_model"
FUSED_SPECULATION_MODEL_TAG = "fused_speculation_model"  # MW:L38
UNMODELLED = ("medusa_speculation_length", "enable_eagle_speculation", "is_prefix_caching",
              "is_block_kv_layout", "lora_config")


def traced_name(hf_name: str, fused_qkv: bool) -> str:
    """An HF Llama Linear's name in NxD Inference's traced Llama: q/k/v under
    self_attn.qkv_proj (one Wqkv when fused), o under self_attn.o_proj
    (modules/attention/gqa.py:L440-L470, L1213; attention_base.py:L494-L495)."""
    head, _, leaf = hf_name.rpartition(".")
    if head.endswith("self_attn") and leaf in ("q_proj", "k_proj", "v_proj"):
        return f"{head}.qkv_proj.{'Wqkv' if fused_qkv else leaf}"
    if head.endswith("self_attn") and leaf == "o_proj":
        return f"{head}.o_proj.o_proj"
    return hf_name


def normalize_path(path) -> str:
    return os.path.join(os.path.normpath(path), "")  # AB:L51-L54: always a trailing slash


def generate_buckets(min_length: int, max_length: int) -> list[int]:
    if min_length == max_length:  # BK:L8-L19
        return [max_length]
    lo, hi = int(log2(min_length)), round(log2(max_length))
    return [2**i for i in range(lo, hi)] + [max_length]


def buckets_for(nc, tag: str) -> list[int]:
    """Context buckets up to max_context_length, token buckets up to max_length (BK:L149-L250)."""
    top = nc.max_context_length if tag == CONTEXT_ENCODING_MODEL_TAG else nc.max_length
    given = (nc.context_encoding_buckets if tag == CONTEXT_ENCODING_MODEL_TAG
             else nc.token_generation_buckets)
    if not nc.enable_bucketing:
        return generate_buckets(top, top)
    return list(given) if given is not None else generate_buckets(128, top)


def seq_bucket(buckets: list[int], input_len: int, tag: str, truncate: bool,
               speculation_length: int = 0) -> int:
    """first_fit: the first bucket strictly longer than the input plus the positions a fused
    speculation step writes, else the largest when they fill it exactly (MW:L826-L841,
    L898-L916; speculation_length counts for the fused model only)."""
    required_len = input_len + speculation_length
    for b in buckets:
        if required_len < b:
            return b
    if required_len == buckets[-1] or truncate:
        return buckets[-1]
    raise ValueError(f"Input len {input_len} exceeds largest bucket ({buckets[-1]}) for {tag}")


class _Output:
    """CausalLMOutputWithPast's fields the callers read (MB:L3851-L3878): `tokens`, or with
    fused speculation `fused_outputs` and no `tokens` at all."""

    def __init__(self, logits, hidden_states, **fields):
        self.logits, self.hidden_states = logits, hidden_states
        self.__dict__.update(fields)

    def __getitem__(self, i):
        return [x for x in (self.logits, self.hidden_states) if x is not None][i]


class NeuronBaseForCausalLM(torch.nn.Module):
    def __init__(self, model_path, config=None, neuron_config=None):
        super().__init__()
        model_path = normalize_path(model_path)
        if config is None:  # AB:L81-L82: a compiled dir's neuron_config.json
            config = self.get_config_cls().load(model_path)
        if neuron_config is not None:
            config.neuron_config = neuron_config
        if not hasattr(config, "neuron_config"):  # AB:L206-L207
            raise ValueError("Config must include a NeuronConfig")
        spec = getattr(config, "fused_spec_config", None)
        if spec is not None and (spec.draft_config.neuron_config.torch_dtype
                                 != config.neuron_config.torch_dtype
                                 and config.neuron_config.cast_type == "config"):  # AB:L209-L216
            raise ValueError("cast-type must be set to 'as-declared' to be able to run different "
                             "precisions for draft and target model!")
        self.config, self.neuron_config, self.model_path = config, config.neuron_config, model_path
        self.fused_spec_config = spec
        nc = self.neuron_config
        if nc.is_chunked_prefill:  # MB:L3094-L3095
            raise NotImplementedError("Chunked Prefill is not available in NxDI for now")
        for name in UNMODELLED:
            if getattr(nc, name, None):
                raise NotImplementedError(f"fake: {name} is not modelled")
        self.fused = bool(nc.enable_fused_speculation)
        fused_spec.check_config(self)
        self.on_device_sampling = nc.on_device_sampling_config is not None
        self.vocab_size = config.vocab_size
        self.cte_buckets = buckets_for(nc, CONTEXT_ENCODING_MODEL_TAG)
        self.tkg_buckets = buckets_for(nc, TOKEN_GENERATION_MODEL_TAG)
        self.is_compiled = os.path.isfile(model_path + COMPILED_MODEL_FILE_NAME)  # AB:L57-L58
        self.is_loaded_to_neuron = False
        self.kv_cache_populated = False
        self._hf = None
        self._kv: dict[int, dict[int, tuple[int, int]]] = {}
        self._kv_dtype = None  # the KV cache's dtype when not torch_dtype (KV:L139-L150)
        self._reading_cache = False
        self.async_mode = nc.async_mode  # MB:L3077-L3088
        self.prior_outputs = self.prior_seq_ids = None
        self.async_should_stop = False
        if self.async_mode:
            os.environ["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] = "2"
            os.environ["NEURON_RT_IO_RING_CACHE_SIZE"] = "2"

    @classmethod
    def get_config_cls(cls):
        raise NotImplementedError("get_config_cls is not implemented")

    # --- compile / load ------------------------------------------------------------------
    def _graphs(self) -> list[dict]:
        """One graph per bucket of each model; what model.pt holds (MB:L3149-L3196)."""
        c, nc = self.config, self.neuron_config
        base = {"model": {k: getattr(c, k, None) for k in c.get_required_attributes()},
                "neuron_config": {k: v for k, v in to_dict(nc).items() if k not in NOT_TRACED}}
        graphs = [{**base, "tag": CONTEXT_ENCODING_MODEL_TAG, "bucket": b,
                   "batch": nc.ctx_batch_size} for b in self.cte_buckets]
        # fused speculation: one fused graph per token bucket (MB:L3099-L3102, L3120-L3147;
        # its buckets are the token buckets, autobucketing.py:L282-L322)
        tkg = FUSED_SPECULATION_MODEL_TAG if self.fused else TOKEN_GENERATION_MODEL_TAG
        graphs += [{**base, "tag": tkg, "bucket": b,
                    "batch": nc.tkg_batch_size} for b in self.tkg_buckets]
        if self.fused:  # the draft is traced inside both (MB:L1646-L1673)
            draft = self.fused_spec_config.draft_config
            graphs = [{**g, "draft": {
                "model": {k: getattr(draft, k, None) for k in draft.get_required_attributes()},
                "neuron_config": {k: v for k, v in to_dict(draft.neuron_config).items()
                                  if k not in NOT_TRACED}}} for g in graphs]
        return graphs

    def compile(self, compiled_model_path, debug=False, pre_shard_weights_hook=None,
                dry_run=False):
        """neuron_config.json, then the traced graphs in model.pt (AB:L292-L315)."""
        path = normalize_path(compiled_model_path)
        nc = self.neuron_config
        self.config.save(path)  # written first, even when tracing fails (AB:L299)
        if nc.is_continuous_batching and nc.ctx_batch_size != 1:  # KV:L488-L489, at trace time
            raise AssertionError("only supports single seq_id")
        if nc.quantized:  # get_trace_callable converts the traced model (MW:L1692-L1699)
            quantization_type = QuantizationType(nc.quantization_type)
            if quantization_type not in (QuantizationType.PER_CHANNEL_SYMMETRIC,
                                         QuantizationType.PER_TENSOR_SYMMETRIC):
                raise RuntimeError(f"{nc.quantization_type} is not supported")
        # the traced model is built from the config, its state dict converted (fake: both
        # checked by the family module)
        self.check_weights(self.config)
        self.hf_class(self.config)
        if self.fused:  # NeuronFusedSpecModel is built and traced here
            fused_spec.check_trace(self)
        if dry_run:
            return
        if nc.save_sharded_checkpoint:
            raise NotImplementedError("fake: save_sharded_checkpoint (weights/ pre-sharding)")
        rt.compile_delay()
        program = {"graphs": self._graphs(), "cc_flags": os.environ.get("NEURON_CC_FLAGS", "")}
        body = json.dumps(program, sort_keys=True, default=str).encode()
        with open(path + COMPILED_MODEL_FILE_NAME, "wb") as f:
            f.write(body + bytes(range(256)) * 16)
        self.is_compiled = True
        rt.record("compile", directory=path, tp_degree=nc.tp_degree, batch_size=nc.batch_size,
                  cc_flags=os.environ.get("NEURON_CC_FLAGS"))

    def load(self, compiled_model_path, start_rank_id=None, local_ranks_size=None,
             skip_warmup=False):
        """model.pt onto the cores, weights sharded from model_path, then warm-up (AB:L317-L346)."""
        path = normalize_path(compiled_model_path)
        pt = path + COMPILED_MODEL_FILE_NAME
        if not os.path.isfile(pt):  # torch.jit.load's error (AB:L326)
            raise ValueError(f"The provided filename {pt} does not exist")
        with open(pt, "rb") as f:
            raw = f.read()
        program = json.loads(raw[: raw.index(b"\x00")].decode())
        mine = json.loads(json.dumps(self._graphs(), sort_keys=True, default=str))
        if program["graphs"] != mine:  # the traced graphs take other shapes than this config's
            raise RuntimeError(f"fake: {pt} was traced for another config or model; the real "
                               "runtime fails on the first mismatching input")
        nc = self.neuron_config
        ranks = local_ranks_size or nc.local_ranks_size
        cores = rt.reserve_cores(ranks)  # nxd_model.initialize (AB:L414)
        # sharded from the checkpoint at load, not stored in the compiled dir (AB:L403-L405)
        self._hf = self._traced_weights().to(nc.torch_dtype).eval()
        self._kv, self.is_loaded_to_neuron = {}, True
        if self.fused:  # both checkpoints are sharded at every load (AB:L658-L671)
            self._draft_hf, self._draft_kv = fused_spec.draft_weights(self), {}
        self.prior_outputs = self.prior_seq_ids = None
        warmup = not (nc.skip_warmup or skip_warmup)  # AB:L339-L342
        rt.record("load", directory=path, visible_cores=cores, tp_degree=nc.tp_degree,
                  batch_size=nc.batch_size, warmup=warmup,
                  # each graph once, through forward_async in async mode (AB:L348-L372)
                  warmup_call=("forward_async" if nc.async_mode else "forward") if warmup
                  else None,
                  quantized_checkpoint=nc.quantized_checkpoints_path if nc.quantized else None,
                  kv_cache_dtype=str(self._kv_dtype or nc.torch_dtype).split(".")[-1],
                  draft=self.fused_spec_config.draft_model_path if self.fused else None)

    # --- weights ---------------------------------------------------------------------------
    _STATE_DICT_MODEL_PREFIX = "model."  # AB:L69-L70
    _NEW_STATE_DICT_MODEL_PREFIX = ""

    @staticmethod
    def load_hf_model(model_path):
        raise NotImplementedError("load_hf_model is not implemented")  # AB:L799-L802

    @classmethod
    def hf_class(cls, config):
        """Fake only: the transformers class that computes what this class's traced graphs
        compute, for this checkpoint (each family module names its own)."""
        raise NotImplementedError(f"fake: {cls.__name__} names no transformers class")

    @classmethod
    def check_weights(cls, config) -> None:
        """Fake only: what converting this checkpoint's state dict for the traced model
        fails on (convert_hf_to_neuron_state_dict); each family module adds its own."""

    @classmethod
    def get_state_dict(cls, model_name_or_path: str, config) -> dict:
        """A directory's HF files or one torch file, 'model.' dropped, *.weight_scale -> *.scale
        (AB:L690-L737)."""
        if os.path.isdir(model_name_or_path):
            model_sd = load_state_dict(model_name_or_path)
        elif os.path.isfile(model_name_or_path):
            model_sd = torch.load(model_name_or_path, weights_only=True)
        else:
            raise NotImplementedError("fake: loading a model by hub name")
        for name in list(model_sd):
            new = name
            if name.startswith(cls._STATE_DICT_MODEL_PREFIX):
                new = name.replace(cls._STATE_DICT_MODEL_PREFIX,
                                   cls._NEW_STATE_DICT_MODEL_PREFIX, 1)
            if name.endswith(".weight_scale"):
                new = new.replace(".weight_scale", ".scale")
            if new != name:
                model_sd[new] = model_sd.pop(name)
        return model_sd

    def checkpoint_loader_fn(self, mmap: bool = False):
        """The state dict the device gets; the quantized checkpoint's when quantized
        (AB:L628-L681)."""
        nc = self.neuron_config
        model_path = getattr(self.config, "_name_or_path", None)
        if model_path is None or not os.path.exists(model_path):
            model_path = self.model_path
        if nc.quantized:  # AB:L635-L641: every weight from there, none from the HF dir
            existing_checkpoint_path = nc.quantized_checkpoints_path
            if not os.path.exists(existing_checkpoint_path):
                raise FileNotFoundError(
                    f"Quantized checkpoint file not found: {existing_checkpoint_path}")
            model_path = existing_checkpoint_path
        model_sd = self.get_state_dict(model_path, self.config)
        if nc.torch_dtype != torch.float32 and nc.cast_type == "config":  # AB:L643-L656
            for name, param in model_sd.items():
                if (torch.is_floating_point(param) and param.dtype not in QUANTIZED_DTYPES
                        and not name.endswith("scale") and param.dtype != nc.torch_dtype):
                    model_sd[name] = param.to(nc.torch_dtype)
        return model_sd

    @classmethod
    def save_quantized_state_dict(cls, model_path: str, config):
        """Quantize the HF checkpoint on the CPU into quantized_checkpoints_path: safetensors
        when that is an existing directory, else one torch.save file (AB:L744-L768)."""
        model_path = normalize_path(model_path)
        quantized_state_dict = prune_state_dict(
            cls.generate_quantized_state_dict(model_path, config))
        path = config.neuron_config.quantized_checkpoints_path
        if os.path.isdir(path):
            save_state_dict_safetensors(state_dict=quantized_state_dict, state_dict_dir=path)
        else:
            torch.save(quantized_state_dict, path)
        rt.record("quantize", path=path, quantization_type=config.neuron_config.quantization_type,
                  quantization_dtype=config.neuron_config.quantization_dtype)

    @classmethod
    def generate_quantized_state_dict(cls, model_path: str, config) -> dict:
        hf_model = cls.load_hf_model(model_path)  # AB:L770-L790
        nc = config.neuron_config
        quantization_type = QuantizationType(nc.quantization_type)
        quantized_dtype = QuantizedDtype.get_dtype(nc.quantization_dtype)
        if quantization_type == QuantizationType.PER_TENSOR_SYMMETRIC:
            hf_model_quant = quantize_pytorch_model_per_tensor_symmetric(
                float_model=hf_model, inplace=True, dtype=quantized_dtype)
        elif quantization_type == QuantizationType.PER_CHANNEL_SYMMETRIC:
            hf_model_quant = quantize_pytorch_model_per_channel_symmetric(
                float_model=hf_model, inplace=True, dtype=quantized_dtype,
                modules_to_not_convert=nc.modules_to_not_convert)
        else:
            raise RuntimeError(f"{nc.quantization_type} not supported")
        return cls.prepare_quantized_state_dict(hf_model_quant)

    @classmethod
    def prepare_quantized_state_dict(cls, hf_model_quant) -> dict:
        """The decoder's state dict plus lm_head.* (MB:L3234-L3243)."""
        model_quant_sd = hf_model_quant.model.state_dict()
        for key, value in hf_model_quant.lm_head.state_dict().items():
            model_quant_sd[f"lm_head.{key}"] = value
        return model_quant_sd

    def _traced_weights(self):
        """The HF model carrying the weights the traced graphs get: the checkpoint's, or the
        quantized checkpoint's dequantized (weight * scale) where the trace converted a
        layer (MW:L1692-L1706; modules_to_not_convert are substrings of the traced module
        names, quantization/quantize.py:L122-L123 in neuronx-distributed)."""
        from transformers import AutoConfig

        nc = self.neuron_config
        path = self.model_path.rstrip("/")
        self.check_weights(self.config)
        hf_cls = self.hf_class(self.config)
        if not nc.quantized:
            hf = hf_from_pretrained(hf_cls, path)
        else:
            sd = self.checkpoint_loader_fn()
            hf = hf_cls(AutoConfig.from_pretrained(path))
            want = QuantizedDtype.get_dtype(nc.quantization_dtype)
            skip = nc.modules_to_not_convert or []
            weights = {}
            for name, module in hf.named_modules():
                if type(module) is not torch.nn.Linear:
                    continue
                key = name.removeprefix("model.")
                weight, scale = sd.pop(key + ".weight", None), sd.pop(key + ".scale", None)
                if weight is None:
                    raise RuntimeError(f"fake: {key}.weight is not in the quantized checkpoint")
                if not any(s in traced_name(key, nc.fused_qkv) for s in skip):
                    if scale is None or weight.dtype != want:
                        raise RuntimeError(
                            f"fake: the trace quantizes {key} to {want} but the checkpoint "
                            f"holds {weight.dtype}"
                            f"{'' if scale is not None else ' without a scale'}")
                    weight = weight.to(torch.float32) * scale
                elif scale is not None or weight.dtype in QUANTIZED_DTYPES:
                    raise RuntimeError(f"fake: {key} is in modules_to_not_convert but the "
                                       f"checkpoint holds it quantized ({weight.dtype})")
                weights[name + ".weight"] = weight
            for key, value in sd.items():
                weights[key if key.startswith("lm_head.") else "model." + key] = value
            hf.load_state_dict(weights, strict=True)
        self._hook_kv_cache(hf, nc)
        return hf

    def _hook_kv_cache(self, hf, nc) -> None:
        """An fp8 KV cache: K/V read back from it pass through its dtype (_cast_cached)."""
        kv = nc.kv_quant_config
        if kv is not None:
            if not kv.direct_cast:
                raise NotImplementedError("fake: scaled KV-cache quantization (direct_cast=False)")
            self._kv_dtype = kv.quant_dtype
            for layer in hf.model.layers:
                for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.register_forward_hook(self._cast_cached)

    def _cast_cached(self, module, args, out):
        """K/V read back from the cache are cast to its dtype and back (KV:L676-L698); the
        active token's are not. Fake only: cast before the rotary embedding, not after."""
        if not self._reading_cache or out.shape[1] < 2:
            return None
        out = out.clone()
        out[:, :-1] = out[:, :-1].to(self._kv_dtype).to(out.dtype)
        return out

    def reset(self):
        self.kv_cache_populated = False  # MB:L3942-L3946: the flag only, not the cache

    # --- forward -------------------------------------------------------------------------
    def forward(self, input_ids=None, seq_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, sampling_params=None, **kwargs):
        nc = self.neuron_config
        if attention_mask is None:  # MB:L3530-L3549
            assert position_ids is not None, \
                "need to call forward with position_ids if attention_mask is not provided"
            attention_mask = self._infer_attention_mask(position_ids)
        if seq_ids is None:
            seq_ids = torch.arange(input_ids.shape[0])
        if sampling_params is None:  # MB:L3089-L3091: greedy rows
            sampling_params = sampling.prepare_sampling_params(nc.batch_size)
        if self.on_device_sampling:  # MB:L3507-L3510
            sampling.validate_sampling_params(sampling_params, nc.on_device_sampling_config)
        sampling_params = sampling.infer_sampling_params(sampling_params.clone())
        prefill = position_ids.min().item() == 0  # MB:L3591-L3592, L3677
        if not self.is_loaded_to_neuron:  # MW:L1317-L1320
            raise RuntimeError("Forward called before load. Run load() or load_state_dict() "
                               "making calling forward")
        if seq_ids.dim() != 1 or not (input_ids.shape[0] == position_ids.shape[0]
                                      == attention_mask.shape[0] == seq_ids.shape[0]):
            raise RuntimeError(f"fake: the traced graphs take input_ids, attention_mask, "
                               f"position_ids [batch, n] and seq_ids [batch]; got "
                               f"{tuple(input_ids.shape)}, {tuple(attention_mask.shape)}, "
                               f"{tuple(position_ids.shape)}, {tuple(seq_ids.shape)}")
        if self.on_device_sampling and sampling_params.shape[0] != seq_ids.shape[0]:
            raise RuntimeError(f"fake: sampling_params {tuple(sampling_params.shape)} for "
                               f"{seq_ids.shape[0]} rows")
        ids, pos = input_ids.to(torch.int64), position_ids.to(torch.int64)  # MW:L715-L723
        if self.fused:  # context_encoding_model or fused_spec_model (MB:L3677-L3728)
            run = fused_spec.context if prefill else fused_spec.token_generation
            with torch.no_grad():
                outputs = run(self, ids, attention_mask, pos, seq_ids.to(torch.int64),
                              sampling_params)
            if prefill:
                self.kv_cache_populated = True
            return _Output(None, outputs, fused_outputs=outputs, async_should_stop=False)
        if not self.async_mode:
            return self._run(ids, attention_mask, pos, seq_ids, sampling_params, prefill)
        if self.prior_seq_ids is None:  # MB:L3349-L3351, on every call
            self.prior_seq_ids = seq_ids
        return self._async(ids, attention_mask, pos, seq_ids, sampling_params, prefill)

    def _run(self, ids, mask, pos, seq_ids, sampling_params, prefill) -> _Output:
        """One graph on the device."""
        nc = self.neuron_config
        with torch.no_grad():
            if prefill:
                logits = self._context(ids, mask, pos, seq_ids.to(torch.int64))
                self.kv_cache_populated = True
            else:
                logits = self._token(ids, mask, pos, seq_ids.to(torch.int64))
        if self.on_device_sampling:  # tokens instead of logits (MB:L3851-L3876)
            tokens = sampling.sample(logits[:, -1, :], sampling_params,
                                     nc.on_device_sampling_config)
            return _Output(None, tokens, tokens=tokens)
        return _Output(logits, logits, tokens=logits)

    def _async(self, ids, mask, pos, seq_ids, sampling_params, prefill) -> _Output:
        """causal_lm_async_execution (modules/async_execution.py:L190-L306, CTE + TKG flow).

        A prefill runs and clears the async state. A decode with other seq_ids than the last
        one, or within two tokens of a bucket boundary, runs in sync. Otherwise the step is
        also run one ahead on the device's own output tokens at position + 1, and the next
        decode with the same seq_ids returns that step without running its own inputs: the
        host's input_ids are not read then.
        """
        self.async_should_stop = False
        if prefill:  # L202-L220
            out = self._run(ids, mask, pos, seq_ids, sampling_params, True)
            self.prior_outputs = self.prior_seq_ids = None
            return out
        known = mask.shape[1]  # will_hit_bucket_boundary (L172-L187), one token generated
        boundary = any(known < b <= known + 2 for b in self.tkg_buckets)
        sync = not torch.equal(self.prior_seq_ids, seq_ids) or boundary  # L238-L241
        start = not sync and self.prior_outputs is None
        if sync:
            self.prior_outputs = self.prior_seq_ids = None
        ahead = None
        if sync or start:  # L245-L259
            ahead = self._run(ids, mask, pos, seq_ids, sampling_params, False)
            if start:
                self.prior_outputs, self.prior_seq_ids = ahead, seq_ids
        if not sync:
            if self.neuron_config.seq_len - int(pos.max()) <= 2:  # within_bounds (L168-L169)
                out = self.prior_outputs  # L275-L288: drained, async stops
                self.prior_outputs = self.prior_seq_ids = None
                self.async_should_stop = True
                return out
            if not self.on_device_sampling:
                raise RuntimeError("fake: async_mode feeds the device's output back as the next "
                                   "input_ids (L263-L264); without on-device sampling that is "
                                   "logits, which the token-generation graph cannot take")
            # the next positions from this call's (MB:L3279-L3293); tokens from the device
            next_pos = torch.amax(pos, 1, keepdim=True) + 1
            ahead = self._run(self.prior_outputs.tokens.reshape(-1, 1).to(torch.int64),
                              self._infer_attention_mask(next_pos), next_pos, seq_ids,
                              sampling_params, False)
        if sync:
            return ahead
        out, self.prior_outputs, self.prior_seq_ids = self.prior_outputs, ahead, seq_ids
        return out

    __call__ = forward

    @staticmethod
    def _infer_attention_mask(position_ids):
        batch, n = position_ids.shape
        if n != 1:
            return (position_ids >= torch.arange(n).view(1, -1)).to(position_ids.dtype)
        seq_len = int(torch.max(position_ids))
        mask = torch.arange(seq_len).view(1, -1).expand(batch, seq_len)
        return (position_ids.expand(batch, seq_len) - 1 >= mask).to(position_ids.dtype)

    def _context(self, ids, mask, pos, seq_ids) -> torch.Tensor:
        """Pad to the bucket, run ctx_batch_size rows at a time (MW:L725-L795, L1314-L1380)."""
        nc = self.neuron_config
        tag = CONTEXT_ENCODING_MODEL_TAG
        bucket = seq_bucket(self.cte_buckets, mask.shape[1], tag, nc.allow_input_truncation)
        pad = bucket - ids.shape[1]
        if pad < 0 or bucket - pos.shape[1] < 0:  # MW:L765-L773
            raise ValueError(f"Inputs supplied ({pos.shape[1]} tokens) are longer than "
                             f"max_context_length ({nc.max_context_length} tokens). To truncate "
                             "inputs, set allow_input_truncation=True.")
        pad_id = getattr(self.config, "pad_token_id", None) or 0
        ids = torch.nn.functional.pad(ids, (0, pad), value=pad_id)  # pad values: MW:L762-L778
        pos = torch.nn.functional.pad(pos, (0, bucket - pos.shape[1]), value=1)
        out = []
        step = nc.ctx_batch_size
        if ids.shape[0] < step:
            raise NotImplementedError("fake: fewer context rows than ctx_batch_size")
        for start in range(0, ids.shape[0], step):  # vllm_cte_repadding per chunk (MW:L1296)
            rows = range(start, min(start + step, ids.shape[0]))
            for r in rows:
                line = int(seq_ids[r]) if nc.is_continuous_batching else r - start
                self._check_line(line)  # index_put on the line (modules/kvcache/utils.py:L106-L120)
                # the whole padded bucket is written, pads included (KV:L491-L492)
                self._kv[line] = {j: (int(t), int(p)) for j, (t, p)
                                  in enumerate(zip(ids[r].tolist(), pos[r].tolist(), strict=True))}
                # hidden state at the first maximal position id (MB:L1012-L1016): for a
                # 1-token prompt that is the first pad, position 1
                at = int(torch.max(pos[r : r + 1], dim=1, keepdim=True).indices)
                out.append(self._logits(ids[r, : at + 1].tolist(), pos[r, : at + 1].tolist()))
        return torch.stack(out).unsqueeze(1)  # [n, 1, vocab]

    def _token(self, ids, mask, pos, seq_ids) -> torch.Tensor:
        """One position per row; which cache line each row touches (MW:L569-L698)."""
        nc = self.neuron_config
        bucket = seq_bucket(self.tkg_buckets, mask.shape[1], TOKEN_GENERATION_MODEL_TAG,
                            nc.allow_input_truncation)
        if mask.shape[1] > bucket:  # MW:L810-L819
            raise ValueError(f"Attention mask supplied (length={mask.shape[1]}) is longer than "
                             f"max_length ({nc.max_length} tokens).")
        n, batch = ids.shape[0], nc.tkg_batch_size
        if n > batch:
            raise NotImplementedError("fake: more token-generation rows than tkg_batch_size")
        rows = [(int(ids[r, 0]), int(pos[r, 0])) for r in range(n)]
        given = seq_ids.tolist()
        if n == batch:  # a full batch runs as given: row i is cache line i (MW:L1342-L1348)
            lines = list(range(n))
            writes = dict(zip(lines, rows, strict=True))
        else:  # missing lines filled, sorted; they get row 0 repeated (MW:L611-L641, L515-L567)
            if len(set(given)) != n:
                raise RuntimeError(f"fake: duplicate seq_ids {given}; the real padding mixes "
                                   "rows silently")
            for s in given:
                if not 0 <= s < batch:  # index_select(logits, 0, seq_ids) (MW:L695)
                    raise IndexError("index out of range in self")
            lines = given
            writes = {line: rows[0] for line in range(batch)}
            writes.update(zip(given, rows, strict=True))
        for line, (token, p) in writes.items():
            self._check_line(line)
            if not 0 <= p < nc.max_length:
                raise IndexError(f"fake: position {p} outside the KV cache (max_length "
                                 f"{nc.max_length})")
            self._kv.setdefault(line, {})[p] = (token, p)
        out = []
        self._reading_cache = True  # prior positions come from the cache
        try:
            for line, (token, p) in zip(lines, rows, strict=True):
                cache = self._kv.get(line, {})
                # prior positions below the row's position id, then the active token
                # (MB:L3530-L3549)
                prior = [cache.get(j, (0, j)) for j in range(p)]
                out.append(self._logits([t for t, _ in prior] + [token],
                                        [q for _, q in prior] + [p]))
        finally:
            self._reading_cache = False
        return torch.stack(out).unsqueeze(1)

    def _check_line(self, line: int) -> None:
        lines = self.neuron_config.kv_cache_batch_size
        if not 0 <= line < lines:
            raise IndexError(f"index {line} is out of bounds for dimension 0 with size {lines}")

    def _logits(self, tokens: list[int], positions: list[int], hf=None,
                vocab_size: int | None = None) -> torch.Tensor:
        out = (hf or self._hf)(input_ids=torch.tensor([tokens], dtype=torch.long),
                               position_ids=torch.tensor([positions], dtype=torch.long),
                               use_cache=False)
        # logits.float() (MB:L1028), vocab_size wide: the LM head pads the vocabulary to a
        # multiple of tp (models/llama/modeling_llama.py:L1371-L1379, pad=True) but, gathering
        # its output for the host (gather_output=not on_device_sampling), narrows it back
        # (aws-neuron/neuronx-distributed@v2.28.0:src/neuronx_distributed/parallel_layers/
        # layers.py:L792-L797); on-device sampling masks the pads (MB:L1031-L1039)
        return out.logits[0, -1, : vocab_size or self.vocab_size].float()


def hf_from_pretrained(hf_cls, path: str):
    """transformers' model with the checkpoint's weights; a weight the model has and the
    checkpoint lacks fails, as it does where NxD Inference shards the state dict onto the
    traced model (a tied lm_head is copied from the embedding first, AB:L729-L730, as
    transformers ties it)."""
    hf, info = hf_cls.from_pretrained(path, output_loading_info=True)
    if info.get("missing_keys"):
        raise RuntimeError(f"fake: the checkpoint {path} has no {sorted(info['missing_keys'])[:3]} "
                           f"that {hf_cls.__name__}'s layers read")
    return hf


def program_digest(path) -> str:
    """sha256 of a compiled model.pt (tests compare artefacts with it)."""
    with open(normalize_path(path) + COMPILED_MODEL_FILE_NAME, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
