"""`inf2serve validate CONFIG`: will this model-config.yaml fit and shard on an Inf2 instance?

Checks, beyond load_config's keys and types: heads (and K/V heads) shard over
tp_degree, workers x tp_degree cores exist on the instance, and an estimate of
device memory per NeuronCore (weights at amp + KV cache for batch x positions)
fits 16 GiB with headroom. The architecture comes from a checkpoint's config.json,
or from handler.neuron.architecture for the known ones below (so the shipped
configs validate without downloading weights).
"""

from __future__ import annotations

import argparse
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

from handlers.config import ModelConfig, load_config
from handlers.errors import ConfigError


@dataclass(frozen=True)
class Arch:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    intermediate: int
    max_positions: int

    @property
    def params(self) -> int:
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp + 2 * self.hidden) + 2 * self.vocab * self.hidden


ARCHITECTURES = {  # published Llama-2 configs (config.json of the meta-llama checkpoints)
    "llama-2-7b": Arch(32, 4096, 32, 32, 32000, 11008, 4096),
    "llama-2-13b": Arch(40, 5120, 40, 40, 32000, 13824, 4096),
    "llama-2-70b": Arch(80, 8192, 64, 8, 32000, 28672, 4096),
}
INSTANCES = {  # NeuronCores (2 per Inferentia2 chip), host memory GiB
    "inf2.xlarge": (2, 16), "inf2.8xlarge": (2, 128), "inf2.24xlarge": (12, 384),
    "inf2.48xlarge": (24, 768),
}
CORE_MEMORY = 16 * 2**30  # bytes of device memory per NeuronCore (32 GiB per chip)
HEADROOM = 0.15  # runtime, scratchpad, collectives and I/O buffers
AMP_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
GB = 1e9


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def arch_from_config_json(data: dict) -> Arch:
    try:
        heads = int(data["num_attention_heads"])
        return Arch(int(data["num_hidden_layers"]), int(data["hidden_size"]), heads,
                    int(data.get("num_key_value_heads") or heads), int(data["vocab_size"]),
                    int(data["intermediate_size"]),
                    int(data.get("max_position_embeddings") or 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"config.json: missing or invalid {exc}; expected a Llama-style config "
                          "(num_hidden_layers, hidden_size, num_attention_heads, ...)") from exc


def resolve_arch(cfg: ModelConfig, checkpoint: Path | None, model_json: Path | None) -> Arch | None:
    path = model_json or (checkpoint / "config.json" if checkpoint else None)
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"{path}: no such file; pass a checkpoint directory or config.json")
        return arch_from_config_json(json.loads(path.read_text(encoding="utf-8")))
    name = cfg.handler.neuron.architecture
    if not name:
        return None
    if name not in ARCHITECTURES:
        close = difflib.get_close_matches(name, list(ARCHITECTURES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"handler.neuron.architecture: {name!r} is unknown{hint} (known: "
                          f"{', '.join(ARCHITECTURES)}); or pass --checkpoint")
    return ARCHITECTURES[name]


def kv_heads_per_core(arch: Arch, tp: int, gqa: str) -> float:
    if gqa == "replicated-heads":
        return arch.heads / tp
    return max(arch.kv_heads / tp, 1.0)  # fewer K/V heads than cores: each core holds a copy


def memory_per_core(cfg: ModelConfig, arch: Arch, tp: int) -> tuple[float, float]:
    """(weights, KV cache) bytes on each NeuronCore."""
    h, n = cfg.handler, cfg.handler.neuron
    amp = AMP_BYTES[n.amp]
    head_dim = arch.hidden // arch.heads
    kv = (2 * arch.layers * h.batch_size * h.max_length * head_dim
          * kv_heads_per_core(arch, tp, n.gqa) * amp)
    return arch.params * amp / tp, kv


def check_sharding(cfg: ModelConfig, arch: Arch, tp: int) -> list[str]:
    n, out = cfg.handler.neuron, []
    valid = [d for d in range(1, arch.heads + 1) if arch.heads % d == 0]
    if arch.heads % tp:
        out.append(f"tp_degree {tp}: {arch.heads} attention heads are not divisible by it; "
                   f"use one of {valid}")
    if arch.kv_heads != arch.heads and n.gqa in ("", "shard-over-heads") \
            and arch.kv_heads % tp and tp % arch.kv_heads:
        out.append(f"tp_degree {tp}: {arch.kv_heads} K/V heads can neither be split over nor "
                   f"replicated onto {tp} cores (shard-over-heads); use a tp_degree that divides "
                   f"or is a multiple of {arch.kv_heads}, or gqa: replicated-heads")
    if n.gqa == "shard-over-batch" and cfg.handler.batch_size % tp:
        out.append(f"gqa shard-over-batch: batch_size {cfg.handler.batch_size} is not divisible "
                   f"by tp_degree {tp}")
    return out


def check_memory(cfg: ModelConfig, arch: Arch, label: str) -> list[str]:
    h, n = cfg.handler, cfg.handler.neuron
    weights, kv = memory_per_core(cfg, arch, n.tp_degree)
    usable = CORE_MEMORY * (1 - HEADROOM)
    if weights + kv <= usable:
        return []
    fits = [t for t in range(n.tp_degree + 1, 129) if arch.heads % t == 0
            and sum(memory_per_core(cfg, arch, t)) <= usable]
    hint = (f"use tp_degree {fits[0]} or more (on an instance with that many cores)" if fits
            else "no tp_degree fits")
    return [f"device memory: {label} needs {(weights + kv) / GB:.1f} GB per NeuronCore at "
            f"tp_degree {n.tp_degree} (weights {weights / GB:.1f} GB at {n.amp} + KV cache "
            f"{kv / GB:.1f} GB for batch {h.batch_size} x {h.max_length} positions), but a core "
            f"has {usable / GB:.1f} GB available ({CORE_MEMORY / 2**30:.0f} GiB less "
            f"{HEADROOM:.0%} headroom); {hint}, or lower batch_size / max_length"]


def check_instance(cfg: ModelConfig, arch: Arch | None, instance: str, label: str) -> list[str]:
    if instance not in INSTANCES:
        close = difflib.get_close_matches(instance, list(INSTANCES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"--instance {instance!r}: unknown{hint} (known: "
                          f"{', '.join(INSTANCES)})")
    cores, host_gib = INSTANCES[instance]
    n, fe, out = cfg.handler.neuron, cfg.frontend, []
    need = fe.max_workers * n.tp_degree
    if need > cores:
        out.append(f"NeuronCores: maxWorkers {fe.max_workers} x tp_degree {n.tp_degree} = {need} "
                   f"cores, but {instance} has {cores}; lower maxWorkers or tp_degree, or use a "
                   "larger instance")
    if n.cores_per_instance and n.cores_per_instance != cores:
        out.append(f"handler.neuron.cores_per_instance {n.cores_per_instance} != {cores} cores of "
                   f"{instance}; set it to {cores} or 0 (detect)")
    if arch is not None:
        weights, kv = memory_per_core(cfg, arch, n.tp_degree)
        total, have = (weights + kv) * n.tp_degree, cores * CORE_MEMORY * (1 - HEADROOM)
        if total > have:
            out.append(f"device memory: {label} needs {total / GB:.1f} GB in all, but {instance} "
                       f"has {have / GB:.1f} GB available ({cores} cores x "
                       f"{CORE_MEMORY * (1 - HEADROOM) / GB:.1f} GB); use a larger instance")
    return out


def validate(cfg: ModelConfig, arch: Arch | None, instance: str | None,
             label: str = "the model") -> Report:
    """Every problem found (empty = fits); notes say what was not checked."""
    h, report = cfg.handler, Report()
    if h.backend != "neuron":
        report.notes.append(f"backend {h.backend}: no Neuron checks")
        return report
    n = h.neuron
    if cfg.frontend.device_type != "neuron":
        report.notes.append(f"deviceType is {cfg.frontend.device_type!r}; 'neuron' is usual for "
                            "the neuron backend")
    too_long = [c for c in n.context_length_estimate if c > h.max_length]
    if too_long:
        report.problems.append(f"context_length_estimate {too_long} exceed max_length "
                               f"{h.max_length}; buckets must fit the sequence")
    if arch is None:
        report.notes.append("no architecture: pass --checkpoint/--model-json or set "
                            "handler.neuron.architecture to check heads and memory")
    else:
        report.problems += check_sharding(cfg, arch, n.tp_degree)
        if arch.max_positions and h.max_length > arch.max_positions:
            report.problems.append(f"max_length {h.max_length} exceeds the model's "
                                   f"max_position_embeddings {arch.max_positions}")
        report.problems += check_memory(cfg, arch, label)
    if instance:
        report.problems += check_instance(cfg, arch, instance, label)
    else:
        report.notes.append("no --instance: cores per instance not checked")
    return report


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    arch = resolve_arch(cfg, Path(args.checkpoint) if args.checkpoint else None,
                        Path(args.model_json) if args.model_json else None)
    label = cfg.handler.neuron.architecture or "the model"
    report = validate(cfg, arch, args.instance, label)
    for note in report.notes:
        print(f"note: {note}")
    for problem in report.problems:
        print(f"error: {problem}")
    if report.problems:
        print(f"{args.config}: {len(report.problems)} problem(s)")
        return 1
    where = f" on {args.instance}" if args.instance else ""
    print(f"{args.config}: ok{where}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate", help="check a model-config.yaml: keys, sharding, cores and device memory",
        description="Check a model-config.yaml: keys and types, heads vs tp_degree, NeuronCores "
        "on the instance and device memory per core.\n\nexamples:\n"
        "  inf2serve validate model_configs/llama-2-7b/inf2.xlarge-latency.yaml "
        "--instance inf2.xlarge\n"
        "  inf2serve validate my-config.yaml --instance inf2.48xlarge --checkpoint ckpt/llama",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="model-config.yaml")
    p.add_argument("--instance", help=f"one of {', '.join(INSTANCES)}")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="checkpoint directory (reads its config.json)")
    src.add_argument("--model-json", help="a config.json of the model")
    p.set_defaults(func=_run)
