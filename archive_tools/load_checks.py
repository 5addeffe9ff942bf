"""The load checks of `validate --checkpoint`, `package` and `compile`: refuse in seconds
what a worker (or TorchServe reading the archive) would refuse after a long start.

A new module rather than more of package.py: three commands run these checks, and the
worker runs their core itself. That core (frontend keys, weights headers and index,
positions, chat template, generation defaults) lives in handlers/checkpoint_checks.py,
inside every archive, because the worker may not import archive_tools; this module adds
what only packaging can see or fix: the YAML file itself (an empty one crashes
TorchServe 0.12 for every model), the frontend keys `package` writes when absent, the
weight format, and the tokenizer and config.json loaded with the worker's own calls.
Nothing here reads tensor data.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from archive_tools import transformers4
from archive_tools.template_checks import check_chat_template
from handlers.backends import capabilities_for, family_problems
from handlers.backends.capabilities import check_defaults
from handlers.checkpoint_checks import check_archive, check_positions, check_weights, read_json
from handlers.config import FrontendConfig, ModelConfig, parse_config
from handlers.config_yaml import load_yaml
from handlers.errors import ConfigError, Inf2ServeError
from handlers.transformers4_rules import NEURON_BACKENDS
from handlers.transformers4_rules import check_files as check_transformers4

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
PICKLED = ("pytorch_model*.bin", "pytorch_model.bin.index.json")  # served only via `prepare`
# other frameworks' or original (non-HF) weights hub repos carry beside the safetensors
OTHER_WEIGHTS = ("tf_model*.h5", "flax_model*.msgpack", "*.pth", "*.pt", "*.ckpt", "*.gguf",
                 "*.onnx", "*.msgpack")
#: frontend keys `package` writes when absent, with TorchServe 0.12's own default for each
#: (frontend/archive/.../ModelConfig.java): the handler requires the first three, and the
#: documented timeouts are ours (FrontendConfig), not TorchServe's 120 s
TORCHSERVE_DEFAULTS = {"asyncCommunication": False, "batchSize": 1, "continuousBatching": False,
                       "responseTimeout": 120, "startupTimeout": 120}
WRITTEN_FRONTEND = tuple(TORCHSERVE_DEFAULTS)
ADDED_COMMENT = ("# written by `inf2serve package`: what the handler needs, whatever "
                 "TorchServe's defaults\n")


@dataclass(frozen=True)
class LoadReport:
    """What passed: the config as the worker will hold it, the archive's YAML, and lines
    for the user."""

    config: ModelConfig  # with the checkpoint's generation defaults
    archive_yaml: bytes  # model-config.yaml as the archive carries it
    left_out: tuple[Path, ...] = ()  # checkpoint files not packaged (a second weight format)
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    taken: dict[str, Any] = field(default_factory=dict)  # from generation_config.json


def read_model_config(path: Path) -> tuple[dict[str, Any], ModelConfig, str]:
    """(YAML mapping, validated config, text) of a model-config.yaml; an empty file (or
    only comments) is refused, since TorchServe 0.12 fails on it with a
    NullPointerException that takes the other models of the store down too."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
        raw = load_yaml(text, path)  # a key given twice is refused with both lines
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"{path}: a YAML {type(raw).__name__}, not a mapping of keys; a "
                          "model-config.yaml holds TorchServe's keys and a `handler:` section "
                          "(see model_configs/tiny-llama-cpu.yaml)")
    if raw is None:
        raise ConfigError(f"{path}: empty; TorchServe 0.12 fails on an empty model-config.yaml "
                          "(NullPointerException) and takes the other models down; write at "
                          "least `asyncCommunication: true` and a `handler:` section (see "
                          "model_configs/tiny-llama-cpu.yaml)")
    return raw, parse_config(raw), text


