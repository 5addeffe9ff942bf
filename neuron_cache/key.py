"""What makes a compiled Neuron model reusable: every input that changes the NEFFs.

transformers-neuronx compiles graphs from the architecture and the shapes, not the
weights (weights are loaded at `to_neuron()`), so the key hashes config.json minus
the fields that do not change the graph, plus the compile settings, the compiler
flags and the installed SDK versions. Two entries with the same digest are
interchangeable; anything else is compiled anew.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

from neuron_cache.errors import CacheError


class HandlerConfig(Protocol):
    """The settings the key is computed from, as the runtime's typed config holds them
    (handlers.config.HandlerConfig has this shape). Structural, so that the cache, the
    lowest layer, imports nothing from the runtime above it."""

    backend: str
    batching: str
    batch_size: int
    max_length: int
    neuron: Any  # tp_degree, gqa, context_length_estimate, compiler_flags, ...
    nxdi: Any  # model_class, max_context_length, token_generation_buckets, ...

    @property
    def amp(self) -> str:
        """handler.dtype resolved, in the Neuron spelling the key records (bf16, f16, f32)."""
        ...

#: distributions whose versions are part of the key (read with importlib.metadata): each one
#: changes the NEFFs. transformers-neuronx builds the HLO with torch-neuronx's pyhlo, and
#: libneuronxla's neuron_xla_compile runs neuronx-cc through its compile cache, the one at
#: NEURON_COMPILE_CACHE_URL (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/
#: compiler.py:L30-38, L147-156). torch is left out: it neither builds nor
#: compiles the graphs, the saved artefacts are raw NEFF bytes (base.py:L768-773), and each
#: torch-neuronx build pins one torch, whose version leads its own (2.1.2.2.4.0 is torch 2.1.2).
SDK_DISTRIBUTIONS = ("neuronx-cc", "libneuronxla", "transformers-neuronx", "torch-neuronx")
#: the same for NxD Inference: it traces with neuronx-distributed's ModelBuilder on
#: torch-neuronx and compiles with neuronx-cc (backend: nxdi)
NXDI_SDK_DISTRIBUTIONS = ("neuronx-cc", "libneuronxla", "torch-neuronx", "neuronx-distributed",
                          "neuronx-distributed-inference")
NXDI_CLASS_PREFIX = "nxdi:"
AMP_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
ABSENT = "absent"
#: config.json fields that do not change the compiled graph
IGNORED_CONFIG_FIELDS = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "_commit_hash", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "tokenizer_class", "initializer_range", "task_specific_params", "finetuning_task",
})
#: the family of every entry written before the key named one (all of them Llama)
LEGACY_FAMILY = "llama"
#: the class each backend built every entry with before families (and builds a Llama with)
LEGACY_CLASSES = {"neuron": "llama.model.LlamaForSampling",
                  "nxdi": "models.llama.modeling_llama.NeuronLlamaForCausalLM"}
#: key fields a different SDK install or different flags change (see `mismatch_fields`)
BUILD_FIELDS = ("sdk", "compiler_flags")


def sdk_versions(dists: tuple[str, ...] = SDK_DISTRIBUTIONS) -> dict[str, str]:
    """Installed Neuron SDK versions; "absent" for a distribution that is not installed."""
    out = {}
    for dist in dists:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = ABSENT
    return out


def graph_config(model_config: dict[str, Any]) -> dict[str, Any]:
    """config.json without the fields that leave the graph unchanged (ids, dtype, names)."""
    return {k: v for k, v in sorted(model_config.items())
            if k not in IGNORED_CONFIG_FIELDS and not k.endswith("_token_id")}


def read_model_config(checkpoint: Path) -> dict[str, Any]:
    path = Path(checkpoint) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CacheError(f"{path}: no such file; the compile-cache key needs the checkpoint's "
                         "config.json (check handler.checkpoint)") from exc
    except json.JSONDecodeError as exc:
        raise CacheError(f"{path}: not valid JSON ({exc}); re-export the checkpoint") from exc
    if not isinstance(data, dict):
        raise CacheError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class KeyInputs:
    """Everything that goes into the key; stored verbatim in each entry's metadata.json."""

    model_config: dict[str, Any]
    model_class: str
    tp_degree: int
    amp: str
    batch_size: int
    n_positions: int
    context_length_estimate: list[int]
    neuron_config: dict[str, Any]
    compiler_flags: list[str]
    sdk: dict[str, str] = field(default_factory=sdk_versions)
    #: the model family (handlers/families.py). Keyed since families beyond Llama came:
    #: a Llama key leaves it out, so every Llama entry written before keeps its digest
    family: str = LEGACY_FAMILY

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if data["family"] == LEGACY_FAMILY:
            del data["family"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KeyInputs:
        names = {f.name for f in dataclasses.fields(cls)}
        data = {"family": LEGACY_FAMILY, **data}
        if set(data) != names:
            raise CacheError(f"key inputs have fields {sorted(data)}, expected {sorted(names)}; "
                             "the entry was written by another inf2serve version: prune it")
        return cls(**data)

    @property
    def digest(self) -> str:
        return _digest(self.to_dict())

    @property
    def model_digest(self) -> str:
        """Identity of the model alone: entries sharing it are candidates for a mismatch report."""
        return _digest({"model_config": self.model_config, "model_class": self.model_class})

    @property
    def entry_name(self) -> str:
        """A directory name a person can read: model, layout, shapes, dtype, then the digest."""
        c = self.model_config
        model = "-".join(str(p) for p in (c.get("model_type", "model"),
                                          f"l{c.get('num_hidden_layers', '?')}",
                                          f"h{c.get('hidden_size', '?')}"))
        nc = self.neuron_config
        cb = "-cb" if nc.get("continuous_batching") or nc.get("is_continuous_batching") else ""
        lib = "nxdi-" if self.model_class.startswith(NXDI_CLASS_PREFIX) else ""
        return (f"{lib}{model}-tp{self.tp_degree}-b{self.batch_size}-n{self.n_positions}-{self.amp}"
                f"{cb}-{self.digest[:12]}")


def _digest(data: dict[str, Any]) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


#: handler.neuron.quantization's types and methods in transformers-neuronx's spelling
#: (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/config.py:L29-L71)
TNX_QUANT_DTYPES = {"int8": "s8", "fp8": "f8e4m3fn"}
TNX_QUANT_METHODS = {"per_channel": "vector_dynamic", "direct_cast": "direct_cast"}
#: and NxD Inference's (neuronx-distributed-inference@cd3abf3: models/config.py:L216-L226)
NXDI_QUANT_DTYPES = {"int8": "int8", "fp8": "f8e4m3"}


def neuron_config_spec(config: HandlerConfig) -> dict[str, Any]:
    """The NeuronConfig we build, as plain data (the backend turns it into SDK objects).
    A feature left off adds nothing, so the keys of configs without it never change."""
    n = config.neuron
    spec: dict[str, Any] = {
        "continuous_batching": config.batch_size if config.batching == "continuous" else None,
        "group_query_attention": n.gqa or None,
    }
    q = n.quantization
    if q.weights:  # dequantized to amp, as the SDK's guide requires and vLLM does
        spec["quant"] = {"quant_dtype": TNX_QUANT_DTYPES[q.weights],
                         "dequant_dtype": config.amp,
                         "quantize_method": TNX_QUANT_METHODS.get(q.method, q.method),
                         "no_quantize_list": [str(m) for m in q.skip_modules]}
    if q.kv_cache:
        spec["kv_cache_quant"] = {"quant_dtype": TNX_QUANT_DTYPES[q.kv_cache],
                                  "dequant_dtype": config.amp, "quantize_method": "direct_cast"}
    if n.on_device_sampling:  # per-slot parameters written at run time (dynamic)
        spec["on_device_generation"] = {"do_sample": True, "dynamic": True,
                                        "per_batch_line": True, "global_top_k": n.global_top_k}
    return spec


def context_buckets(config: HandlerConfig) -> list[int]:
    """Prefill buckets; an empty setting means one bucket of max_length."""
    return sorted(int(x) for x in config.neuron.context_length_estimate) or [config.max_length]


def nxdi_buckets(config: HandlerConfig) -> tuple[list[int], list[int], int]:
    """(prefill buckets, decode buckets, max_context_length) of an nxdi config."""
    top = config.nxdi.max_context_length or max(
        [config.max_length] if not config.neuron.context_length_estimate
        else config.neuron.context_length_estimate)
    ctx = sorted(int(x) for x in config.neuron.context_length_estimate) or [top]
    tkg = sorted(int(x) for x in config.nxdi.token_generation_buckets) or [config.max_length]
    return ctx, tkg, top


def nxdi_neuron_config(config: HandlerConfig) -> dict[str, Any]:
    """The keyword arguments of NxD Inference's NeuronConfig: every one changes the graphs.

    Continuous batching as vLLM's NxDI plugin runs it: one context row per call
    (ctx_batch_size=1), every slot a KV-cache line addressed by seq_id
    (vllm-project/vllm-neuron@a5ef7c8:vllm_neuron/worker/neuronx_distributed_model_loader.py:
    L751-L783). Buckets are always explicit, so the key names every compiled shape.
    """
    x, n = config.nxdi, config.neuron
    ctx, tkg, top = nxdi_buckets(config)
    sampling = None
    if n.on_device_sampling:
        sampling = {"dynamic": True, "do_sample": True, "deterministic": False,
                    "global_topk": n.global_top_k}
    return {
        "batch_size": config.batch_size, "ctx_batch_size": 1, "tkg_batch_size": config.batch_size,
        "is_continuous_batching": True, "seq_len": config.max_length, "max_context_length": top,
        "torch_dtype": AMP_DTYPES[config.amp], "tp_degree": n.tp_degree, "padding_side": "right",
        "enable_bucketing": True, "context_encoding_buckets": ctx,
        "token_generation_buckets": tkg, "on_device_sampling_config": sampling,
        "fused_qkv": x.fused_qkv, "sequence_parallel_enabled": x.sequence_parallel_enabled,
        "logical_nc_config": 1,  # Inf2 and Trn1 have one physical core per logical core
        **nxdi_features(config),
    }


def nxdi_features(config: HandlerConfig) -> dict[str, Any]:
    """Quantization and async mode as NeuronConfig keywords; nothing for a feature left
    off. The pre-quantized checkpoint's path is not here: the backend adds where it is."""
    q, out = config.neuron.quantization, {}
    if q.weights:
        out.update(quantized=True, quantization_type=f"{q.method}_symmetric",
                   quantization_dtype=NXDI_QUANT_DTYPES[q.weights],
                   modules_to_not_convert=[str(m) for m in q.skip_modules] or None)
    if q.kv_cache:
        out["kv_cache_quant"] = True
    if config.nxdi.async_mode:
        out["async_mode"] = True
    return out


def speculation_spec(config: HandlerConfig, draft_model_config: dict[str, Any] | None
                     ) -> dict[str, Any]:
    """handler.neuron.speculation as key data: the draft model's graph settings and k
    (the draft is compiled with the target: its config changes the graphs). Empty when
    speculation is off, so no other key changes."""
    sp = config.neuron.speculation
    if not sp.draft_checkpoint:
        return {}
    if draft_model_config is None:
        raise ValueError("handler.neuron.speculation is set: the key needs the draft "
                         "checkpoint's config.json (draft_model_config)")
    return {"speculation": {"length": sp.length,
                            "draft_model_config": graph_config(draft_model_config)}}


def key_inputs(config: HandlerConfig, model_config: dict[str, Any],
               sdk: dict[str, str] | None = None,
               draft_model_config: dict[str, Any] | None = None, *,
               model_class: str = "", family: str = "") -> KeyInputs:
    """The key of the model `config` describes, for a checkpoint with `model_config` (and,
    with speculation, a draft checkpoint with `draft_model_config`).

    `model_class`: the SDK class the backend builds (handlers.families.model_class_for);
    "" = the config's handler.neuron.model_class_name / handler.nxdi.model_class, else for
    a Llama the Llama class. `family`: the checkpoint's family; "" = its model_type."""
    n = config.neuron
    speculation = speculation_spec(config, draft_model_config)
    setting = config.nxdi.model_class if config.backend == "nxdi" else n.model_class_name
    family = family or str(model_config.get("model_type") or LEGACY_FAMILY)
    model_class = model_class or setting or (
        LEGACY_CLASSES[config.backend] if family == LEGACY_FAMILY else "")
    if not model_class:
        raise ValueError(f"the key of a {family} checkpoint needs its model class: pass "
                         "model_class (handlers.families.model_class_for resolves it)")
    if config.backend == "nxdi":
        return KeyInputs(
            model_config=graph_config(model_config),
            model_class=NXDI_CLASS_PREFIX + model_class, tp_degree=n.tp_degree,
            amp=config.amp, batch_size=config.batch_size, n_positions=config.max_length,
            context_length_estimate=nxdi_buckets(config)[0],
            neuron_config={**nxdi_neuron_config(config), **speculation},
            compiler_flags=[str(f) for f in n.compiler_flags],
            sdk=sdk_versions(NXDI_SDK_DISTRIBUTIONS) if sdk is None else dict(sdk),
            family=family)
    return KeyInputs(
        model_config=graph_config(model_config), model_class=model_class,
        tp_degree=n.tp_degree, amp=config.amp, batch_size=config.batch_size,
        n_positions=config.max_length, context_length_estimate=context_buckets(config),
        neuron_config={**neuron_config_spec(config), **speculation},
        compiler_flags=[str(f) for f in n.compiler_flags],
        sdk=sdk_versions() if sdk is None else dict(sdk), family=family,
    )


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def differences(ours: KeyInputs, theirs: KeyInputs) -> dict[str, tuple[Any, Any]]:
    """Field path -> (our value, their value) for every key input that differs."""
    a, b = _flatten(ours.to_dict()), _flatten(theirs.to_dict())
    return {k: (a.get(k, ABSENT), b.get(k, ABSENT)) for k in sorted(set(a) | set(b))
            if a.get(k, ABSENT) != b.get(k, ABSENT)}


def is_build_mismatch(ours: KeyInputs, theirs: KeyInputs) -> bool:
    """Same model and shapes, built by another SDK or with other flags."""
    diff = differences(ours, theirs)
    return bool(diff) and all(k.split(".")[0] in BUILD_FIELDS for k in diff)
