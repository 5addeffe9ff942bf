"""`inf2serve inspect`: what is inside an archive, without extracting it.

One pass over the archive (.mar zip, .tar.gz or folder) collects every member's
size plus the few small files that matter: the manifest, model-config.yaml,
config.json files, safetensors headers (shapes and dtypes, not tensors) and
compile-cache metadata.json. A .tar.gz is read as a stream once, never seeked.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import pickle
import struct
import tarfile
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from archive_tools.fileops import human
from handlers.config import DTYPE_AMP, parse_config, resolve_dtype
from handlers.errors import Inf2ServeError
from handlers.families import family_name, model_class_for
from neuron_cache.key import LEGACY_FAMILY

NEURON_BACKENDS = ("neuron", "nxdi")
MAX_HEADER = 100 << 20  # a safetensors header above this is not one
SMALL = {"MAR-INF/MANIFEST.json", "model-config.yaml", "requirements.txt"}
#: torch.save storages -> safetensors' dtype names, so both layouts report alike
TORCH_DTYPES = {"FloatStorage": "F32", "BFloat16Storage": "BF16", "HalfStorage": "F16",
                "DoubleStorage": "F64", "LongStorage": "I64", "IntStorage": "I32",
                "ShortStorage": "I16", "CharStorage": "I8", "ByteStorage": "U8",
                "BoolStorage": "BOOL"}


@dataclass
class Snapshot:
    """Member sizes plus the contents (or headers) of the members we care about."""

    sizes: dict[str, int] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    path: str = ""  # the archive, for messages

    def fail(self, name: str, what: str) -> Inf2ServeError:
        """A damaged member: named, with the fix."""
        return Inf2ServeError(f"ARCHIVE {self.path}: {name} {what}; the archive is damaged or "
                              "was not written by `inf2serve package`: package it again")

    def json(self, name: str, default: bytes | None = None) -> Any:
        """A member as JSON, or an error naming it."""
        data = self.files.get(name, default)
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise self.fail(name, f"is not valid JSON ({exc})") from exc


def _wanted(name: str) -> str | None:
    """'file' for small files read whole, 'header' for safetensors, None to skip."""
    if name.startswith("runtime/"):
        return None
    if name in SMALL or (name.endswith("/config.json") and name.count("/") == 1):
        return "file"
    if name.endswith("/metadata.json") and name.count("/") == 2:
        return "file"
    if name.endswith(".safetensors"):
        return "header"
    if ("/pytorch_model.bin/" in name and not name.endswith(".json")) or (
            name.endswith(".bin") and "/pytorch_model" in name):
        return "torch"  # the legacy split layout (one torch.save file per tensor), or a .bin
    return None


class _ShapeUnpickler(pickle.Unpickler):
    """Reads a torch.save pickle for (dtype, shape) of each tensor, never its storage bytes,
    and builds nothing else (torch/serialization.py: _rebuild_tensor_v2(storage, offset,
    size, stride, ...), storages as persistent ids ('storage', type, key, location, numel))."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, *rest: (storage, list(size))
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return lambda data, *rest: data
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in TORCH_DTYPES:
            return TORCH_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not a tensor")

    def persistent_load(self, pid: Any) -> Any:
        return pid[1]  # the storage type, already mapped to a dtype name


def _torch_header(f: IO[bytes]) -> bytes:
    """[(dtype, shape), ...] of a torch.save file, read forward from its first zip member
    (archive/data.pkl, stored: torch writes it first, sizes after the data), as JSON."""
    head = f.read(30)
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        return b"[]"
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    if not f.read(name_len).endswith(b"data.pkl"):
        return b"[]"
    f.read(extra_len)
    try:
        obj = _ShapeUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError):
        return b"[]"
    tensors = obj.values() if isinstance(obj, dict) else [obj]
    return json.dumps([t for t in tensors if isinstance(t, tuple)]).encode()


def _read(f: IO[bytes], how: str) -> bytes:
    if how == "file":
        return f.read(MAX_HEADER)
    if how == "torch":
        return _torch_header(f)
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else 0
    return f.read(n) if 0 < n <= MAX_HEADER else b""  # no header: summarize says damaged