def frontend_written(raw: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """The WRITTEN_FRONTEND keys the YAML leaves out, with the values the config holds."""
    attr = {f.metadata["key"]: f.name for f in dataclasses.fields(FrontendConfig)}
    return {key: getattr(config.frontend, attr[key]) for key in WRITTEN_FRONTEND
            if key not in raw}


def archive_yaml(text: str, raw: dict[str, Any], added: dict[str, Any]) -> bytes:
    """The user's file with `added` written at the top (comments kept); a file where that
    would not parse back to the same mapping (a document marker, flow style) is rewritten."""
    if not added:
        return text.encode("utf-8")
    want = {**raw, **added}
    lines = ADDED_COMMENT + "".join(f"{k}: {json.dumps(v)}\n" for k, v in added.items())
    try:
        if yaml.safe_load(lines + text) == want:
            return (lines + text).encode("utf-8")
    except yaml.YAMLError:
        pass
    return (ADDED_COMMENT + yaml.safe_dump(want, sort_keys=False)).encode("utf-8")


def weight_files_left_out(checkpoint: Path, flag: str) -> tuple[Path, ...]:
    """One weight format per archive: with safetensors present, pickled .bin shards (and the
    other frameworks' weights hub repos ship beside them) stay out; without safetensors,
    pickled .bin files are refused, since `prepare` converts them (and loads them safely)."""
    pickled = sorted({p for g in PICKLED for p in checkpoint.glob(g) if p.is_file()})
    if not next(checkpoint.glob("*.safetensors"), None):
        if pickled:
            raise Inf2ServeError(
                f"{flag} {checkpoint}: pickled weights ({pickled[0].name}) and no "
                "*.safetensors; run `inf2serve prepare SRC OUT`, which converts them to "
                "safetensors, and package OUT")
        return ()
    if (checkpoint / "pytorch_model.bin").is_dir():
        raise Inf2ServeError(f"{flag} {checkpoint}: holds both *.safetensors and the "
                             "legacy split pytorch_model.bin/ folder; keep one (`inf2serve "
                             "prepare` writes either)")
    other = {p for g in OTHER_WEIGHTS for p in checkpoint.rglob(g) if p.is_file()}
    return tuple(sorted({*pickled, *other}))


def check_layout(checkpoint: Path, needs_weights: bool, flag: str) -> tuple[Path, ...]:
    """A serving checkpoint's files: config.json, one weight format, tokenizer files. The
    synthetic backend reads no weights (`needs_weights` False). Returns the files left
    out: a second weight format beside the safetensors."""
    if checkpoint.is_file():
        raise Inf2ServeError(f"{flag} {checkpoint}: a file, not a directory; pass the checkpoint "
                             "directory (the folder holding config.json, the weights and the "
                             "tokenizer)")
    if not checkpoint.is_dir():
        raise Inf2ServeError(f"{flag} {checkpoint}: no such directory")
    if not (checkpoint / "config.json").is_file():
        raise Inf2ServeError(f"{flag} {checkpoint}: no config.json; pass a Hugging Face "
                             "checkpoint directory (see `inf2serve prepare`)")
    left_out = weight_files_left_out(checkpoint, flag)
    has_weights = next(checkpoint.glob("*.safetensors"), None) or (
        checkpoint / "pytorch_model.bin").is_dir()
    if needs_weights and not has_weights:
        raise Inf2ServeError(f"{flag} {checkpoint}: no *.safetensors (or the legacy split "
                             "pytorch_model.bin/ folder); run `inf2serve prepare SRC OUT` to "
                             "write a serving checkpoint")
    if not any((checkpoint / f).is_file() for f in TOKENIZER_FILES):
        raise Inf2ServeError(f"{flag} {checkpoint}: no tokenizer files "
                             f"({', '.join(TOKENIZER_FILES)}); save the tokenizer next to the "
                             "weights (`inf2serve prepare` copies it)")
    return left_out


def check_loads(checkpoint: Path, flag: str) -> Any:
    """Load the tokenizer and the model config as the worker will (the same AutoTokenizer /
    AutoConfig calls, in this process), so a checkpoint that cannot load fails here with
    the fix rather than in every worker. This process's transformers may differ from the
    serving image's (a Neuron SDK's 4.x); the files are the same."""
    from transformers import AutoConfig

    from handlers.engine.start import load_tokenizer

    try:
        AutoConfig.from_pretrained(checkpoint.resolve())
    except Exception as exc:  # transformers raises many kinds; the message is the point
        raise Inf2ServeError(f"{flag} {checkpoint}: config.json does not load with "
                             f"AutoConfig.from_pretrained: {_first_line(exc)}") from exc
    try:
        return load_tokenizer(checkpoint)
    except Exception as exc:
        fix = ("fix the tokenizer files, or install what the message names where the model "
               "is served")
        if (checkpoint / "tokenizer.model").is_file() and not (
                checkpoint / "tokenizer.json").is_file():
            fix = ("only tokenizer.model is here (no tokenizer.json); convert it once with "
                   "`pip install sentencepiece` then `inf2serve prepare SRC OUT`, which "
                   "writes tokenizer.json, which workers read without sentencepiece")
        raise Inf2ServeError(f"{flag} {checkpoint}: the tokenizer does not load as the worker "
                             f"loads it (AutoTokenizer.from_pretrained): "
                             f"{_first_line(exc)}; {fix}") from exc


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def check_load(config_path: Path, checkpoint: Path, *, fill_frontend: bool = True,
               flag: str = "--checkpoint", load_under_4x: bool = False) -> LoadReport:
    """Every load check, cheapest first; raises on the first refusal.

    `fill_frontend`: `package` and `validate` write (or say they will write) the frontend
    keys the YAML leaves out; `compile` reads an archive, which must carry them, as the
    worker does. `load_under_4x` (`validate`): a Neuron backend's checkpoint is also loaded
    under each transformers 4.x found (archive_tools/transformers4.py)."""
    raw, config, text = read_model_config(config_path)
    added = frontend_written(raw, config) if fill_frontend else {}
    checkpoint = Path(checkpoint)
    left_out = check_layout(checkpoint, config.handler.backend != "synthetic", flag)
    checked = check_archive({**raw, **added}, config, checkpoint)
    h = checked.config.handler
    check_defaults(h, capabilities_for(h))
    check_family(h, read_json(checkpoint / "config.json"))
    tokenizer = check_loads(checkpoint, flag)
    check_chat_template(tokenizer, h.chat_template)
    notes = []
    if load_under_4x and h.backend in NEURON_BACKENDS:  # the worker runs the SDK's 4.x
        notes += transformers4.check_loads_under_4x(checkpoint, flag)
    differ = {k: v for k, v in added.items() if v != TORCHSERVE_DEFAULTS[k]}
    if differ:
        written = ", ".join(f"{k}: {json.dumps(v)}" for k, v in differ.items())
        theirs = ", ".join(json.dumps(TORCHSERVE_DEFAULTS[k]) for k in differ)
        notes.append(f"{Path(config_path).name} leaves out {', '.join(differ)}: `inf2serve "
                     f"package` writes {written} into the archive, where TorchServe's default "
                     f"would be {theirs}")
    if checked.taken:
        taken = ", ".join(f"{k} {v:g}" for k, v in checked.taken.items())
        notes.append(f"handler.defaults from {checkpoint / 'generation_config.json'}: {taken} "
                     "(model-config.yaml's handler.defaults win where set)")
    return LoadReport(checked.config, archive_yaml(text, raw, added), left_out,
                      checked.warnings, tuple(notes), checked.taken)


def check_family(h: Any, model_config: dict[str, Any],
                 draft_config: dict[str, Any] | None = None) -> None:
    """What the Neuron backend's SDK refuses, ignores or fails on of this checkpoint's family
    with these settings (handlers/backends/*_families.py), in one line: the worker's start
    refuses the same before compiling."""
    found = family_problems(h, model_config, draft_config)
    if found:
        raise Inf2ServeError("; ".join(found))


def check_draft(config: ModelConfig, checkpoint: Path, draft: Path,
                flag: str = "--draft-checkpoint") -> tuple[Path, ...]:
    """The speculation draft (handler.neuron.speculation) gets the model's load checks:
    config.json, one weight format with sound headers, positions for handler.max_length,
    a config and tokenizer that load; and the model's vocabulary, which transformers-
    neuronx's FusedSpeculativeDecoder asserts (aws-neuron/transformers-neuronx@1ade6d7:
    src/transformers_neuronx/fused_speculation.py:L308-L310). Returns the files left out."""
    draft = Path(draft)
    left_out = check_layout(draft, True, flag)
    model_config = read_json(draft / "config.json")
    try:
        check_weights(draft, model_config)
        check_positions(config.handler, model_config, draft / "config.json")
    except ConfigError as exc:
        raise Inf2ServeError(f"{flag} {draft}: {exc}") from exc
    target = read_json(Path(checkpoint) / "config.json")
    ours, theirs = target.get("vocab_size"), model_config.get("vocab_size")
    h = config.handler
    # NxD Inference has no such assert: a draft whose vocabulary is the model's padded less
    # (Qwen2.5-0.5B's 151936 for Qwen2.5-7B's 152064) proposes only ids the model knows
    padded_less = (h.backend == "nxdi" and isinstance(ours, int) and isinstance(theirs, int)
                   and theirs <= ours)
    if ours != theirs and not padded_less:
        raise Inf2ServeError(f"{flag} {draft}: vocab_size {theirs} differs from the model's "
                             f"{ours} ({Path(checkpoint) / 'config.json'}); the draft must share "
                             "the model's tokenizer (e.g. Llama-3.2-1B for Llama-3.1-8B; on "
                             "backend nxdi a smaller padded vocabulary, e.g. Qwen2.5-0.5B for "
                             "Qwen2.5-7B)")
    try:
        check_family(h, target, model_config)
    except Inf2ServeError as exc:
        raise Inf2ServeError(f"{flag} {draft}: {exc}") from exc
    problems = check_transformers4(draft).problems  # speculation runs on Neuron backends
    if problems:
        raise Inf2ServeError(f"{flag} {draft}: {problems[0]}")
    check_loads(draft, flag)
    return left_out
