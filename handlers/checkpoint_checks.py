"""What a worker refuses of its archive before it loads anything, in milliseconds.

On Inf2 a worker's first start compiles for up to an hour, so a checkpoint the worker
cannot load must be refused before that: by `inf2serve validate --checkpoint`, `package`
and `compile` (archive_tools/load_checks.py) and by the worker's own start
(GenerationHandler.initialize). Both run the functions here, so packaging and the worker
cannot disagree about what loads. They live in the runtime every archive carries, which
may not import archive_tools, and read only small JSON files and safetensors headers (an
8-byte little-endian length, then JSON): no tensor data, no torch. What they check: the
frontend keys, the weights (headers, index, dtypes, and each tensor's shape against
config.json: handlers/checkpoint_shapes.py), positions, that every chat template compiles,
for a Neuron backend what transformers 4.x reads (handlers/transformers4_rules.py), and
generation_config.json's sampling values.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from handlers.api.chat_template import resolve_template
from handlers.backends import capabilities_for
from handlers.checkpoint_shapes import check_shapes
from handlers.config import HandlerConfig, ModelConfig, parse_config
from handlers.config_yaml import check_duplicates
from handlers.errors import ConfigError
from handlers.generation_defaults import (
    apply_generation_defaults,
    configured_defaults,
    sampling_left_out,
)
from handlers.presets.chat_templates import NO_TEMPLATE_FIX
from handlers.transformers4_rules import NEURON_BACKENDS
from handlers.transformers4_rules import check_files as check_transformers4

logger = logging.getLogger(__name__)

#: the safetensors library refuses a larger header (safetensors/src/tensor.rs MAX_HEADER_SIZE)
MAX_HEADER = 100_000_000
#: bytes per element of each safetensors dtype with a whole byte count
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
#: what an unquantized checkpoint's weights may be: the backends cast from these
FLOAT_DTYPES = ("F32", "F16", "BF16")
#: the weight files the loaders read (transformers' SAFE_WEIGHTS_NAME / _INDEX_NAME)
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
#: frontend keys whose absence TorchServe fills with a default the handler cannot run under
REQUIRED_FRONTEND = {"asyncCommunication": True}
#: the archive's config file (MANIFEST.json configFile, as `inf2serve package` writes it)
ARCHIVE_YAML = "model-config.yaml"


@dataclass(frozen=True)
class Checked:
    """A config that passed: with the checkpoint's generation defaults merged in."""

    config: ModelConfig
    warnings: tuple[str, ...] = ()
    taken: dict[str, Any] = field(default_factory=dict)  # from generation_config.json


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or ConfigError naming the file and what is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); restore the file from the "
                          "checkpoint's source") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def check_frontend(raw: Mapping[str, Any] | None) -> None:
    """The archive's own YAML must set what TorchServe would otherwise default wrongly:
    without `asyncCommunication` it runs the handler synchronously (its default is false)
    and every request fails with "Invalid model predict output"."""
    for key, value in REQUIRED_FRONTEND.items():
        if not isinstance(raw, Mapping) or key not in raw:
            raise ConfigError(f"{key}: absent from the archive's model-config.yaml and "
                              f"TorchServe's default differs, so every request would fail; "
                              f"add `{key}: {json.dumps(value)}` (`inf2serve package` writes it)")


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, bytes of tensor data after it) of a safetensors file, reading the header only."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{path}: {size} bytes, too short for a safetensors header; the "
                              "file is damaged or cut short: copy it again")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER or 8 + length > size:
            raise ConfigError(f"{path}: damaged safetensors header (length prefix {length} for "
                              f"a {size}-byte file); copy or download the file again")
        text = f.read(length)
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: damaged safetensors header (not JSON: {exc}); copy or "
                          "download the file again") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: damaged safetensors header (not a JSON object)")
    return header, size - 8 - length