def _strip(name: str) -> str:
    return name.split("/", 1)[1] if "/" in name else name


def scan(path: Path) -> Snapshot:
    """Read an archive once; tar.gz members are nested under <name>/ (as model_archiver does)."""
    snap = Snapshot(path=str(path))
    if path.is_dir():
        for p in sorted(path.rglob("*")):
            if p.is_file():
                name = p.relative_to(path).as_posix()
                snap.sizes[name] = p.stat().st_size
                if how := _wanted(name):
                    with open(p, "rb") as f:
                        snap.files[name] = _read(f, how)
    elif zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as zf:
                for info in zf.infolist():
                    if info.is_dir():
                        continue
                    snap.sizes[info.filename] = info.file_size
                    if how := _wanted(info.filename):
                        with zf.open(info) as f:
                            snap.files[info.filename] = _read(f, how)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as exc:
            raise Inf2ServeError(f"ARCHIVE {path}: not a readable zip ({exc}); it is damaged "
                                 "or cut short: package it again") from exc
    elif path.suffix in (".mar", ".zip") and path.is_file():
        raise Inf2ServeError(f"ARCHIVE {path}: not a zip file, so not a .mar (damaged, cut "
                             "short, or another file renamed); package it again with "
                             "`inf2serve package --format mar`")
    elif path.name.endswith((".tar.gz", ".tgz")):
        try:
            with tarfile.open(path, "r|gz") as tar:  # stream mode: one forward pass
                for m in tar:
                    if not m.isfile():
                        continue
                    name = _strip(m.name) if "MAR-INF" not in m.name.split("/")[0] else m.name
                    snap.sizes[name] = m.size
                    if how := _wanted(name):
                        snap.files[name] = _read(tar.extractfile(m), how)
        except (tarfile.TarError, OSError) as exc:
            raise Inf2ServeError(f"ARCHIVE {path}: not a readable .tar.gz ({exc})") from exc
    else:
        raise Inf2ServeError(f"ARCHIVE {path}: expected a .mar, a .tar.gz or an archive folder")
    if "MAR-INF/MANIFEST.json" not in snap.sizes:
        raise Inf2ServeError(f"ARCHIVE {path}: no MAR-INF/MANIFEST.json; not a TorchServe archive "
                             "(build one with `inf2serve package`)")
    return snap


def _safetensors_tensors(snap: Snapshot, name: str) -> list[tuple[str, list[int]]]:
    """(dtype, shape) of each tensor of a safetensors header, or an error naming the file."""
    header = snap.files[name]
    if not header:
        raise snap.fail(name, "has no readable safetensors header (its first 8 bytes give "
                        f"no length of at most {MAX_HEADER} bytes)")
    try:
        entries = json.loads(header)
        return [(t["dtype"], list(t["shape"])) for key, t in entries.items()
                if key != "__metadata__"]
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError,
            TypeError) as exc:
        raise snap.fail(name, f"has a damaged safetensors header ({exc!r})") from exc


def neuron_features(h: dict[str, Any]) -> str:
    """The compiled-in Inf2 speedups of a handler section, in words ("none" without any)."""
    n = h["neuron"]
    q, sp = n.get("quantization") or {}, n.get("speculation") or {}
    parts = [f"{q['weights']} weights ({q.get('method')})" if q.get("weights") else "",
             f"{q['kv_cache']} KV cache" if q.get("kv_cache") else "",
             "on-device sampling" if n.get("on_device_sampling") else "",
             "async mode" if (h.get("nxdi") or {}).get("async_mode") else "",
             f"speculation: {sp['length']} tokens from the draft in {sp['draft_checkpoint']}/"
             if sp.get("draft_checkpoint") else ""]
    return ", ".join(p for p in parts if p) or "none"


