"""`inf2serve prepare`: a Hugging Face checkpoint into a serving checkpoint.

A serving checkpoint is what `package` puts under the archive's model/: weights
cast to the configured dtype (safetensors, or the legacy split layout older
transformers-neuronx loads), config.json with the new dtype, generation_config.json
and the tokenizer files, which transformers 4.36+ (the Neuron SDKs') and 5.x read the
same way (archive_tools/checkpoint_compat.py). Tensors are streamed one source shard
at a time (safetensors `safe_open`, or mmap'd torch.load for .bin), so a 70B checkpoint
never has to fit in memory as a model. The output is written to a work dir next
to OUT and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

from archive_tools.checkpoint_compat import make_compatible
from archive_tools.fileops import human, progress_bar, staged
from archive_tools.hub_layout import check_layout, transformers_shards
from archive_tools.package import check_loads
from handlers.config import load_config
from handlers.errors import Inf2ServeError

AMP_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
# tokenizer and generation files a serving checkpoint carries (never weights or README/.git)
META_GLOBS = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
              "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.model",
              "chat_template.jinja", "chat_template.json", "preprocessor_config.json")
SPLIT_DIR = "pytorch_model.bin"  # transformers-neuronx save_pretrained_split layout
KEY_TO_FILENAME = "key_to_filename.json"


def _read_json(path: Path) -> dict:
    """A checkpoint's JSON file as an object, or an error naming the file and the fix."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Inf2ServeError(f"SRC {path}: not valid JSON ({exc}); restore the file from the "
                             "checkpoint's source (download or save_pretrained again)") from exc
    if not isinstance(data, dict):
        raise Inf2ServeError(f"SRC {path}: expected a JSON object, got {type(data).__name__}; "
                             "restore the file from the checkpoint's source")
    return data