def check_tensors(path: Path, header: dict[str, Any], data_bytes: int, quantized: bool) -> None:
    """Each tensor's dtype, shape and byte range as the safetensors loader checks them
    (ranges back to back from 0 to the end of the file), and float dtypes unless the
    checkpoint says it is quantized."""
    spans = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = t["dtype"], list(t["shape"]), t["data_offsets"]
            ok = all(isinstance(x, int) and x >= 0 for x in (*shape, begin, end)) and begin <= end
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ConfigError(f"{path}: damaged safetensors header (tensor {name!r}: {t!r}); "
                              "copy or download the file again")
        if not quantized and dtype not in FLOAT_DTYPES:
            raise ConfigError(f"{path}: tensor {name!r} is {dtype}, and config.json has no "
                              f"quantization_config; expected {', '.join(FLOAT_DTYPES)} weights: "
                              "convert with `inf2serve prepare SRC OUT --amp bf16`")
        if dtype in DTYPE_BYTES and math.prod(shape) * DTYPE_BYTES[dtype] != end - begin:
            raise ConfigError(f"{path}: damaged safetensors header (tensor {name!r} {dtype} "
                              f"{shape} spans {end - begin} bytes); copy the file again")
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ConfigError(f"{path}: damaged safetensors header (tensor {name!r} starts at "
                              f"byte {begin}, expected {at}); copy the file again")
        at = end
    if at > data_bytes:
        raise ConfigError(f"{path}: file cut short: its header lists {at} bytes of tensors, "
                          f"{data_bytes} are there; copy or download the file again")
    if at < data_bytes:
        raise ConfigError(f"{path}: {data_bytes - at} bytes after the last tensor, which the "
                          "safetensors loader refuses; copy or download the file again")


def weight_files(checkpoint: Path) -> dict[Path, set[str]]:
    """The safetensors files the loaders read, each with the tensors the index maps to it
    (empty for a single model.safetensors): the index's shards, else model.safetensors."""
    index = checkpoint / INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index}: no weight_map; restore the file from the checkpoint's "
                              "source")
        files: dict[Path, set[str]] = {}
        for tensor, name in weight_map.items():
            files.setdefault(checkpoint / str(name), set()).add(tensor)
        for path in files:
            if not path.is_file():
                raise ConfigError(f"{path}: listed in {INDEX} but missing; copy every shard of "
                                  "the checkpoint")
        return files
    if (checkpoint / SINGLE).is_file():
        return {checkpoint / SINGLE: set()}
    shards = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    if shards:
        raise ConfigError(f"{checkpoint}: {', '.join(shards[:3])} but no {SINGLE} or {INDEX}, "
                          "the names the loaders read; copy the index too, or rename a single "
                          f"file to {SINGLE}")
    return {}  # the legacy split folder, or no weights (refused by the packaging checks)


def check_weights(checkpoint: Path, model_config: dict[str, Any]) -> None:
    """Every weight file the worker will read has a sound header that covers the file, the
    tensors the index promises, and the shapes config.json implies (checkpoint_shapes)."""
    quantized = bool(model_config.get("quantization_config"))
    shapes: dict[str, tuple[list[int], Path]] = {}
    files = weight_files(checkpoint)
    for path, promised in files.items():
        header, data_bytes = safetensors_header(path)
        check_tensors(path, header, data_bytes, quantized)
        missing = sorted(promised - set(header))
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ConfigError(f"{path}: lacks {', '.join(missing[:3])}{more}, which {INDEX} maps "
                              "to it; copy the shard again, or the index that belongs with it")
        shapes |= {name: (t["shape"], path) for name, t in header.items()
                   if name != "__metadata__"}
    if files:  # the legacy split folder has no headers to read
        check_shapes(model_config, shapes, checkpoint / "config.json")


def check_positions(h: HandlerConfig, model_config: dict[str, Any], where: Path) -> None:
    """A sequence may not outgrow the model's positions (the synthetic device has none)."""
    limit = model_config.get("max_position_embeddings")
    if h.backend == "synthetic" or not isinstance(limit, int) or isinstance(limit, bool):
        return
    if h.max_length > limit:
        raise ConfigError(f"handler.max_length: {h.max_length} exceeds the checkpoint's "
                          f"max_position_embeddings {limit} ({where}); set max_length to {limit} "
                          "or less")


def checkpoint_templates(checkpoint: Path) -> list[tuple[str, str]]:
    """(where, Jinja source) of every chat template a transformers version may read from the
    checkpoint: chat_template.jinja (4.47+ and 5.x prefer it), tokenizer_config.json's
    (a string, or named templates), chat_template.json's."""
    out = []
    if (checkpoint / "chat_template.jinja").is_file():
        path = checkpoint / "chat_template.jinja"
        out.append((str(path), path.read_text(encoding="utf-8")))
    for name in ("tokenizer_config.json", "chat_template.json"):
        if not (checkpoint / name).is_file():
            continue
        template = read_json(checkpoint / name).get("chat_template")
        where = f"{checkpoint / name} chat_template"
        if isinstance(template, str) and template:
            out.append((where, template))
        elif isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
            out += [(f"{where} {t.get('name')!r}", t["template"]) for t in template
                    if isinstance(t, dict) and isinstance(t.get("template"), str)]
    return out


def chat_template_warning(checkpoint: Path, setting: str) -> str | None:
    """A warning when no chat template exists anywhere the worker looks: the configured
    one, tokenizer_config.json's, chat_template.jinja or chat_template.json."""
    if setting or checkpoint_templates(checkpoint):
        return None
    return f"no chat template: /v1/chat/completions will answer 400; {NO_TEMPLATE_FIX}"


