"""NeuronConfig / InferenceConfig / OnDeviceSamplingConfig of the fake, with the real checks.

Only the fields inf2serve's nxdi backend and its tests touch are modelled; every other
keyword is dropped with a warning, as the real NeuronConfig does. Citations are to
aws-neuron/neuronx-distributed-inference@cd3abf3 (Neuron SDK 2.28.0 component release):
src/neuronx_distributed_inference/models/config.py unless named otherwise.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import warnings

import torch
from neuronx_distributed.quantization.quantization_config import (
    KVQuantizationConfig,
    QuantizedDtype,
)

CONFIG_FILE = "neuron_config.json"  # L23


def to_torch_dtype(dtype_str: str) -> torch.dtype:
    mapping = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    assert dtype_str in mapping, f"Unsupported dtype: {dtype_str}"  # L46-L55 (fp8 left out)
    return mapping[dtype_str]


def to_dict(obj):
    """What save() serialises: every attribute, dtypes by name (L62-L77)."""
    if type(obj) is dict:
        return {k: to_dict(v) for k, v in obj.items()}
    if type(obj) is list:
        return [to_dict(v) for v in obj]
    if inspect.isclass(obj):
        return {"__module__": obj.__module__, "__name__": obj.__name__}
    if hasattr(obj, "__dict__"):
        return {k: to_dict(v) for k, v in obj.__dict__.items()}
    if type(obj) is torch.dtype:
        return str(obj).split(".")[1]
    return obj


class OnDeviceSamplingConfig:
    def __init__(self, **kwargs):  # L1023-L1034; unknown keywords are ignored there too
        self.do_sample = kwargs.pop("do_sample", False)
        self.top_k = kwargs.pop("top_k", 1)
        self.top_p = kwargs.pop("top_p", 1.0)
        self.temperature = kwargs.pop("temperature", 1.0)
        self.dynamic = kwargs.pop("dynamic", False)
        self.deterministic = kwargs.pop("deterministic", False)
        self.global_topk = kwargs.pop("global_topk", 256)
        self.on_device_sampling_config = kwargs.pop("on_device_sampling_config", True)
        self.top_k_kernel_enabled = kwargs.pop("top_k_kernel_enabled", False)
        self.sampling_dp_degree = kwargs.pop("sampling_dp_degree", 1)


class NeuronConfig:
    def __init__(self, **kwargs) -> None:
        self.batch_size = kwargs.pop("batch_size", 1)
        self.padding_side = kwargs.pop("padding_side", "right")
        self.allow_input_truncation = kwargs.pop("allow_input_truncation", False)
        self.seq_len = kwargs.pop("seq_len", 128)
        self.n_active_tokens = kwargs.pop("n_active_tokens", self.seq_len)
        self.n_positions = kwargs.pop("n_positions", self.seq_len)
        self.output_logits = kwargs.pop("output_logits", False)
        self.is_prefill_stage = None
        if "torch_dtype" in kwargs:  # L106-L116
            self.torch_dtype = kwargs.pop("torch_dtype")
            if isinstance(self.torch_dtype, str):
                self.torch_dtype = to_torch_dtype(self.torch_dtype)
            self.overrides_torch_dtype = kwargs.pop("overrides_torch_dtype", True)
        else:
            self.torch_dtype = torch.bfloat16
            self.overrides_torch_dtype = False
        self.cast_type = kwargs.pop("cast_type", "config")
        if self.cast_type not in ["config", "as-declared"]:  # L118-L120
            raise ValueError("cast_type must be one of config, as-declared")
        self.max_context_length = kwargs.pop("max_context_length", self.seq_len)
        self.max_new_tokens = kwargs.pop("max_new_tokens", self.seq_len - self.max_context_length)
        if self.max_new_tokens == 0:
            self.max_new_tokens = None
        self.max_length = kwargs.pop("max_length", self.seq_len)
        # L139
        assert self.max_context_length <= self.max_length, \
            "max_context_length cannot be more than max_length"
        self.fused_qkv = kwargs.pop("fused_qkv", False)
        self.sequence_parallel_enabled = kwargs.pop("sequence_parallel_enabled", False)
        self.ctx_batch_size = kwargs.pop("ctx_batch_size", self.batch_size)  # L163-L166
        self.tkg_batch_size = kwargs.pop("tkg_batch_size", self.batch_size)
        self.max_batch_size = kwargs.pop("max_batch_size", self.batch_size)
        self.is_continuous_batching = kwargs.pop("is_continuous_batching", False)
        self.kv_cache_batch_size = kwargs.pop("kv_cache_batch_size", self.batch_size)
        self.kv_cache_padding_size = kwargs.pop("kv_cache_padding_size", 0)
        self.on_device_sampling_config = kwargs.pop("on_device_sampling_config", None)
        if type(self.on_device_sampling_config) is dict:  # L176-L179: a dict is accepted too
            self.on_device_sampling_config = OnDeviceSamplingConfig(
                **self.on_device_sampling_config)
        self.async_mode = kwargs.pop("async_mode", False)  # L182-L183
        self.enable_bucketing = kwargs.pop("enable_bucketing", False)
        self.buckets = kwargs.pop("buckets", [self.seq_len])
        self.context_encoding_buckets = kwargs.pop("context_encoding_buckets", None)
        self.token_generation_buckets = kwargs.pop("token_generation_buckets", None)
        if self.context_encoding_buckets is not None:  # L193-L197: sorted in place, then bounded
            self.context_encoding_buckets.sort()
            assert self.context_encoding_buckets[-1] <= self.max_context_length, (
                f"Context bucket {self.context_encoding_buckets[-1]} should be <= "
                f"{self.max_context_length}")
        if self.token_generation_buckets is not None:  # L198-L202
            self.token_generation_buckets.sort()
            assert self.token_generation_buckets[-1] <= self.max_length, (
                f"Token generation bucket {self.token_generation_buckets[-1]} should be <= "
                f"{self.max_length}")
        # L204-L213: batch buckets of token generation (refused with speculation, L610-L654)
        self.token_generation_batches = kwargs.pop("token_generation_batches", None)
        if self.token_generation_batches is not None:
            if not isinstance(self.token_generation_batches, list):
                self.token_generation_batches = [self.token_generation_batches]
            self.token_generation_batches.sort()
            max_batch = self.token_generation_batches[-1]
            assert max_batch <= self.tkg_batch_size, (
                f"Token generation batch buckets {self.token_generation_batches} "
                f"should be <= token generation batch size ({self.tkg_batch_size})")
        self.quantized = kwargs.pop("quantized", False)  # L216-L226
        self.quantized_checkpoints_path = kwargs.pop("quantized_checkpoints_path", None)
        if self.quantized is True:
            assert self.quantized_checkpoints_path is not None, \
                "quantized_checkpoints_path is required"
        # not checked here: an unknown type fails where the checkpoint is written or the
        # model traced (application_base.py:L774-L788, model_wrapper.py:L1692-L1699)
        self.quantization_type = kwargs.pop("quantization_type", "per_tensor_symmetric")
        self.quantization_dtype = kwargs.pop("quantization_dtype", "int8")
        self.modules_to_not_convert = kwargs.pop("modules_to_not_convert", None)  # L235-L240
        self.draft_model_modules_to_not_convert = kwargs.pop(
            "draft_model_modules_to_not_convert", None)
        # 2.28 reads it only for the fp8 compiler flag (model_wrapper.py:L148-L157)
        self.kv_cache_quant = kwargs.pop("kv_cache_quant", False)
        self.speculation_length = kwargs.pop("speculation_length", 0)  # L242-L256
        self.spec_batch_size = kwargs.pop("spec_batch_size", self.batch_size)
        self.enable_fused_speculation = kwargs.pop("enable_fused_speculation", False)
        self.enable_eagle_speculation = kwargs.pop("enable_eagle_speculation", False)
        if self.enable_eagle_speculation:  # L255-L256
            self.enable_fused_speculation = True
        self.medusa_speculation_length = kwargs.pop("medusa_speculation_length", 0)
        self.is_chunked_prefill = kwargs.pop("is_chunked_prefill", False)
        self.is_prefix_caching = kwargs.pop("is_prefix_caching", False)
        self.is_block_kv_layout = kwargs.pop("is_block_kv_layout", False)
        # L299-L304: the KV cache's dtype comes from here in 2.28 (kv_cache_manager.py:L139-L150)
        self.kv_quant_config = kwargs.pop("kv_quant_config", None)
        if type(self.kv_quant_config) is dict:
            self.kv_quant_config = KVQuantizationConfig(**self.kv_quant_config)
        self.tp_degree = kwargs.pop("tp_degree", 1)  # L361-L371
        self.cp_degree = kwargs.pop("cp_degree", 1)
        self.pp_degree = kwargs.pop("pp_degree", 1)
        self.ep_degree = kwargs.pop("ep_degree", 1)
        self.save_sharded_checkpoint = kwargs.pop("save_sharded_checkpoint", False)
        self.skip_sharding = kwargs.pop("skip_sharding", False)
        if self.tp_degree % self.cp_degree != 0:
            raise ValueError("TP Degree must be evenly divisible by CP Degree")
        self.world_size = kwargs.pop("world_size", None)  # L381-L389
        if self.world_size is None:
            self.world_size = self.tp_degree * self.pp_degree * self.ep_degree
        self.start_rank_id = kwargs.pop("start_rank_id", 0)
        self.local_ranks_size = kwargs.pop("local_ranks_size", None)
        if self.local_ranks_size is None:
            self.local_ranks_size = self.world_size
        self.flash_decoding_enabled = kwargs.pop("flash_decoding_enabled", False)
        self.logical_nc_config = int(kwargs.pop("logical_nc_config", 1))  # Inf2: LNC 1 (L688-L729)
        self.lora_config = kwargs.pop("lora_config", None)
        if self.quantized and not self.modules_to_not_convert:  # L518-L527 (no qkv kernel)
            warnings.warn("modules_to_not_convert is not provided. Assuming all modules will be "
                          "quantized.", UserWarning, stacklevel=2)
        self._verify_quantized_config()  # L570
        self.apply_seq_ids_mask = kwargs.pop("apply_seq_ids_mask", False)
        self.skip_warmup = kwargs.pop("skip_warmup", False)  # L575
        if kwargs:  # L604-L605: unknown keywords are logged and dropped, never refused
            logging.warning(f"NeuronConfig init: Unexpected keyword arguments: {kwargs}")
        self._validate_batch_bucketing_compatibility()  # L608

    def _validate_batch_bucketing_compatibility(self):
        """Batch bucketing with any speculation is refused (L610-L654; the fake models the
        speculation entries of its list)."""
        if self.token_generation_batches is None:
            return
        incompatible_features = []
        if self.speculation_length > 0:
            incompatible_features.append(f"speculative decoding ({self.speculation_length=})")
        if self.enable_fused_speculation:
            incompatible_features.append("fused speculation (enable_fused_speculation=True)")
        if self.enable_eagle_speculation:
            incompatible_features.append("EAGLE speculation (enable_eagle_speculation=True)")
        if incompatible_features:
            raise ValueError(
                f"Batch bucketing (token_generation_batches={self.token_generation_batches}) "
                "is not currently supported with the following features: "
                f"{', '.join(incompatible_features)}. Please disable batch bucketing or the "
                "incompatible features.")

    def _verify_quantized_config(self):  # L656-L663
        if not self.quantized:
            return
        assert self.quantized_checkpoints_path is not None, "quantized_checkpoints_path is required"
        QuantizedDtype.has_dtype(self.quantization_dtype)


class MoENeuronConfig(NeuronConfig):
    """The NeuronConfig of mixture-of-experts models (L757-L805): the fields the fake reads;
    moe_tp_degree / moe_ep_degree are read by modules/moe_v2.py only, not Mixtral's."""

    def __init__(self, capacity_factor: float = None, glu_mlp: bool = True, **kwargs) -> None:
        self.capacity_factor = float(capacity_factor) if capacity_factor is not None else None
        self.glu_mlp = glu_mlp
        self.moe_tp_degree = kwargs.pop("moe_tp_degree", 1)
        self.moe_ep_degree = kwargs.pop("moe_ep_degree", 1)
        super().__init__(**kwargs)