def family_line(h: Any, cfg_json: dict[str, Any]) -> str:
    """The checkpoint's family and, on a Neuron backend, the SDK class it runs with (or why
    it cannot): "mistral (mistral.model.MistralForSampling)"."""
    family = family_name(cfg_json)
    if h.backend not in NEURON_BACKENDS:
        return family
    setting = h.nxdi.model_class if h.backend == "nxdi" else h.neuron.model_class_name
    try:
        return f"{family} ({model_class_for(h.backend, cfg_json, setting)})"
    except ValueError as exc:
        return f"{family} (refused: {exc})"


def summarize(snap: Snapshot) -> dict[str, Any]:
    """Plain data for the tables (and --json): manifest, config, checkpoint, cache."""
    manifest = snap.json("MAR-INF/MANIFEST.json")
    try:
        raw = yaml.safe_load(snap.files.get("model-config.yaml", b"")) or {}
    except yaml.YAMLError as exc:
        raise snap.fail("model-config.yaml", "is not valid YAML "
                        f"({' '.join(str(exc).split())})") from exc
    config = parse_config(raw)  # raises ConfigError naming the closest valid key
    ckpt = config.handler.checkpoint.rstrip("/")
    cfg_json = snap.json(f"{ckpt}/config.json", b"{}")
    if not isinstance(manifest, dict) or not isinstance(cfg_json, dict):
        raise snap.fail("MAR-INF/MANIFEST.json" if not isinstance(manifest, dict)
                        else f"{ckpt}/config.json", "is not a JSON object")
    params, dtypes = 0, Counter()
    for name, header in snap.files.items():
        if not name.startswith(f"{ckpt}/"):
            continue
        if name.endswith(".safetensors"):
            tensors = _safetensors_tensors(snap, name)
        elif _wanted(name) == "torch":
            tensors = json.loads(header)
        else:
            continue
        for dtype, shape in tensors:
            params += math.prod(shape)
            dtypes[dtype] += math.prod(shape)
    split = [n for n in snap.sizes if n.startswith(f"{ckpt}/pytorch_model.bin/")]
    pickled = [n for n in snap.sizes if n.startswith(f"{ckpt}/") and n.endswith(".bin")]
    layout = ("legacy split" if split else "pickled .bin" if pickled else "safetensors"
              if any(n.endswith(".safetensors") for n in snap.sizes) else "no weights")
    cache_dir = config.handler.neuron.cache_dir.rstrip("/")
    entries = []
    for name in sorted(snap.files):
        if name.startswith(f"{cache_dir}/") and name.endswith("/metadata.json"):
            meta = snap.json(name)
            inputs = meta.get("inputs", {})
            entries.append({
                "entry": name.split("/")[1], "tp_degree": inputs.get("tp_degree"),
                "batch_size": inputs.get("batch_size"), "n_positions": inputs.get("n_positions"),
                "amp": inputs.get("amp"), "sdk": inputs.get("sdk", {}),
                "family": inputs.get("family", LEGACY_FAMILY),
                "size": sum(int(f.get("size", 0)) for f in meta.get("files", {}).values())})
    return {
        "manifest": manifest,
        "config": config.to_yaml_dict(),
        "checkpoint": {
            "dir": ckpt, "architecture": (cfg_json.get("architectures") or ["?"])[0],
            "model_type": cfg_json.get("model_type", "?"),
            "family": family_line(config.handler, cfg_json),
            "layers": cfg_json.get("num_hidden_layers"), "hidden": cfg_json.get("hidden_size"),
            "vocab": cfg_json.get("vocab_size"), "config_dtype": cfg_json.get("dtype",
                                                                               cfg_json.get("torch_dtype")),
            "params": params if dtypes else None,
            "dtypes": dict(dtypes), "legacy_split_files": len(split), "layout": layout,
            "bytes": sum(s for n, s in snap.sizes.items() if n.startswith(f"{ckpt}/"))},
        "cache": entries,
        "files": snap.sizes,
        "total_bytes": sum(snap.sizes.values()),
    }