def compile_template(source: str) -> None:
    """Compile Jinja source as transformers does before rendering a chat (its sandboxed
    environment, with its `generation` tag); TemplateSyntaxError when it cannot."""
    try:  # 4.48 to 5.x: a module-level function (transformers/utils/chat_template_utils.py)
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # 4.36 compiles in a tokenizer method, with this environment
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
        return
    _compile_jinja_template(source)


def check_chat_template_syntax(checkpoint: Path, setting: str) -> None:
    """Every chat template the worker may render compiles: a syntax error would answer
    every chat request with an error, so it is refused here with the file and line. With
    handler.chat_template set only that one is rendered (a preset, inline Jinja or a file
    in the checkpoint); else the checkpoint's own."""
    from jinja2.exceptions import TemplateSyntaxError

    if setting:
        try:
            sources = [("handler.chat_template", resolve_template(setting, str(checkpoint)))]
        except FileNotFoundError as exc:
            raise ConfigError(str(exc)) from None
    else:
        sources = checkpoint_templates(checkpoint)
    for where, source in sources:
        try:
            compile_template(source)
        except TemplateSyntaxError as exc:
            raise ConfigError(f"{where}: the chat template does not compile: {exc.message} "
                              f"(template line {exc.lineno}), so every chat request would "
                              "fail; fix the template, or set handler.chat_template (llama-2, "
                              "llama-3)") from None


def check_checkpoint_files(config: ModelConfig, checkpoint: Path) -> list[str]:
    """config.json, generation_config.json, weights and positions; returns warnings."""
    h = config.handler
    if not (checkpoint / "config.json").is_file():
        raise ConfigError(f"{checkpoint}: no config.json; pass a Hugging Face checkpoint "
                          "directory (see `inf2serve prepare`)")
    model_config = read_json(checkpoint / "config.json")
    if (checkpoint / "generation_config.json").is_file():
        read_json(checkpoint / "generation_config.json")  # the backends read its EOS ids
    if h.backend != "synthetic":  # the synthetic device reads no weights
        check_weights(checkpoint, model_config)
    check_positions(h, model_config, checkpoint / "config.json")
    check_chat_template_syntax(checkpoint, h.chat_template)
    warnings = []
    if h.backend in NEURON_BACKENDS:  # its worker runs a Neuron SDK's transformers 4.x
        found = check_transformers4(checkpoint)
        if found.problems:
            raise ConfigError(found.problems[0])
        warnings += found.warnings
    warning = chat_template_warning(checkpoint, h.chat_template)
    return warnings + ([warning] if warning else [])


def check_archive(raw: Mapping[str, Any] | None, config: ModelConfig,
                  checkpoint: Path) -> Checked:
    """Everything the worker refuses before loading: the frontend keys TorchServe read,
    the checkpoint's files; then its generation defaults merged into `config`."""
    check_frontend(raw)
    warnings = check_checkpoint_files(config, checkpoint)
    warnings += generation_warnings(config, raw, checkpoint)
    merged, taken = apply_generation_defaults(config, raw, checkpoint)
    return Checked(merged, tuple(warnings), taken)


def generation_warnings(config: ModelConfig, raw: Mapping[str, Any] | None,
                        checkpoint: Path) -> list[str]:
    """generation_config.json's sampling values that are not taken as defaults, and why
    (top_p 2.0, temperature -1): said rather than dropped without a word."""
    path = checkpoint / "generation_config.json"
    if not path.is_file():
        return []
    caps = capabilities_for(config.handler)
    lines = sampling_left_out(read_json(path), caps.max_top_k, configured_defaults(raw))
    return [f"{path}: {line}" for line in lines]


def load_worker_config(raw: Mapping[str, Any] | None, model_dir: Path) -> ModelConfig:
    """The worker's config: parsed, checked against its archive, with the checkpoint's
    generation defaults; warnings and what was taken go to the worker log. TorchServe parsed
    the archive's model-config.yaml keeping the last of a key given twice: the file is read
    again here to refuse that, as packaging does."""
    yaml_path = model_dir / ARCHIVE_YAML
    if yaml_path.is_file():
        check_duplicates(yaml_path.read_text(encoding="utf-8"), yaml_path)
    config = parse_config(raw)
    checked = check_archive(raw, config, model_dir / config.handler.checkpoint)
    for warning in checked.warnings:
        logger.warning(warning)
    if checked.taken:
        logger.info("handler.defaults from generation_config.json: %s", checked.taken)
    return checked.config