class InferenceConfig:
    """Model config (from load_config) plus the NeuronConfig; saved as neuron_config.json."""

    def __init__(self, neuron_config: NeuronConfig, fused_spec_config=None, load_config=None,
                 metadata=None, **kwargs):  # L812-L834
        self.neuron_config = neuron_config
        self.fused_spec_config = fused_spec_config
        if load_config is not None:
            load_config(self)
        else:
            self.load_config()
        self.metadata = metadata
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.add_derived_config()
        self.validate_config()

    def add_derived_config(self):
        self.num_cores_per_group = 1

    def load_config(self):
        pass

    def get_required_attributes(self) -> list[str]:
        return []

    def validate_config(self):
        missing = [x for x in self.get_required_attributes() if not hasattr(self, x)]
        assert len(missing) == 0, f"Config must define {missing}"  # L866-L869

    def save(self, model_path):  # L887-L894
        os.makedirs(model_path, exist_ok=True)
        with open(os.path.join(model_path, CONFIG_FILE), "w", encoding="utf-8") as f:
            f.write(json.dumps(to_dict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, model_path, **kwargs):  # L925-L997: neuron_config.json, kwargs override
        with open(os.path.join(model_path, CONFIG_FILE), encoding="utf-8") as f:
            merged = json.loads(f.read())
        merged.update(kwargs)
        if isinstance(merged.get("neuron_config"), dict):
            merged["neuron_config"] = cls.get_neuron_config_cls()(**merged["neuron_config"])
        spec = merged.get("fused_spec_config")
        if isinstance(spec, dict):  # L951-L995 (the fake: no draft_model_cls of its own)
            if spec.get("draft_model_cls"):
                raise NotImplementedError("fake: a draft_model_cls other than the worker's")
            draft = spec.get("draft_config")
            if isinstance(draft, dict):
                if isinstance(draft.get("neuron_config"), dict):
                    draft["neuron_config"] = cls.get_neuron_config_cls()(**draft["neuron_config"])
                spec["draft_config"] = cls(**draft)
            fused = FusedSpecNeuronConfig(**spec)
            name, module = fused.worker_cls["__name__"], fused.worker_cls["__module__"]
            try:
                fused.worker_cls = getattr(importlib.import_module(module), name)
            except Exception as e:
                raise ModuleNotFoundError(f"Failed to load class {name} from module {module}. "
                                          "Make sure the module exists in NxDI and model class "
                                          "is supported.") from e
            merged["fused_spec_config"] = fused
        return cls(**merged)

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return NeuronConfig


class FusedSpecNeuronConfig:
    """The draft of fused speculation, on InferenceConfig.fused_spec_config (L1004-L1020):
    worker_cls is the target's decoder class (model_cls._model_cls), draft_config the
    draft's InferenceConfig, draft_model_path its HF checkpoint (read at every load,
    application_base.py:L658-L671)."""

    def __init__(self, worker_cls, draft_config: InferenceConfig = None,
                 draft_model_path: str = None, draft_model_cls=None) -> None:
        self.worker_cls = worker_cls
        self.draft_model_cls = draft_model_cls
        self.draft_config = draft_config
        self.draft_model_path = draft_model_path