def _render(path: Path, s: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)

    def table(title: str, rows: list[tuple[str, Any]]) -> None:
        t = Table(title=title, show_header=False, title_justify="left")
        t.add_column(style="bold", no_wrap=True)
        t.add_column(overflow="fold")
        for k, v in rows:
            t.add_row(k, "" if v is None else str(v))
        console.print(t)

    m = s["manifest"]
    table(f"{path} ({len(s['files'])} files, {human(s['total_bytes'])})",
          [("model", m.get("model", {}).get("modelName")),
           ("version", m.get("model", {}).get("modelVersion")),
           ("handler", m.get("model", {}).get("handler")),
           ("created", m.get("createdOn")), ("archiver", m.get("archiverVersion"))])
    c = s["config"]
    h = c["handler"]
    rows = [("backend", h["backend"]), ("batching", h["batching"]),
            ("batch_size", h["batch_size"]), ("max_length", h["max_length"])]
    dtype = resolve_dtype(h["backend"], h["dtype"])  # auto: what the backend runs
    if h["backend"] in NEURON_BACKENDS:  # handler.neuron means nothing to the others
        rows.append(("neuron", f"tp_degree={h['neuron']['tp_degree']} amp={DTYPE_AMP[dtype]}"))
        rows.append(("speedups", neuron_features(h)))
    else:
        rows.append(("dtype", dtype))
    rows += [("workers", f"{c['minWorkers']}..{c['maxWorkers']}"),
             ("batchSize", c["batchSize"]), ("deviceType", c["deviceType"])]
    table("model-config.yaml (valid)", rows)
    k = s["checkpoint"]
    params = f"{k['params'] / 1e6:.2f}M" if k["params"] is not None else "n/a"
    dtypes = ", ".join(k["dtypes"]) or "?"
    table(f"checkpoint {k['dir']}/", [
        ("architecture", f"{k['architecture']} ({k['model_type']}, {k['layers']} layers, "
                         f"hidden {k['hidden']}, vocab {k['vocab']})"),
        ("family", k["family"]),
        ("params", params), ("dtype", f"{dtypes} (config.json: {k['config_dtype']})"),
        ("size", human(k["bytes"])),
        ("layout", f"legacy split, {k['legacy_split_files']} files" if k["legacy_split_files"]
         else k["layout"])])
    t = Table(title="Neuron compile cache", title_justify="left")
    for col in ("entry", "tp", "batch", "n_pos", "amp", "SDK versions", "size"):
        t.add_column(col, overflow="fold")
    for e in s["cache"]:
        sdk = ", ".join(f"{d} {v}" for d, v in e["sdk"].items())
        t.add_row(e["entry"], str(e["tp_degree"]), str(e["batch_size"]), str(e["n_positions"]),
                  str(e["amp"]), sdk, human(e["size"]))
    if s["cache"]:
        console.print(t)
    elif h["backend"] in NEURON_BACKENDS:
        console.print("Neuron compile cache: none (neuron workers compile at start-up; "
                      "see `inf2serve compile`)")
    f = Table(title="files", title_justify="left")
    f.add_column("path", overflow="fold")
    f.add_column("size", justify="right")
    for name, size in s["files"].items():
        if not name.startswith("runtime/"):
            f.add_row(name, human(size))
    runtime = [n for n in s["files"] if n.startswith("runtime/")]
    f.add_row(f"runtime/ ({len(runtime)} files)",
              human(sum(s["files"][n] for n in runtime)))
    console.print(f)


def _run(args: argparse.Namespace) -> int:
    path = Path(args.archive)
    if not path.exists():
        raise Inf2ServeError(f"ARCHIVE {path}: no such file or directory")
    summary = summarize(scan(path))
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        _render(path, summary)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect", help="show an archive's manifest, config, checkpoint and compile cache",
        description="Show what an archive holds (manifest, validated config, checkpoint "
        "architecture/params/dtype/size, Neuron cache entries and their SDK versions) without "
        "extracting it.\n\nexamples:\n  inf2serve inspect model_store/tiny-llama.mar\n"
        "  inf2serve inspect model_store/llama --json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("archive", metavar="ARCHIVE", help=".mar, .tar.gz or archive folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_run)