def source_shards(src: Path) -> list[Path]:
    """Weight files of a HF checkpoint, preferring safetensors (as transformers does)."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (src / index).is_file():
            weight_map = _read_json(src / index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise Inf2ServeError(f"SRC {src / index}: no \"weight_map\"; restore the index "
                                     "from the checkpoint's source")
            shards = [src / str(name) for name in dict.fromkeys(weight_map.values())]
            missing = [s.name for s in shards if not s.is_file()]
            if missing:
                raise Inf2ServeError(f"SRC {src}: {index} lists {len(missing)} shard(s) that "
                                     f"are not there ({', '.join(missing[:3])}"
                                     f"{', ...' if len(missing) > 3 else ''}); download them")
            return shards
    shards = transformers_shards(sorted(src.glob("*.safetensors")))  # not Mistral's own
    if not shards and (src / "pytorch_model.bin").is_file():
        shards = [src / "pytorch_model.bin"]
    if not shards:
        raise Inf2ServeError(f"{src}: no *.safetensors, pytorch_model.bin or shard index; pass a "
                             "Hugging Face checkpoint directory (save_pretrained output)")
    return shards


def _damaged(shard: Path, exc: BaseException) -> Inf2ServeError:
    why = " ".join(str(exc).split()) or type(exc).__name__
    return Inf2ServeError(f"SRC {shard}: not a readable {shard.suffix.lstrip('.')} weights file "
                          f"({why}); it is damaged or cut short: download or save it again")


def check_shards(shards: list[Path]) -> None:
    """Open every safetensors shard's header (no tensor is read), so a damaged file is
    named before any work: safetensors checks the header and that the file is as long as
    the header says."""
    from safetensors import safe_open

    for shard in shards:
        if shard.suffix != ".safetensors":
            continue
        try:
            with safe_open(str(shard), framework="pt") as f:
                f.keys()
        except Exception as exc:  # safetensors' SafetensorError (Rust) or OSError
            raise _damaged(shard, exc) from exc


def iter_tensors(shard: Path) -> Iterator[tuple[str, object]]:
    """(key, tensor) pairs of one shard, read lazily where the format allows."""
    import torch

    if shard.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except Inf2ServeError:
            raise
        except Exception as exc:  # a header that reads but data that does not
            raise _damaged(shard, exc) from exc
    else:
        try:
            tensors = torch.load(shard, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:  # pickle, zip or EOF errors of a damaged .bin
            raise _damaged(shard, exc) from exc
        yield from tensors.items()


def cast(tensor, dtype):
    """Floating tensors to `dtype` (None keeps them); integer buffers are left alone."""
    if dtype is None or not tensor.is_floating_point():
        return tensor.contiguous()
    return tensor.to(dtype).contiguous()


#: JSON files of a checkpoint that `prepare` reads or rewrites: each is read up front, so
#: a damaged one is named (and exits 2) before any work
JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "chat_template.json")


def _check_src(src: Path) -> None:
    if src.is_file():
        raise Inf2ServeError(f"SRC {src}: a file, not a directory; pass the Hugging Face "
                             "checkpoint directory (the output of save_pretrained)")
    if not src.is_dir():
        raise Inf2ServeError(f"SRC {src}: no such directory")
    check_layout(src)  # each family's hub layout: archive_tools/hub_layout.py
    if not (src / "config.json").is_file():
        raise Inf2ServeError(f"SRC {src}: no config.json; pass a Hugging Face checkpoint "
                             "directory (the output of save_pretrained)")
    for name in JSON_FILES:
        if (src / name).is_file():
            _read_json(src / name)
    if not any((src / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise Inf2ServeError(f"SRC {src}: no tokenizer files (tokenizer.json, tokenizer.model or "
                             "vocab.json); save the tokenizer into the checkpoint directory")


def _write_safetensors(shards: list[Path], out: Path, dtype, advance) -> None:
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    names = [s.name if s.suffix == ".safetensors" else
             (f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
              else "model.safetensors") for i, s in enumerate(shards)]
    for shard, name in zip(shards, names, strict=True):
        tensors, seen = {}, set()
        for key, t in iter_tensors(shard):
            t = cast(t, dtype)
            if t.untyped_storage().data_ptr() in seen:  # tied weights share storage in .bin
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            tensors[key] = t
            weight_map[key] = name
            total += t.numel() * t.element_size()
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        advance(shard.stat().st_size)
        del tensors
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_split(shards: list[Path], out: Path, dtype, advance) -> None:
    """One torch.save file per key plus key_to_filename.json, as save_pretrained_split wrote."""
    import re

    import torch

    split = out / SPLIT_DIR
    split.mkdir()
    key_to_filename: dict[str, str] = {}
    for shard in shards:
        for key, t in iter_tensors(shard):
            name = re.sub(r"(?u)[^-\w.]", "", key.strip().replace(" ", "_"))
            key_to_filename[key] = f"p{len(key_to_filename)}.{name}"
            # clone: torch.save writes a view's whole storage otherwise
            torch.save(cast(t, dtype).clone(), split / key_to_filename[key])
        advance(shard.stat().st_size)
    (split / KEY_TO_FILENAME).write_text(json.dumps(key_to_filename, indent=2))


def _write_meta(src: Path, out: Path, amp: str | None) -> None:
    for pattern in META_GLOBS:
        for path in src.glob(pattern):
            if path.is_file() and not (out / path.name).exists():
                shutil.copyfile(path, out / path.name)
    config = json.loads((out / "config.json").read_text())
    if amp is not None:
        config["dtype"] = AMP_DTYPES[amp]  # make_compatible mirrors it to 4.x's torch_dtype
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    make_compatible(out)
    if not (out / "generation_config.json").exists():
        from transformers import GenerationConfig, PretrainedConfig

        # rope_scaling is no generation setting; 5.x's base config warns that it is deprecated
        base = PretrainedConfig.from_dict({k: v for k, v in config.items() if k != "rope_scaling"})
        GenerationConfig.from_model_config(base).to_json_file(out / "generation_config.json")


def _write_tokenizer_json(src: Path, out: Path) -> None:
    """A checkpoint with only tokenizer.model (sentencepiece) gets the tokenizer.json of its
    fast tokenizer, converted once here, so workers read it with `tokenizers` alone (without
    it transformers needs sentencepiece, then tiktoken, in every worker)."""
    if (src / "tokenizer.json").is_file() or not (src / "tokenizer.model").is_file():
        return
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src.resolve())
    except Exception as exc:  # transformers raises ValueError, ImportError, OSError, ...
        raise Inf2ServeError(
            f"SRC {src}: only tokenizer.model (no tokenizer.json), and it does not load here: "
            f"{str(exc).strip().splitlines()[0]}; `pip install sentencepiece` and run prepare "
            "again: it converts tokenizer.model once into tokenizer.json, which workers read "
            "without sentencepiece") from exc
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise Inf2ServeError(f"SRC {src}: tokenizer.model loads only as a slow "
                             f"{type(tokenizer).__name__}, which has no tokenizer.json to write; "
                             "save a fast tokenizer (tokenizer.json) into SRC")
    backend.save(str(out / "tokenizer.json"))


def amp_from_config(config_path: Path) -> str:
    """The amp a model-config.yaml asks for: handler.dtype, resolved for its backend."""
    return load_config(config_path).handler.amp


def prepare(src: Path, out: Path, *, amp: str | None = None, legacy_split: bool = False,
            force: bool = False, show_progress: bool = False) -> Path:
    """Write the serving checkpoint of `src` to `out` (atomically); returns `out`."""
    import torch

    src, out = Path(src), Path(out)
    _check_src(src)
    if amp is not None and amp not in AMP_DTYPES:
        raise Inf2ServeError(f"--amp {amp!r}: choose one of {', '.join(AMP_DTYPES)}")
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise Inf2ServeError(f"OUT {out}: must not be SRC or inside it; pick another directory")
    if out.exists() and not force:
        raise Inf2ServeError(f"OUT {out} exists; pass --force to replace it")
    shards = source_shards(src)
    check_shards(shards)
    dtype = getattr(torch, AMP_DTYPES[amp]) if amp else None
    with staged(out) as built:
        built.mkdir()
        total = sum(s.stat().st_size for s in shards)
        with progress_bar(total, f"preparing {out.name}", show_progress) as advance:
            writer = _write_split if legacy_split else _write_safetensors
            writer(shards, built, dtype, advance)
        _write_tokenizer_json(src, built)
        _write_meta(src, built, amp)
        check_loads(built, "OUT")  # as package will, and the worker
        for path in [built, *built.rglob("*")]:  # safetensors writes 0600; serving may not be us
            path.chmod(0o755 if path.is_dir() else 0o644)
    return out


#: --dtype takes handler.dtype's names; --amp, the older flag, the short ones
DTYPE_AMP = {dtype: amp for amp, dtype in AMP_DTYPES.items()}


def _run(args: argparse.Namespace) -> int:
    amp = (DTYPE_AMP[args.dtype] if args.dtype else args.amp) or (
        amp_from_config(Path(args.config)) if args.config else None)
    out = prepare(Path(args.src), Path(args.out), amp=amp, legacy_split=args.legacy_split,
                  force=args.force, show_progress=True)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    layout = "legacy split (pytorch_model.bin/)" if args.legacy_split else "safetensors"
    print(f"prepared {out} ({layout}, {AMP_DTYPES[amp] if amp else 'source dtype'}, "
          f"{human(size)})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare", help="turn a Hugging Face checkpoint into a serving checkpoint",
        description="Write a serving checkpoint: weights cast to --dtype (safetensors, or "
        "the legacy split layout of older transformers-neuronx), config.json, "
        "generation_config.json and tokenizer files. Tensors are streamed, not loaded as a model."
        "\n\nexamples:\n  inf2serve prepare ~/hf/Llama-2-7b-hf work/llama-7b --dtype bfloat16\n"
        "  inf2serve prepare ~/hf/Llama-2-7b-hf work/llama-7b-split --legacy-split "
        "--config model_configs/llama-2-7b/inf2.xlarge-latency.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="Hugging Face checkpoint directory")
    p.add_argument("out", help="output directory (written atomically)")
    cast = p.add_mutually_exclusive_group()
    cast.add_argument("--dtype", choices=list(DTYPE_AMP),
                      help="cast floating weights to this dtype, named as handler.dtype names it "
                      "(default: --config's handler.dtype, else keep the checkpoint's)")
    cast.add_argument("--amp", choices=list(AMP_DTYPES),
                      help="the same as --dtype, in short names (bf16 = bfloat16)")
    p.add_argument("--config", help="model-config.yaml to take the dtype from (handler.dtype)")
    p.add_argument("--legacy-split", action="store_true",
                   help="pytorch_model.bin/ with one file per key (save_pretrained_split layout)")
    p.add_argument("--force", action="store_true", help="replace an existing OUT")
    p.set_defaults(func=_run)
