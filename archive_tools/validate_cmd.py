"""`inf2serve validate CONFIG`: will this model-config.yaml fit and shard on an Inf2 instance?

Checks, beyond load_config's keys and types: tp_degree is one the Neuron runtime
supports and the instance can host; heads padded and K/V heads replicated the way
transformers-neuronx does it (warnings with the numbers); workers x tp_degree
cores exist; device memory per NeuronCore fits 16 GiB with headroom; and an
estimate of host memory while loading weights and compiling graphs. The
architecture comes from a checkpoint's config.json, or from
handler.neuron.architecture for the published models handlers/families.py knows
(so the shipped configs validate without downloading weights). Layout arithmetic:
`neuron_sizing`.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archive_tools.host_sampling_cost import host_sampling_line
from archive_tools.load_checks import check_load, read_model_config
from archive_tools.neuron_sizing import (
    COMPILER_GIB_PER_GRAPH,
    HOST_RESERVED_GIB,
    INF2_TP_DEGREES,
    INF2_TP_DEGREES_LLM_GUIDE,
    INSTANCES,
    WORKER_PROCESS_GIB,
    Arch,
    HeadLayout,
    arch_from_config_json,
    device_bytes_per_core,
    head_layout,
    host_memory,
    token_buckets,
    tp_degrees_for,
)
from handlers.backends import capabilities_for, family_problems
from handlers.backends.capabilities import check_defaults
from handlers.checkpoint_checks import read_json
from handlers.config import ModelConfig
from handlers.errors import ConfigError
from handlers.families import ARCHITECTURES as KNOWN_CONFIGS
from handlers.families import family_for, known_architecture, model_class_for
from neuron_cache.key import context_buckets

__all__ = ["ARCHITECTURES", "INSTANCES", "Arch", "Report", "arch_from_config_json",
           "validate"]

CORE_MEMORY = 16 * 2**30  # bytes of device memory per NeuronCore (32 GiB per chip)
HEADROOM = 0.15  # runtime, scratchpad, collectives and I/O buffers
GB = 1e9
# weight formats in the order the real loader tries them
# (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/module.py:L434-466)
CHECKPOINT_FORMATS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin/",
                      "pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)  # will not work: exit 1
    warnings: list[str] = field(default_factory=list)  # works, at a cost worth knowing
    notes: list[str] = field(default_factory=list)  # what was and was not checked


@dataclass(frozen=True)
class Weights:
    """How the checkpoint's weights are stored, which decides host memory while loading."""

    fmt: str = "safetensors"
    largest_file: int = 0  # bytes


#: the architectures `validate` knows by name (handlers/families.py holds their config.json
#: fields, which the backends' family rules read as they read a checkpoint's)
ARCHITECTURES = {name: arch_from_config_json(c) for name, c in KNOWN_CONFIGS.items()}


