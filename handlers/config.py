"""Typed model-config.yaml: parsed and validated once, at packaging and at load.

Every default lives here, in the dataclass fields. Unknown keys are rejected with
the closest valid name; values are checked against their type, choices and range;
cross-field rules (frontend batch vs backend batch, token limits vs context) run
after parsing. Nothing else in the toolkit reads the YAML.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from handlers.errors import ConfigError
from handlers.presets.chat_templates import PRESETS as CHAT_PRESETS
from handlers.presets.chat_templates import is_inline
from handlers.presets.synthetic_timing import PRESETS, resolve_timing

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256  # per stop string: each is searched for at every step
MAX_SEED = 2**63 - 1
#: handler.dtype's Neuron spelling (transformers-neuronx's `amp`, the compile-cache key's)
DTYPE_AMP = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
AMP_DTYPE = {amp: dtype for dtype, amp in DTYPE_AMP.items()}
#: what handler.dtype `auto` resolves to: the precision each backend has always defaulted to
AUTO_DTYPE = {"torch": "float32", "synthetic": "float32", "neuron": "bfloat16",
              "nxdi": "bfloat16"}


def resolve_dtype(backend: str, dtype: str) -> str:
    """handler.dtype as a torch dtype name: `auto` is the backend's own default, so a
    config that leaves precision out runs as it did when each backend had its own key."""
    return AUTO_DTYPE[backend] if dtype == "auto" else dtype


def _opt(default: Any, *, choices: tuple = (), lo: float | None = None, hi: float | None = None,
         key: str | None = None, doc: str = "") -> Any:
    """A dataclass field with validation metadata (choices, inclusive range, YAML key)."""
    meta = {"choices": choices, "lo": lo, "hi": hi, "key": key, "doc": doc}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class GenerationDefaults:
    """Per-request defaults, used when a request leaves a field out: every request field
    but `prompt` and `timeout` (whose default is handler.request_timeout_s)."""

    max_new_tokens: int = _opt(64, lo=1)
    min_new_tokens: int = _opt(0, lo=0, doc="EOS suppressed until then; <= max_new_tokens")
    temperature: float = _opt(0.0, lo=0.0, doc="0 means greedy")
    top_k: int = _opt(0, lo=0, doc="0 disables top-k")
    top_p: float = _opt(1.0, lo=0.0, hi=1.0)
    stop: list[str] = _opt([], doc=f"up to {MAX_STOP_STRINGS} non-empty strings")
    seed: int | None = _opt(None, lo=0, hi=MAX_SEED, doc="null = a random seed per request")
    stream: bool = _opt(True)
    stream_format: str = _opt("text", choices=("text", "ndjson"))
    details: bool = _opt(False, doc="add the generated token ids to the final answer")


@dataclass(frozen=True)
class QuantizationSettings:
    """Quantized weights and KV cache on both Neuron backends (`handler.neuron.quantization`).

    int8 weights take half the bytes of bf16, so a model fits fewer NeuronCores (a smaller
    instance) and each decode step reads half as much; AWS's published Inf2 Llama-3-8B
    figures are int8. The two SDKs quantize differently: transformers-neuronx at every load,
    from the checkpoint as it is; NxD Inference from a pre-quantized checkpoint, which the
    toolkit writes into the compile cache (`inf2serve compile`, or a worker's first load).
    docs/inferentia2.md says what each setting costs."""

    weights: str = _opt("", choices=("", "int8", "fp8"),
                        doc="'' = handler.dtype; int8 (s8 / int8) or fp8 (e4m3), with the "
                            "scales of `method`, computed in handler.dtype")
    method: str = _opt("per_channel", choices=("per_channel", "per_tensor"),
                       doc="weight scales: per output channel (both backends) or per tensor "
                           "(nxdi only)")
    kv_cache: str = _opt("", choices=("", "int8", "fp8"),
                         doc="'' = handler.dtype; fp8 on both backends, int8 on neuron only "
                             "(a cast without scales)")
    skip_modules: list[str] = _opt([], doc="nxdi: modules kept in handler.dtype "
                                           "(modules_to_not_convert, e.g. lm_head); neuron: "
                                           "fp8 only, layers (model.layers.N) whose MLP is cast "
                                           "to fp8 without scales (no_quantize_list)")

    @property
    def enabled(self) -> bool:
        return bool(self.weights or self.kv_cache)


@dataclass(frozen=True)
class SpeculationSettings:
    """Speculative decoding with a draft model on both Neuron backends
    (`handler.neuron.speculation`): the draft proposes `length` tokens, the target checks
    them in one step and keeps the longest agreeing run plus a token of its own, so a step
    yields 1 to length + 1 tokens for about the price of one. Both SDKs run it fused (draft
    and target in one compiled graph) with sampling on the device: transformers-neuronx's
    FusedSpeculativeDecoder, NxD Inference's enable_fused_speculation. docs/inferentia2.md
    says when it helps (latency at low batch) and when it hurts."""

    draft_checkpoint: str = _opt("", doc="the draft model's checkpoint directory, relative to "
                                         "the model dir (packaged with --draft-checkpoint); "
                                         "'' = no speculation")
    length: int = _opt(4, lo=1, hi=16, doc="draft tokens proposed per step (k)")
    draft_architecture: str = _opt("", doc="known architecture of the draft (e.g. llama-3.2-1b) "
                                           "for `validate` without its checkpoint")

    @property
    def enabled(self) -> bool:
        return bool(self.draft_checkpoint)


@dataclass(frozen=True)
class NeuronSettings:
    """Settings of both Neuron backends (transformers-neuronx: backend neuron; NxD Inference:
    backend nxdi, whose own settings are `handler.nxdi`); only read by those backends."""

    tp_degree: int = _opt(2, lo=1, hi=128, doc="NeuronCores per model; the Inf2 runtime supports "
                                                "1, 2, 4, 8, 24 (`inf2serve validate` checks)")
    model_class_name: str = _opt("", doc="transformers-neuronx class, e.g. 'mistral.model."
                                         "MistralForSampling'; empty = the checkpoint's family "
                                         "class (handlers/families.py)")
    context_length_estimate: list[int] = _opt([], lo=1,
                                              doc="prefill buckets; empty = n_positions")
    compiler_flags: list[str] = _opt(["--model-type=transformer"])
    gqa: str = _opt("", choices=("", "shard-over-heads", "shard-over-batch", "replicated-heads",
                                 "all-gather-heads"))
    cache_dir: str = _opt("neuron_cache", doc="compile cache, relative to the model dir")
    on_mismatch: str = _opt("error", choices=("error", "recompile"))
    cores_per_instance: int = _opt(0, lo=0, doc="0 = detect; NeuronCores this host has")
    core_lock_dir: str = _opt("/tmp/inf2serve-cores")
    compilation_worker_count: int = _opt(
        1, lo=0, hi=64, doc="graphs compiled at once by to_neuron(); 0 = all at once (the SDK's "
                            "default). Each compiler process needs GBs of host memory")
    architecture: str = _opt("", doc="known architecture (e.g. llama-2-7b) for `validate` "
                                     "without a checkpoint")
    quantization: QuantizationSettings = field(default_factory=QuantizationSettings)
    on_device_sampling: bool = _opt(False, doc="sample on the device with each request's "
                                               "top-k/top-p/temperature; requests with a seed, "
                                               "min_new_tokens, penalties or logprobs are "
                                               "refused (continuous batching only)")
    global_top_k: int = _opt(256, lo=1, doc="on-device sampling draws from this many best "
                                            "tokens; a request's top_k above it is refused")
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)


@dataclass(frozen=True)
class SyntheticSettings:
    """The synthetic device (handlers/backends/synthetic_backend.py); only read when backend
    is synthetic. Unset keys come from the preset (handlers/presets/synthetic_timing.py)."""

    preset: str = _opt("", choices=("", *PRESETS), doc="published Inf2 decode figures")
    decode_step_ms: float | None = _opt(None, lo=0.0, doc="a decode call at batch 1; required "
                                                         "without a preset")
    decode_ms_per_row: float | None = _opt(None, lo=0.0, doc="added per compiled row beyond "
                                                            "the first; default 0 (preset: its "
                                                            "batch-1 to batch-8 slope)")
    context_length_estimate: list | None = _opt(None, doc="prefill buckets; default: the "
                                                          "preset's, else [max_length]")
    prefill_ms: list | None = _opt(None, doc="one per bucket: a prefill call costs its longest "
                                             "prompt's bucket; default: the preset's "
                                             "(estimates), else one decode step")
    speculation_length: int = _opt(
        0, lo=0, hi=32, doc="0 = off; else each decode call runs this many draft steps and one "
                            "target step, and each row keeps 1 to this + 1 tokens")
    draft_step_ms: float | None = _opt(None, lo=0.0, doc="one draft step; default a tenth of "
                                                         "the target's decode step")
    acceptance_rate: float = _opt(0.7, lo=0.0, hi=1.0,
                                  doc="chance that each draft token is accepted, given the ones "
                                      "before it were (drawn per row and position: "
                                      "deterministic for greedy and seeded rows)")
    host_sampling_vocab: int = _opt(
        0, lo=0, hi=1_000_000,
        doc="0 = off; else each call returns float32 logits [rows, this vocabulary] that the "
            "host samples after the device step with the Neuron backends' batched sampler, "
            "so host efficiency pays for it (the synthetic tokens still win: same outputs)")
    host_sampling_logits: str = _opt(
        "nxdi", choices=("nxdi", "neuron"),
        doc="the SDK whose host-sampling logits the device hands back: nxdi = float32 [rows, "
            "vocab], contiguous (cast on the device); neuron = transformers-neuronx's, the "
            "device's bf16 [vocab, 1, rows], viewed transposed (kept bf16, as the neuron "
            "backend asks: cast_logits_dtype)")
    host_sampling_floor: bool = _opt(
        False, doc="bench: instead of sampling, the host reads the logits once (numpy's max over "
                   "the whole buffer, the fastest whole read) and keeps the synthetic tokens: "
                   "the least any exact host sampler pays, which every logit can change")


@dataclass(frozen=True)
class NxdiSettings:
    """NxD Inference settings; only read when backend is nxdi. tp_degree, prefill
    buckets (context_length_estimate), compiler_flags, the compile cache and NeuronCore
    allocation come from `handler.neuron`, which means the same for both backends."""

    model_class: str = _opt("", doc="class under neuronx_distributed_inference, e.g. "
                                    "'models.qwen2.modeling_qwen2.NeuronQwen2ForCausalLM'; "
                                    "empty = the checkpoint's family class "
                                    "(handlers/families.py)")
    token_generation_buckets: list[int] = _opt([], lo=1, doc="KV-length buckets of decode; "
                                                              "empty = max_length")
    max_context_length: int = _opt(0, lo=0, doc="longest prompt compiled; 0 = the largest "
                                                "prefill bucket (or max_length)")
    async_mode: bool = _opt(False, doc="NxD Inference queues the next decode before the host "
                                       "has read this one; needs handler.neuron."
                                       "on_device_sampling")
    fused_qkv: bool = _opt(False)
    sequence_parallel_enabled: bool = _opt(False)


@dataclass(frozen=True)
class HandlerConfig:
    """The `handler:` section: what the toolkit itself reads."""

    backend: str = _opt("torch", choices=("torch", "neuron", "nxdi", "synthetic"),
                        doc="synthetic: no model, a device that sleeps (host-efficiency "
                            "benchmarks; never a hardware result)")
    checkpoint: str = _opt("model", doc="checkpoint directory, relative to the model dir")
    batching: str = _opt("continuous", choices=("continuous", "micro"))
    batch_size: int = _opt(4, lo=1, hi=256, doc="sequences the backend runs at once (slots)")
    micro_batch_size: int = _opt(0, lo=0, hi=256, doc="micro mode; 0 = batch_size")
    batch_delay_ms: int = _opt(20, lo=0, hi=10_000, doc="micro mode: wait to fill a micro-batch")
    max_length: int = _opt(2048, lo=2, doc="prompt + generated tokens per sequence")
    max_new_tokens_limit: int = _opt(512, lo=1)
    max_queue: int = _opt(64, lo=1, doc="waiting requests before 503")
    request_timeout_s: float = _opt(
        300.0, lo=0.0, doc="deadline of a request that sets no `timeout`, in seconds from its "
                           "arrival at the worker; 0 = none. The only way an abandoned request "
                           "frees its slot (TorchServe 0.12 reports no disconnects)")
    max_request_timeout_s: float = _opt(3600.0, lo=0.0,
                                        doc="the longest `timeout` a request may ask; 0 = no cap")
    dtype: str = _opt("auto", choices=("auto", "float32", "bfloat16", "float16"),
                      doc="weights and compute, every backend; auto = float32 for torch and "
                          "synthetic, bfloat16 for neuron and nxdi")
    device: str = _opt("auto", choices=("auto", "cpu", "cuda"))
    threads: int = _opt(0, lo=0, doc="torch intra-op threads; 0 = torch default")
    warmup: bool = _opt(True)
    engine_process: str = _opt(
        "child", choices=("child", "inline"),
        doc="child: the model runs in a process the worker supervises (its death fails its "
            "requests at once, then it restarts); inline: in the worker (one process)")
    step_timeout_s: float = _opt(
        0.0, lo=0.0, hi=86_400.0,
        doc="a model process whose engine spends longer in one step (a stuck device call, a "
            "deadlock) is killed: its requests fail with a 500 and it restarts from the compile "
            "cache. 0 = auto: 20 device steps of the synthetic device (at least 5 s), else "
            "120 s. engine_process child only")
    worker_service: str = _opt(
        "inf2serve", choices=("inf2serve", "torchserve"),
        doc="who runs TorchServe's async protocol in the worker: inf2serve's service "
            "(handlers/torchserve/worker_service.py: one writer to the socket, ~1 ms less CPU per "
            "request) or TorchServe's own AsyncService")
    worker_takeover: bool = _opt(
        True, doc="a worker that dies is replaced on its own socket by a new worker, which the "
                  "guardian starts once it has answered the dead one's requests (docs/design.md); "
                  "false: the guardian answers them and closes the socket, and TorchServe "
                  "restarts the worker (requests sent meanwhile may go unanswered). "
                  "worker_service inf2serve and engine_process child only")
    chat_template: str = _opt("", doc="OpenAI chat: preset (llama-2), inline Jinja or a file in "
                                      "the checkpoint dir; empty = the tokenizer's template")
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    neuron: NeuronSettings = field(default_factory=NeuronSettings)
    synthetic: SyntheticSettings = field(default_factory=SyntheticSettings)
    nxdi: NxdiSettings = field(default_factory=NxdiSettings)

    @property
    def effective_micro_batch_size(self) -> int:
        return self.micro_batch_size or self.batch_size

    @property
    def effective_step_timeout_s(self) -> float:
        """step_timeout_s, or its automatic bound: the longest call a synthetic device makes,
        20 times over, or 120 s where a step's time is the model's (a CPU prefill of a long
        prompt takes seconds; a Neuron decode step 6-100 ms, a prefill at most a few s)."""
        if self.step_timeout_s:
            return self.step_timeout_s
        if self.backend == "synthetic":
            t = resolve_timing(self.synthetic, self.max_length)
            return max(5.0, 20 * max(t.decode_s(self.batch_size), max(t.prefill_ms) / 1000))
        return 120.0

    @property
    def torch_dtype(self) -> str:
        """handler.dtype resolved for this backend (`auto` is never left)."""
        return resolve_dtype(self.backend, self.dtype)

    @property
    def amp(self) -> str:
        """The same precision in the Neuron SDK's spelling (bf16, f16, f32), as the
        compile-cache key has always recorded it."""
        return DTYPE_AMP[self.torch_dtype]


@dataclass(frozen=True)
class FrontendConfig:
    """TorchServe's own keys (top level of model-config.yaml)."""

    min_workers: int = _opt(1, lo=1, key="minWorkers")
    max_workers: int = _opt(1, lo=1, key="maxWorkers")
    batch_size: int = _opt(1, lo=1, key="batchSize")
    max_batch_delay: int = _opt(0, lo=0, key="maxBatchDelay")
    response_timeout: int = _opt(300, lo=1, key="responseTimeout")
    startup_timeout: int = _opt(600, lo=1, key="startupTimeout")
    async_communication: bool = _opt(True, key="asyncCommunication")
    continuous_batching: bool = _opt(False, key="continuousBatching")
    device_type: str = _opt("cpu", choices=("cpu", "gpu", "neuron"), key="deviceType")
    job_queue_size: int = _opt(0, lo=0, key="jobQueueSize")
    client_timeout_ms: int = _opt(0, lo=0, key="clientTimeoutInMills")


@dataclass(frozen=True)
class ModelConfig:
    frontend: FrontendConfig
    handler: HandlerConfig

    def to_yaml_dict(self) -> dict[str, Any]:
        """The file TorchServe reads: frontend keys at the top, ours under `handler:`."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(FrontendConfig):
            out[f.metadata["key"]] = getattr(self.frontend, f.name)
        out["handler"] = dataclasses.asdict(self.handler)
        return out


def _yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (list, dict):
        return f"{origin.__name__} of {' to '.join(map(_type_name, typing.get_args(tp)))}"
    return getattr(tp, "__name__", str(tp))


_SCALARS = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def _check_value(f: dataclasses.Field, tp: Any, value: Any, path: str) -> Any:
    """`value` as type `tp`: a scalar (with the field's choices and range), a nested
    settings block (a dataclass), or a list/mapping of any of these, checked element by
    element so that an error names the element (handler.neuron.compiler_flags[2])."""
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return _build(tp, value, path)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
        return value if not args else [_check_value(f, args[0], item, f"{path}[{i}]")
                                       for i, item in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
        if not args:
            return value
        keys, values = args
        return {_check_value(f, keys, k, f"{path} key {k!r}"): _check_value(f, values, v,
                                                                           f"{path}.{k}")
                for k, v in value.items()}
    if isinstance(tp, types.UnionType) and type(None) in args:  # optional: null = unset
        if value is None:
            return None
        return _check_value(f, next(a for a in args if a is not type(None)), value, path)
    if tp not in _SCALARS:
        raise TypeError(f"{path}: config fields of type {tp!r} are not supported")
    if not _SCALARS[tp](value):
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    meta = f.metadata
    if meta.get("choices") and value not in meta["choices"]:
        allowed = ", ".join(repr(c) for c in meta["choices"])
        raise ConfigError(f"{path}: {value!r} is not allowed; choose one of {allowed}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ConfigError(f"{path}: {value!r} is out of range; allowed {rng}")
    return float(value) if tp is float else value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    fields = {_yaml_key(f): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path}: unknown key{hint} (valid: {', '.join(sorted(fields))})")
        f = fields[key]
        kwargs[f.name] = _check_value(f, hints[f.name], value, path)  # `key: null` = unset
    return cls(**kwargs)


def _cross_check(cfg: ModelConfig) -> None:
    h, fe = cfg.handler, cfg.frontend
    if h.batching == "micro" and h.micro_batch_size > h.batch_size:
        raise ConfigError(
            f"handler.micro_batch_size: {h.micro_batch_size} exceeds handler.batch_size "
            f"{h.batch_size}; a micro-batch runs in the backend's batch, so lower it or raise "
            "batch_size")
    if h.max_new_tokens_limit >= h.max_length:
        raise ConfigError(
            f"handler.max_new_tokens_limit: {h.max_new_tokens_limit} leaves no room for a prompt "
            f"in max_length {h.max_length}; set it below max_length")
    if h.defaults.max_new_tokens > h.max_new_tokens_limit:
        raise ConfigError(
            f"handler.defaults.max_new_tokens: {h.defaults.max_new_tokens} exceeds "
            f"handler.max_new_tokens_limit {h.max_new_tokens_limit}")
    cap = h.max_request_timeout_s
    if cap and not 0 < h.request_timeout_s <= cap:
        raise ConfigError(
            f"handler.request_timeout_s: {h.request_timeout_s:g} must be in (0, "
            f"handler.max_request_timeout_s {cap:g}]; raise the cap or set it to 0 (no cap)")
    for key in ("request_timeout_s", "max_request_timeout_s"):
        value = getattr(h, key)
        if fe.client_timeout_ms and not 0 < value * 1000 <= fe.client_timeout_ms:
            raise ConfigError(
                f"handler.{key}: {value:g} must be in (0, clientTimeoutInMills/1000 = "
                f"{fe.client_timeout_ms / 1000:g}]: TorchServe drops every message of a request "
                "after that time, so a longer stream would leave its client waiting for an end "
                "that never comes (AsyncBatchAggregator.java:100-111)")
    d = h.defaults
    if not (0.0 < d.top_p <= 1.0) or d.temperature > 100.0:
        raise ConfigError(f"handler.defaults: top_p {d.top_p} must be in (0, 1] and temperature "
                          f"{d.temperature} in [0, 100], the ranges a request may ask for")
    if d.min_new_tokens > d.max_new_tokens:
        raise ConfigError(f"handler.defaults.min_new_tokens: {d.min_new_tokens} exceeds "
                          f"handler.defaults.max_new_tokens {d.max_new_tokens}")
    if (len(d.stop) > MAX_STOP_STRINGS
            or not all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in d.stop)):
        raise ConfigError(f"handler.defaults.stop: {d.stop!r}; expected at most "
                          f"{MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} "
                          "characters, the limits a request has")
    _check_chat_template_name(h.chat_template)
    n = h.neuron
    bad = [x for x in n.context_length_estimate
           if isinstance(x, bool) or not isinstance(x, int) or not 0 < x <= h.max_length]
    if bad:
        raise ConfigError(f"handler.neuron.context_length_estimate: {bad} are not prefill lengths; "
                          f"use integers in [1, handler.max_length {h.max_length}]")
    if h.backend == "synthetic":
        resolve_timing(h.synthetic, h.max_length)  # raises ConfigError naming the key
    if h.backend in ("neuron", "nxdi"):
        _check_neuron_features(h)
    if h.backend == "nxdi":
        _check_nxdi(h)
    if not fe.async_communication:
        raise ConfigError(
            "asyncCommunication: must be true; the handler streams every request on its own and "
            "schedules batches itself (micro or continuous, see handler.batching)")
    if fe.continuous_batching:
        raise ConfigError(
            "continuousBatching: must be false; inf2serve does continuous batching inside the "
            "worker (handler.batching: continuous) on top of asyncCommunication")
    if fe.batch_size != 1:
        raise ConfigError(
            f"batchSize: {fe.batch_size}; must be 1. Under asyncCommunication each request goes to "
            "the worker on its own and the handler batches them (handler.batch_size, "
            "micro_batch_size, batch_delay_ms); TorchServe 0.12's async aggregator fails on "
            "frontend batches larger than 1")
    if fe.min_workers > fe.max_workers:
        raise ConfigError(f"minWorkers: {fe.min_workers} exceeds maxWorkers {fe.max_workers}")


def _check_chat_template_name(setting: str) -> None:
    """Catch a misspelt preset (`llama2`) without the checkpoint: a value that is not a
    preset, not inline Jinja and not a file name (no suffix, no folder) can only be a typo.
    Whether a named file exists is checked where the checkpoint is (package, validate)."""
    if not setting or setting in CHAT_PRESETS or is_inline(setting):
        return
    path = Path(setting)
    if path.suffix or len(path.parts) > 1:
        return
    close = difflib.get_close_matches(setting, list(CHAT_PRESETS), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"handler.chat_template: {setting!r} is not a preset "
                      f"({', '.join(CHAT_PRESETS)}), inline Jinja, or a file name such as "
                      f"chat.jinja{hint}")


def _check_neuron_features(h: HandlerConfig) -> None:
    """What each SDK refuses of quantization, on-device sampling and speculation, named by
    our keys."""
    q, n = h.neuron.quantization, h.neuron
    key = "handler.neuron.quantization"
    sp = n.speculation
    if sp.enabled:
        if not n.on_device_sampling:
            # transformers-neuronx: FusedSpeculativeDecoder asserts on_device_generation
            # (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/
            # fused_speculation.py:L281-L325); NxD Inference asserts on-device sampling
            raise ConfigError("handler.neuron.speculation: needs handler.neuron."
                              "on_device_sampling: true (both SDKs verify and sample the "
                              "draft's tokens on the device)")
        if h.batching != "continuous":
            raise ConfigError("handler.neuron.speculation: needs handler.batching 'continuous'")
        if sp.length + 1 >= h.max_length:
            raise ConfigError(f"handler.neuron.speculation.length: {sp.length} leaves no room "
                              f"in handler.max_length {h.max_length}")
        if h.max_new_tokens_limit >= h.max_length - sp.length:
            # a step writes up to `length` positions past the last token kept, so a sequence
            # holds max_length - length positions
            raise ConfigError(f"handler.max_new_tokens_limit: {h.max_new_tokens_limit} leaves "
                              f"no room for a prompt in the {h.max_length - sp.length} positions "
                              f"speculation keeps (handler.max_length {h.max_length} less "
                              f"speculation.length {sp.length}); lower it")
    if h.backend == "neuron":
        if q.weights and q.method == "per_tensor":
            # transformers-neuronx: quantize_method in ['vector_dynamic', 'direct_cast']
            # (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/config.py:L35);
            # its direct_cast weights fail at load (quantize.py:L110: tensor.to('s8') reads
            # 's8' as a device), so per_channel (vector_dynamic) is the one that works
            raise ConfigError(f"{key}.method: 'per_tensor' is not a transformers-neuronx "
                              "method; choose 'per_channel' (vector_dynamic), or use backend "
                              "nxdi")
        if any("self_attn" in m for m in q.skip_modules):
            # decoder.py:L1591-L1593
            raise ConfigError(f"{key}.skip_modules: transformers-neuronx refuses 'self_attn' "
                              "(\"self attn quantization not allowed for this model\"); "
                              "remove it")
        if q.skip_modules and q.weights != "fp8":
            # int8 ignores no_quantize_list: only fp8 reads it, as a unit scale
            # (quantize.py:L87-L101)
            raise ConfigError(f"{key}.skip_modules: {list(q.skip_modules)} would change nothing "
                              "with int8 weights on transformers-neuronx (every layer is "
                              "quantized; only fp8 reads it); remove it, use weights: fp8, or "
                              "backend nxdi (modules_to_not_convert)")
        if n.on_device_sampling and h.batching != "continuous":
            raise ConfigError("handler.neuron.on_device_sampling: needs handler.batching "
                              "'continuous'; micro batching samples through the SDK's sample(), "
                              "which ignores per-request parameters on the device")
    else:
        if q.weights and q.method == "per_tensor" and q.skip_modules:
            # its per-tensor quantizer takes no modules_to_not_convert and quantizes every
            # Linear into the checkpoint (models/application_base.py:L776-L779), while the
            # traced model keeps those modules unquantized (models/model_wrapper.py:
            # L1692-L1706): the two would not match
            raise ConfigError(f"{key}.skip_modules: NxD Inference's per-tensor quantizer "
                              "quantizes every layer into the checkpoint while the compiled "
                              "model keeps the skipped ones in handler.dtype; use method: "
                              "per_channel, or no skip_modules")
        if q.kv_cache == "int8":
            # its KV-cache quantization is fp8 (models/config.py:L299-L304 with
            # neuronx-distributed's KVQuantizationConfig)
            raise ConfigError(f"{key}.kv_cache: 'int8' is not an NxD Inference KV-cache type; "
                              "choose 'fp8' or '' (handler.dtype)")
        if h.nxdi.async_mode and not n.on_device_sampling:
            # each async step feeds the device's own output back as the next input ids
            # (modules/async_execution.py:L261-L274), so tokens must come from the device
            raise ConfigError("handler.nxdi.async_mode: needs handler.neuron.on_device_sampling: "
                              "true (the next step's input is the device's own token)")


def _check_nxdi(h: HandlerConfig) -> None:
    x = h.nxdi
    if h.batching != "continuous":
        raise ConfigError(f"handler.batching: {h.batching!r} with backend nxdi; NxD Inference "
                          "runs continuous batching only (one KV-cache line per sequence)")
    bad = [b for b in x.token_generation_buckets
           if isinstance(b, bool) or not isinstance(b, int) or not 0 < b <= h.max_length]
    if bad:
        raise ConfigError(f"handler.nxdi.token_generation_buckets: {bad} must be integers in "
                          f"[1, handler.max_length {h.max_length}] (NeuronConfig asserts the "
                          "largest <= max_length)")
    if x.token_generation_buckets and not bad and max(x.token_generation_buckets) != h.max_length:
        raise ConfigError(f"handler.nxdi.token_generation_buckets: the largest, "
                          f"{max(x.token_generation_buckets)}, must be handler.max_length "
                          f"{h.max_length}: a decode at a position past the largest bucket fails")
    if x.max_context_length > h.max_length:
        raise ConfigError(f"handler.nxdi.max_context_length: {x.max_context_length} exceeds "
                          f"handler.max_length {h.max_length}")
    top = x.max_context_length or h.max_length
    over = [b for b in h.neuron.context_length_estimate if isinstance(b, int) and b > top]
    if over:
        raise ConfigError(f"handler.neuron.context_length_estimate: {over} exceed "
                          f"handler.nxdi.max_context_length {top}; NeuronConfig asserts every "
                          "prefill bucket <= max_context_length")


def _legacy_amp(handler: dict[str, Any]) -> dict[str, Any]:
    """`handler` with a legacy handler.neuron.amp folded into handler.dtype: precision was
    two keys (amp for the Neuron backends, dtype for torch) and is one now, so configs and
    archives written before still load, and a file that sets both differently is refused
    rather than one of them silently ignored."""
    neuron = handler.get("neuron")
    if not isinstance(neuron, dict) or "amp" not in neuron:
        return handler
    neuron = dict(neuron)
    amp = neuron.pop("amp")
    if not isinstance(amp, str) or amp not in AMP_DTYPE:
        allowed = ", ".join(repr(a) for a in AMP_DTYPE)
        raise ConfigError(f"handler.neuron.amp: {amp!r} is not allowed; choose one of {allowed} "
                          "(or better, set handler.dtype)")
    warnings.warn(f"handler.neuron.amp is deprecated; use handler.dtype: {AMP_DTYPE[amp]} "
                  "(one precision key for every backend)", DeprecationWarning, stacklevel=3)
    if handler.get("backend", "torch") not in ("neuron", "nxdi"):
        return {**handler, "neuron": neuron}  # it never applied there: ignored, as before
    dtype = handler.get("dtype")
    if isinstance(dtype, str) and dtype in DTYPE_AMP and dtype != AMP_DTYPE[amp]:
        raise ConfigError(f"handler.neuron.amp: {amp!r} conflicts with handler.dtype {dtype!r}; "
                          "precision is one key now, handler.dtype: remove handler.neuron.amp")
    if dtype in (None, "auto"):
        dtype = AMP_DTYPE[amp]
    return {**handler, "neuron": neuron, "dtype": dtype}  # a bad dtype is reported by _build


#: handler.nxdi keys that became handler.neuron keys (one setting for both Neuron backends)
NXDI_MOVED = {"on_device_sampling": "on_device_sampling", "global_topk": "global_top_k"}


def _legacy_nxdi(handler: dict[str, Any]) -> dict[str, Any]:
    """`handler` with handler.nxdi.on_device_sampling / global_topk moved to handler.neuron,
    where on-device sampling is set for both Neuron backends now; a file that sets both
    places differently is refused."""
    nxdi = handler.get("nxdi")
    if not isinstance(nxdi, dict) or not set(nxdi) & set(NXDI_MOVED):
        return handler
    nxdi, neuron = dict(nxdi), dict(handler.get("neuron") or {})
    for old, new in NXDI_MOVED.items():
        if old not in nxdi:
            continue
        value = nxdi.pop(old)
        if new in neuron and neuron[new] != value:
            raise ConfigError(f"handler.nxdi.{old}: {value!r} conflicts with handler.neuron.{new} "
                              f"{neuron[new]!r}; it is one setting now, handler.neuron.{new}: "
                              f"remove handler.nxdi.{old}")
        warnings.warn(f"handler.nxdi.{old} is deprecated; use handler.neuron.{new} (one "
                      "setting for both Neuron backends)", DeprecationWarning, stacklevel=3)
        neuron[new] = value
    return {**handler, "nxdi": nxdi, "neuron": neuron}


#: the settings only the Neuron backends read, and those backends
NEURON_ONLY = {"neuron": ("neuron", "nxdi"), "nxdi": ("nxdi",)}


def _changed(value: Any, default: Any, path: str) -> list[str]:
    """The dotted keys where a settings block differs from its defaults (nested blocks
    by their own keys: handler.neuron.quantization.weights)."""
    if not dataclasses.is_dataclass(value):
        return [] if value == default else [path]
    return [key for f in dataclasses.fields(value)
            for key in _changed(getattr(value, f.name), getattr(default, f.name),
                                f"{path}.{_yaml_key(f)}")]


def _refuse_neuron_only(h: HandlerConfig) -> None:
    """A Neuron-only setting on a backend that never reads it (handler.neuron.quantization
    on torch, say) is refused by name rather than ignored: the user expects int8 weights or
    speculation and would silently get neither. Only values other than the defaults count,
    so a config written out whole (ModelConfig.to_yaml_dict) still loads; a legacy
    handler.neuron.amp on torch is gone before this (_legacy_amp: it never applied there)."""
    if h.backend not in ("torch", "synthetic"):
        return
    for section, readers in NEURON_ONLY.items():
        value = getattr(h, section)
        keys = _changed(value, type(value)(), f"handler.{section}")
        if keys:
            raise ConfigError(f"{', '.join(keys)}: set, but handler.backend is {h.backend!r}, "
                              f"which never reads handler.{section} (only "
                              f"{' and '.join(readers)} do); remove it, or set "
                              f"handler.backend: {readers[0]}")


def parse_config(data: dict[str, Any] | None) -> ModelConfig:
    """Build a validated ModelConfig from the YAML mapping (TorchServe keys + `handler:`)."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"model-config.yaml: expected a mapping at the top level, got "
                          f"{type(data).__name__}")
    data = dict(data or {})
    handler = data.pop("handler", {}) or {}
    if not isinstance(handler, dict):
        raise ConfigError("handler: expected a mapping")
    handler = _legacy_nxdi(_legacy_amp(handler))
    cfg = ModelConfig(frontend=_build(FrontendConfig, data), handler=_build(HandlerConfig, handler,
                                                                              "handler"))
    _cross_check(cfg)
    _refuse_neuron_only(cfg.handler)  # last: a misspelt key or a bad value is named first
    return cfg


def load_config(path: str | Path) -> ModelConfig:
    from handlers.config_yaml import load_yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        data = load_yaml(path.read_text(encoding="utf-8"), path)  # a key given twice: refused
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return parse_config(data)