def resolve_model_config(cfg: ModelConfig, checkpoint: Path | None,
                         model_json: Path | None) -> dict[str, Any] | None:
    """The model's config.json fields: the checkpoint's, a --model-json, or those of the
    architecture handler.neuron.architecture names (handlers/families.py)."""
    path = model_json or (checkpoint / "config.json" if checkpoint else None)
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"{path}: no such file; pass a checkpoint directory or config.json")
        return read_json(path)  # a damaged file is named
    name = cfg.handler.neuron.architecture
    if not name:
        return None
    if name not in ARCHITECTURES:
        close = difflib.get_close_matches(name, list(ARCHITECTURES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"handler.neuron.architecture: {name!r} is unknown{hint} (known: "
                          f"{', '.join(ARCHITECTURES)}); or pass --checkpoint")
    return known_architecture(name)


def resolve_arch(cfg: ModelConfig, checkpoint: Path | None, model_json: Path | None) -> Arch | None:
    model_config = resolve_model_config(cfg, checkpoint, model_json)
    return arch_from_config_json(model_config) if model_config is not None else None


def check_family(cfg: ModelConfig, model_config: dict[str, Any] | None) -> Report:
    """The family's class on this backend and what its SDK refuses of it (the backends'
    *_families.py), with the speculation draft's family where validate knows it."""
    out, h = Report(), cfg.handler
    if model_config is None:
        out.notes.append("no config.json: the family's rules are not checked (pass "
                         "--checkpoint/--model-json or set handler.neuron.architecture)")
        return out
    sp = h.neuron.speculation
    draft = known_architecture(sp.draft_architecture) if sp.enabled else None
    out.problems += family_problems(h, model_config, draft)
    family = family_for(model_config.get("model_type"))
    if family is not None and not out.problems:
        setting = h.nxdi.model_class if h.backend == "nxdi" else h.neuron.model_class_name
        sdk = ("NxD Inference 0.8 (Neuron SDK 2.28)" if h.backend == "nxdi"
               else "transformers-neuronx 0.13")
        out.notes.append(f"family {family.name}: {family.summary}; built as "
                         f"{model_class_for(h.backend, model_config, setting)} by {sdk}")
    return out


def checkpoint_weights(checkpoint: Path) -> Weights:
    """The first format the real loader would pick, and its largest weight file."""
    for name in CHECKPOINT_FORMATS:
        path = checkpoint / name.rstrip("/")
        if path.is_dir() if name.endswith("/") else path.is_file():
            files = [p for p in checkpoint.iterdir() if p.suffix in (".bin", ".safetensors")
                     and p.is_file()]
            return Weights(name.rstrip("/"), max((p.stat().st_size for p in files), default=0))
    return Weights()


def _join(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def check_tp(tp: int, instance: str | None) -> Report:
    """tp_degree against the runtime's supported degrees and the instance's cores."""
    out = Report()
    supported = INF2_TP_DEGREES + INF2_TP_DEGREES_LLM_GUIDE
    where = INSTANCES[instance] if instance else None
    fits = tp_degrees_for(where) if where else sorted(supported)
    if tp not in supported:
        out.problems.append(
            f"tp_degree {tp}: the Neuron runtime on Inf2 supports tensor-parallel degrees "
            f"{_join(list(INF2_TP_DEGREES))} (12 per AWS's LLM inference guide); use one of "
            f"{_join(fits)}{f' on {instance}' if instance else ''}")
    elif where and tp > where.cores:
        bigger = [n for n, i in INSTANCES.items() if i.cores >= tp]
        out.problems.append(f"tp_degree {tp} needs {tp} NeuronCores, but {instance} has "
                            f"{where.cores}; use one of {_join(fits)}, or {bigger[0]}")
    elif tp in INF2_TP_DEGREES_LLM_GUIDE:
        listed = _join(list(INF2_TP_DEGREES))
        out.warnings.append(f"tp_degree {tp}: listed by AWS's LLM inference guide but not by the "
                            f"transformers-neuronx developer guide ({listed}); if the runtime "
                            "rejects it, use 8 or 24")
    if where:
        out.notes.append(f"{instance}: {where.cores} NeuronCores, {where.host_gib} GiB host "
                         f"memory; tp_degree {_join(fits[:-1])} or {fits[-1]} fit")
    return out


def layout_warnings(layout: HeadLayout, unpadded: list[int]) -> list[str]:
    """Padding and replication the real library applies silently or with a terse warning.

    `unpadded`: tp degrees that divide the heads and fit, the way to avoid padding.
    """
    out = [f"gqa: {reason}" for reason in layout.fallbacks]
    tp, per_core = layout.tp, layout.heads_padded // layout.tp
    if layout.heads_padded != layout.heads:
        kv = (f"; K/V weights and cache are padded alike ({layout.kv_cache_heads} heads)"
              if layout.kv_weight_heads == layout.heads_padded else "")
        avoid = (f"tp_degree {_join(unpadded)} would avoid it" if unpadded else
                 f"no tp_degree that divides {layout.heads} fits in device memory here, so "
                 "this is the price of this tp_degree")
        out.append(f"tp_degree {tp}: {layout.heads} attention heads are padded to "
                   f"{layout.heads_padded} ({per_core} per NeuronCore, "
                   f"{layout.heads_padded - layout.heads} zero heads: "
                   f"+{layout.padding:.1%} attention compute and weights){kv}; {avoid}")
    if layout.kv_heads != layout.heads and layout.kv_heads_used != layout.kv_heads:
        # copies of each head first (none where the library only pads: used is then no
        # multiple of kv), then zero heads up to the cache's size (neuron_sizing.head_layout);
        # per core and the size factor count both
        kv, used, cache = layout.kv_heads, layout.kv_heads_used, layout.kv_cache_heads
        copies = used // kv if used % kv == 0 else 1
        zero = cache - kv * copies
        steps = [f"replicates them {copies}x to {kv * copies}"] if copies > 1 else []
        if zero:
            steps.append(f"pads them with {zero} zero head{'s' if zero > 1 else ''} to {cache}")
        out.append(f"tp_degree {tp}: {kv} K/V heads do not divide over {tp} cores; "
                   f"transformers-neuronx {' and '.join(steps)} ({cache // tp} per NeuronCore "
                   f"in the KV cache, which is {cache / kv:.3g}x the unreplicated size)")
    return out


#: bytes per element of a quantized weight or KV cache (handler.neuron.quantization)
QUANT_BYTES = {"int8": 1, "fp8": 1}


def quantized_bytes(cfg: ModelConfig) -> tuple[float | None, float | None]:
    """(weight, KV cache) bytes per element where quantized, else None (= handler.dtype)."""
    q = cfg.handler.neuron.quantization
    return QUANT_BYTES.get(q.weights), QUANT_BYTES.get(q.kv_cache)


def precision_label(cfg: ModelConfig) -> tuple[str, str]:
    """How weights and KV cache are stored, for messages: ("int8", "bf16")."""
    q, amp = cfg.handler.neuron.quantization, cfg.handler.amp
    return q.weights or amp, q.kv_cache or amp


def memory_note(label: str, cfg: ModelConfig, weights: float, kv: float, usable: float) -> str:
    w, k = precision_label(cfg)
    h = cfg.handler
    return (f"device memory (estimate): {label} takes {(weights + kv) / GB:.1f} GB per NeuronCore "
            f"at tp_degree {h.neuron.tp_degree}: weights {weights / GB:.2f} GB at {w} + KV cache "
            f"{kv / GB:.2f} GB at {k} (batch {h.batch_size} x {h.max_length} positions), of "
            f"{usable / GB:.1f} GB available")


def add_host_sampling(report: Report, cfg: ModelConfig, arch: Arch) -> None:
    """With sampling on the host, what reading the logits costs a step (a warning past a 100k
    vocabulary, archive_tools.host_sampling_cost)."""
    if cfg.handler.neuron.on_device_sampling:
        return
    line, warn = host_sampling_line(cfg.handler.batch_size, arch.vocab, cfg.handler.backend)
    (report.warnings if warn else report.notes).append(line)


def draft_arch(cfg: ModelConfig) -> Arch | None:
    """The speculation draft's architecture where `validate` knows it (None: not counted)."""
    sp = cfg.handler.neuron.speculation
    return ARCHITECTURES.get(sp.draft_architecture) if sp.enabled else None


def _core_bytes(cfg: ModelConfig, arch: Arch, tp: int) -> tuple[float, float]:
    """(weights, KV cache) per NeuronCore: the model's, plus a speculation draft's, which is
    compiled beside it at the same tp_degree, batch and positions (in handler.dtype)."""
    h = cfg.handler
    layout = head_layout(arch, tp, h.neuron.gqa, h.batch_size)
    weights, kv = device_bytes_per_core(arch, layout, h.amp, h.batch_size, h.max_length,
                                        *quantized_bytes(cfg))
    draft = draft_arch(cfg)
    if draft is not None:
        d = device_bytes_per_core(draft, head_layout(draft, tp, h.neuron.gqa, h.batch_size),
                                  h.amp, h.batch_size, h.max_length)
        weights, kv = weights + d[0], kv + d[1]
    return weights, kv


def speculation_note(cfg: ModelConfig) -> str | None:
    sp = cfg.handler.neuron.speculation
    if not sp.enabled:
        return None
    if draft_arch(cfg) is None:
        return ("speculation: the draft model's memory is not counted; set handler.neuron."
                "speculation.draft_architecture (one of " + ", ".join(ARCHITECTURES) + ")")
    return (f"speculation: the figures include the draft {sp.draft_architecture} and its KV "
            f"cache, {sp.length} draft tokens a step")


def check_device_memory(cfg: ModelConfig, arch: Arch, label: str,
                        instance: str | None) -> list[str]:
    h, n = cfg.handler, cfg.handler.neuron
    weights, kv = _core_bytes(cfg, arch, n.tp_degree)
    usable = CORE_MEMORY * (1 - HEADROOM)
    out = []
    if weights + kv > usable:
        cores = INSTANCES[instance].cores if instance else max(INSTANCES.values(),
                                                               key=lambda i: i.cores).cores
        fits = [t for t in sorted(INF2_TP_DEGREES + INF2_TP_DEGREES_LLM_GUIDE)
                if n.tp_degree < t <= cores and sum(_core_bytes(cfg, arch, t)) <= usable]
        hint = (f"use tp_degree {fits[0]}" if fits else
                f"no tp_degree up to {cores} fits; use a larger instance")
        w, k = precision_label(cfg)
        out.append(f"device memory: {label} needs {(weights + kv) / GB:.1f} GB per NeuronCore at "
                   f"tp_degree {n.tp_degree} (weights {weights / GB:.1f} GB at {w} + KV cache "
                   f"{kv / GB:.1f} GB at {k} for batch {h.batch_size} x {h.max_length} "
                   f"positions, padding included), but a core has {usable / GB:.1f} GB available "
                   f"({CORE_MEMORY / 2**30:.0f} GiB less {HEADROOM:.0%} headroom); {hint}, or "
                   "lower batch_size / max_length")
    if instance:
        cores = INSTANCES[instance].cores
        total, have = (weights + kv) * n.tp_degree, cores * usable
        if total > have:
            out.append(f"device memory: {label} needs {total / GB:.1f} GB in all, but {instance} "
                       f"has {have / GB:.1f} GB available ({cores} cores x {usable / GB:.1f} GB); "
                       "use a larger instance")
    return out


def check_host_memory(cfg: ModelConfig, arch: Arch, instance: str, weights: Weights) -> Report:
    """Estimated host memory for loading and compiling against the instance's."""
    h, n, out = cfg.handler, cfg.handler.neuron, Report()
    tokens, contexts = len(token_buckets(h.max_length)), len(context_buckets(h))
    workers, have = cfg.frontend.max_workers, INSTANCES[instance].host_gib
    mem = host_memory(arch, h.amp, workers, tokens + contexts, n.compilation_worker_count,
                      weights.fmt, weights.largest_file)
    setting = (f"handler.neuron.compilation_worker_count {n.compilation_worker_count}"
               + (" = all at once" if n.compilation_worker_count == 0 else ""))
    out.notes.append(f"host memory (estimate): loading {mem.load_gib:.1f} GiB, compiling "
                     f"{mem.compile_gib:.1f} GiB of {have} GiB ({mem.graphs} graphs: {tokens} "
                     f"token + {contexts} context buckets, {mem.concurrent} at a time)")
    if mem.compile_gib > have:
        base = mem.compile_gib - mem.concurrent * COMPILER_GIB_PER_GRAPH
        room = int((have - base) // COMPILER_GIB_PER_GRAPH)
        fix = (f"set compilation_worker_count to {room} or lower, or " if 0 < room < mem.concurrent
               else "")
        out.warnings.append(
            f"host memory: compiling needs about {mem.compile_gib:.1f} GiB but {instance} has "
            f"{have} GiB: {mem.concurrent} of {mem.graphs} graphs compile at once ({setting}) at "
            f"an assumed {COMPILER_GIB_PER_GRAPH:g} GiB per neuronx-cc process, plus "
            f"{base:.1f} GiB for the OS, TorchServe and {workers} worker(s) (an estimate: "
            f"neuronx-cc's footprint is not documented); {fix}compile on a larger host with "
            "`inf2serve compile` and ship the cache")
    if mem.load_gib > have:
        out.warnings.append(
            f"host memory: loading weights needs about {mem.load_gib:.1f} GiB but {instance} has "
            f"{have} GiB ({workers} worker(s) x {WORKER_PROCESS_GIB:g} GiB process + the "
            f"{weights.fmt} weights in CPU memory, {HOST_RESERVED_GIB:g} GiB for the OS and "
            "TorchServe; an estimate); use safetensors (`inf2serve prepare` writes them, loaded "
            "layer by layer), fewer workers, or a larger instance")
    return out


def _merge(report: Report, part: Report) -> None:
    report.problems += part.problems
    report.warnings += part.warnings
    report.notes += part.notes


def validate(cfg: ModelConfig, arch: Arch | None, instance: str | None,
             label: str = "the model", weights: Weights | None = None,
             model_config: dict[str, Any] | None = None) -> Report:
    """Every problem found (empty = fits), warnings with numbers, and what was not checked.
    `model_config`: config.json's fields, for the family's rules (none checked without)."""
    h, report = cfg.handler, Report()
    if instance and instance not in INSTANCES:  # whatever the backend: a typo is a typo
        close = difflib.get_close_matches(instance, list(INSTANCES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"--instance {instance!r}: unknown{hint} (known: "
                          f"{', '.join(INSTANCES)})")
    if h.backend not in ("neuron", "nxdi"):
        report.notes.append(f"backend {h.backend}: no Neuron checks")
        return report
    if model_config is not None:
        _merge(report, check_family(cfg, model_config))
    n = h.neuron
    if h.backend == "nxdi":
        _merge(report, validate_nxdi(cfg, arch, instance, label))
        return report
    if cfg.frontend.device_type != "neuron":
        report.notes.append(f"deviceType is {cfg.frontend.device_type!r}; 'neuron' is usual for "
                            "the neuron backend")
    _merge(report, check_tp(n.tp_degree, instance))
    if arch is None:
        report.notes.append("no architecture: pass --checkpoint/--model-json or set "
                            "handler.neuron.architecture to check heads and memory")
    elif arch.heads % arch.kv_heads:
        report.problems.append(f"config.json: num_attention_heads {arch.heads} is not a multiple "
                               f"of num_key_value_heads {arch.kv_heads}; not a Llama model")
    else:
        usable = CORE_MEMORY * (1 - HEADROOM)
        unpadded = [t for t in (tp_degrees_for(INSTANCES[instance]) if instance else
                                sorted(INF2_TP_DEGREES + INF2_TP_DEGREES_LLM_GUIDE))
                    if arch.heads % t == 0 and sum(_core_bytes(cfg, arch, t)) <= usable]
        report.warnings += layout_warnings(head_layout(arch, n.tp_degree, n.gqa, h.batch_size),
                                           unpadded)
        if arch.max_positions and h.max_length > arch.max_positions:
            report.problems.append(f"max_length {h.max_length} exceeds the model's "
                                   f"max_position_embeddings {arch.max_positions}")
        report.problems += check_device_memory(cfg, arch, label, instance)
        report.notes.append(memory_note(label, cfg, *_core_bytes(cfg, arch, n.tp_degree), usable))
        if (note := speculation_note(cfg)) is not None:
            report.notes.append(note)
        add_host_sampling(report, cfg, arch)
    if not instance:
        report.notes.append("no --instance: cores and host memory not checked")
        return report
    report.problems += check_cores(cfg, instance)
    if arch is not None and not arch.heads % arch.kv_heads:
        _merge(report, check_host_memory(cfg, arch, instance, weights or Weights()))
    return report


def check_cores(cfg: ModelConfig, instance: str) -> list[str]:
    """NeuronCores on `instance` for every worker (both Neuron backends)."""
    n, where, fe = cfg.handler.neuron, INSTANCES[instance], cfg.frontend
    need, problems = fe.max_workers * n.tp_degree, []
    if n.tp_degree <= where.cores < need:
        problems.append(f"NeuronCores: maxWorkers {fe.max_workers} x tp_degree {n.tp_degree} = "
                        f"{need} cores, but {instance} has {where.cores}; lower maxWorkers or "
                        "tp_degree, or use a larger instance")
    if n.cores_per_instance and n.cores_per_instance != where.cores:
        problems.append(f"handler.neuron.cores_per_instance {n.cores_per_instance} != "
                        f"{where.cores} cores of {instance}; set it to {where.cores} or 0 (detect)")
    return problems


def validate_nxdi(cfg: ModelConfig, arch: Arch | None, instance: str | None,
                  label: str) -> Report:
    """The NxD Inference rules: buckets (checked by load_config), tp, heads, device and host
    memory (archive_tools.nxdi_sizing)."""
    from archive_tools import nxdi_sizing as nx
    from handlers.backends.nxdi_backend import check_speculation
    from neuron_cache.key import nxdi_buckets

    h, n, report = cfg.handler, cfg.handler.neuron, Report()
    try:  # what the backend would refuse of speculation at its start, refused here
        check_speculation(h)
    except ConfigError as exc:
        report.problems.append(str(exc))
    ctx, tkg, top = nxdi_buckets(h)
    report.notes.append(f"nxdi: prefill buckets {_join(ctx)} (max_context_length {top}), decode "
                        f"buckets {_join(tkg)}, batch {h.batch_size} (one context row per call)")
    if cfg.frontend.device_type != "neuron":
        report.notes.append(f"deviceType is {cfg.frontend.device_type!r}; 'neuron' is usual")
    _merge(report, check_tp(n.tp_degree, instance))
    if arch is None:
        report.notes.append("no architecture: pass --checkpoint/--model-json or set "
                            "handler.neuron.architecture to check heads and memory")
        return report
    if arch.heads % arch.kv_heads:
        report.problems.append(f"config.json: num_attention_heads {arch.heads} is not a multiple "
                               f"of num_key_value_heads {arch.kv_heads}; not a Llama model")
        return report
    if arch.max_positions and h.max_length > arch.max_positions:
        report.problems.append(f"max_length {h.max_length} exceeds the model's "
                               f"max_position_embeddings {arch.max_positions}")
    heads = nx.nxdi_heads(arch, n.tp_degree)
    report.warnings += nx.head_warnings(heads)
    weights, kv = nx.device_bytes_per_core(arch, heads, h.amp, h.batch_size, h.max_length,
                                           *quantized_bytes(cfg))
    if (draft := draft_arch(cfg)) is not None:  # compiled into the same model (fused)
        d = nx.device_bytes_per_core(draft, nx.nxdi_heads(draft, n.tp_degree), h.amp,
                                     h.batch_size, h.max_length)
        weights, kv = weights + d[0], kv + d[1]
    if (note := speculation_note(cfg)) is not None:
        report.notes.append(note)
    usable = nx.CORE_MEMORY * (1 - nx.HEADROOM)
    w, k = precision_label(cfg)
    report.notes.append(memory_note(label, cfg, weights, kv, usable))
    add_host_sampling(report, cfg, arch)
    if weights + kv > usable:
        report.problems.append(
            f"device memory (estimate): {label} needs {(weights + kv) / GB:.1f} GB per NeuronCore "
            f"at tp_degree {n.tp_degree} (weights {weights / GB:.1f} GB at {w} + KV cache "
            f"{kv / GB:.1f} GB at {k} for batch {h.batch_size} x {h.max_length} positions), but "
            f"a core has {usable / GB:.1f} GB available; raise tp_degree or lower batch_size / "
            "max_length")
    if not instance:
        report.notes.append("no --instance: cores and host memory not checked")
        return report
    report.problems += check_cores(cfg, instance)
    where, fe = INSTANCES[instance], cfg.frontend
    load = nx.host_load_gib(arch, h.amp, fe.max_workers)
    report.notes.append(f"host memory (estimate): loading {load:.1f} GiB of {where.host_gib} GiB "
                        "(weights sharded on the host at every start); compile memory of NxD's "
                        "ModelBuilder is not estimated")
    if load > where.host_gib:
        report.warnings.append(f"host memory (estimate): {fe.max_workers} worker(s) loading "
                               f"{label} need about {load:.1f} GiB but {instance} has "
                               f"{where.host_gib} GiB; use a larger instance or fewer workers")
    if h.neuron.quantization.weights:
        # save_quantized_state_dict loads the whole HF model (no torch_dtype: float32) to
        # quantize it, once, before the compile (models/application_base.py:L770-L790)
        quantize = arch.params * 4 / 2**30 + nx.WORKER_PROCESS_GIB
        report.notes.append(f"host memory (estimate): writing the {h.neuron.quantization.weights}"
                            f" checkpoint loads the model in float32 once: {quantize:.1f} GiB")
        if quantize > where.host_gib:
            report.warnings.append(
                f"host memory (estimate): quantizing {label} for NxD Inference loads it in "
                f"float32 ({quantize:.1f} GiB) but {instance} has {where.host_gib} GiB; run "
                "`inf2serve compile` on a larger host and ship the cache "
                "(`inf2serve cache pack`)")
    return report


def _run(args: argparse.Namespace) -> int:
    _, cfg, _ = read_model_config(Path(args.config))  # an empty file is refused, as by package
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    # with a checkpoint: everything `package` and the worker's start refuse, refused here
    loaded = check_load(Path(args.config), checkpoint, load_under_4x=True) if checkpoint else None
    if loaded is not None:
        cfg = loaded.config  # with the checkpoint's generation defaults
    check_defaults(cfg.handler, capabilities_for(cfg.handler))
    model_config = resolve_model_config(cfg, checkpoint,
                                        Path(args.model_json) if args.model_json else None)
    arch = arch_from_config_json(model_config) if model_config is not None else None
    label = cfg.handler.neuron.architecture or "the model"
    weights = checkpoint_weights(checkpoint) if checkpoint else None
    report = validate(cfg, arch, args.instance, label, weights, model_config)
    if loaded is not None:
        report.notes[:0], report.warnings[:0] = loaded.notes, loaded.warnings
    for kind, lines in (("note", report.notes), ("warning", report.warnings),
                        ("error", report.problems)):
        for line in lines:
            print(f"{kind}: {line}")
    if report.problems:
        print(f"{args.config}: {len(report.problems)} problem(s)")
        return 1
    where = f" on {args.instance}" if args.instance else ""
    warned = f" ({len(report.warnings)} warning(s))" if report.warnings else ""
    print(f"{args.config}: ok{where}{warned}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate", help="check a model-config.yaml: keys, tp_degree, heads, cores, device and "
        "host memory",
        description="Check a model-config.yaml: keys and types, tp_degree against the Neuron "
        "runtime and the instance, head padding and K/V replication (warnings with the numbers), "
        "NeuronCores, device memory per core, and an estimate of host memory for loading and "
        "compiling.\n\nexamples:\n"
        "  inf2serve validate model_configs/llama-2-7b/inf2.xlarge-latency.yaml "
        "--instance inf2.xlarge\n"
        "  inf2serve validate my-config.yaml --instance inf2.48xlarge --checkpoint ckpt/llama",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="model-config.yaml")
    p.add_argument("--instance", help=f"one of {', '.join(INSTANCES)}")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="serving checkpoint directory: runs the load checks "
                     "of `package` and the worker (weights headers and shapes against "
                     "config.json, positions, tokenizer, the chat template compiled and "
                     "rendered, generation defaults; for neuron and nxdi, a load under each "
                     "transformers 4.x found) and reads its config.json")
    src.add_argument("--model-json", help="a config.json of the model")
    p.set_defaults(func=_run)
