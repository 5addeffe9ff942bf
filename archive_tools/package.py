"""`inf2serve package`: validate model-config.yaml, then build a TorchServe archive.

Archive layout (the same for every format):
    handler_entry.py      TorchServe entry point; puts runtime/ on sys.path
    runtime/handlers/     the toolkit's runtime (config, scheduler, backends)
    runtime/neuron_cache/ compile-cache library
    model-config.yaml     validated config
    <checkpoint>/         weights + tokenizer (handler.checkpoint, default "model")
    neuron_cache/         pre-compiled Neuron artifacts (optional)
    requirements.txt      runtime dependencies (torch: pinned; neuron: none, the SDK's stay)
    MAR-INF/MANIFEST.json written by model_archiver's own manifest code

Why not call torch-model-archiver: it copies every extra file into
$TMPDIR/<name> (shared by concurrent runs of the same name) and then again into
the export, so a 100 GB checkpoint is written twice. Here the plan lists
(source, archive name) pairs and each format writes them straight into a work
directory next to the output: the checkpoint's bytes are written once (zero
times with --link for folders). The work directory is renamed into place only
when complete, so an interrupted run leaves the model store as it was.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import io
import re
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from archive_tools.fileops import (
    Advance,
    CountingReader,
    copy_path,
    copy_stream,
    human,
    progress_bar,
    remove_path,
    staged,
)
from handlers.config import ModelConfig, load_config
from handlers.errors import Inf2ServeError

FORMATS = {"mar": ".mar", "tgz": ".tar.gz", "zip-store": ".mar", "no-archive": ""}
RUNTIME_PACKAGES = ("handlers", "neuron_cache")
ENTRY_FILE = Path(__file__).resolve().parent / "data" / "handler_entry.py"
NEURON_BACKENDS = ("neuron", "nxdi")  # the Neuron SDK brings torch and transformers
PINNED = ("transformers", "tokenizers", "safetensors", "pyyaml")  # torch backend, as built
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-.]*$")  # torch-model-archiver's rule
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
SKIP_DIRS = {"__pycache__", ".git", ".ipynb_checkpoints"}
COMPRESS_LEVEL = 1  # weights barely compress; level 1 is several times faster than 6


@dataclass(frozen=True)
class Entry:
    """One file of the archive: copied from `src`, or `data` written as is."""

    arcname: str
    src: Path | None = None
    data: bytes | None = None
    link: bool = False  # hard-link instead of copying (no-archive --link, checkpoint only)

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else self.src.stat().st_size


@dataclass(frozen=True)
class Plan:
    """Everything `execute` will do; `--dry-run` prints it."""

    name: str
    fmt: str
    target: Path
    replaces: tuple[Path, ...]
    entries: tuple[Entry, ...]
    manifest: str

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def describe(self) -> str:
        lines = [f"package {self.name} ({self.fmt}) -> {self.target}",  # + MANIFEST.json
                 f"  {len(self.entries) + 1} files, {human(self.total_bytes)}"]
        lines += [f"  replaces {p}" for p in self.replaces]
        linked = sum(e.size for e in self.entries if e.link)
        if linked:
            lines.append(f"  hard-links {human(linked)} of checkpoint (no copy)")
        return "\n".join(lines)


def archive_path(out_dir: Path, name: str, fmt: str) -> Path:
    return Path(out_dir) / f"{name}{FORMATS[fmt]}"


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _walk(root: Path, prefix: str, link: bool = False) -> list[Entry]:
    """Files under `root` as entries named prefix/relative, without caches or hidden files."""
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith(".") for part in rel.parts):
            continue
        if path.is_file() and path.suffix != ".pyc":
            out.append(Entry(f"{prefix}/{rel.as_posix()}", src=path, link=link))
    return out


def requirements_txt(config: ModelConfig) -> str:
    """The archive's runtime dependencies, for TorchServe's per-model pip install.

    With TS_INSTALL_PY_DEP_PER_MODEL=true TorchServe 0.12 runs `pip install -U -t MODEL_DIR
    -r requirements.txt` (ModelManager.setupModelDependencies): every listed package and its
    dependencies land in the model directory, ahead of site-packages. torch backend: the
    versions this archive was built and tested with, pinned. neuron backend: no requirement
    at all, since the neuron runtime needs only what TorchServe and the Neuron SDK bring
    (pyyaml, jinja2, torch, transformers, ...), and a transformers installed there would
    shadow the one transformers-neuronx was built against.
    """
    if config.handler.backend in NEURON_BACKENDS:
        return (f"# {config.handler.backend} backend: nothing to install. torch, transformers, "
                "tokenizers, torch-neuronx,\n# transformers-neuronx or neuronx-distributed"
                "(-inference) and neuronx-cc come from the Neuron\n# DLAMI/DLC (or "
                "pip.repos.neuron.amazonaws.com) and must not be replaced: TorchServe\n# "
                "installs this file with `pip install -U -t MODEL_DIR`.\n")
    lines = ["# runtime dependencies of this archive (TorchServe and torch come with the image)"]
    for dist in PINNED:
        try:
            lines.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(dist)
    return "\n".join(lines) + "\n"


def check_checkpoint(checkpoint: Path, needs_weights: bool = True) -> None:
    """A serving checkpoint: config.json, weights and tokenizer files (what `prepare` writes).
    The synthetic backend reads no weights (`needs_weights` False)."""
    if not checkpoint.is_dir():
        raise Inf2ServeError(f"--checkpoint {checkpoint}: no such directory")
    if not (checkpoint / "config.json").is_file():
        raise Inf2ServeError(f"--checkpoint {checkpoint}: no config.json; pass a Hugging Face "
                             "checkpoint directory (see `inf2serve prepare`)")
    has_weights = any(next(checkpoint.glob(g), None) for g in WEIGHT_GLOBS)
    if needs_weights and not has_weights and not (checkpoint / "pytorch_model.bin").is_dir():
        raise Inf2ServeError(f"--checkpoint {checkpoint}: no *.safetensors or pytorch_model.bin; "
                             "run `inf2serve prepare SRC OUT` to write a serving checkpoint")
    if not any((checkpoint / f).is_file() for f in TOKENIZER_FILES):
        raise Inf2ServeError(f"--checkpoint {checkpoint}: no tokenizer files "
                             f"({', '.join(TOKENIZER_FILES)}); save the tokenizer next to the "
                             "weights (`inf2serve prepare` copies it)")


def manifest_json(name: str, version: str) -> str:
    """MAR-INF/MANIFEST.json exactly as torch-model-archiver writes it."""
    from model_archiver.model_archiver_config import ModelArchiverConfig
    from model_archiver.model_packaging_utils import ModelExportUtils

    return ModelExportUtils.generate_manifest_json(ModelArchiverConfig(
        model_name=name, handler=ENTRY_FILE.name, version=version,
        config_file="model-config.yaml", requirements_file="requirements.txt"))


def plan_package(config_path: Path, checkpoint: Path, name: str, fmt: str, out_dir: Path, *,
                 force: bool = False, version: str = "1.0", neuron_cache: Path | None = None,
                 link: bool = False) -> Plan:
    """Validate every input and list what goes where; writes nothing."""
    config = load_config(config_path)  # ConfigError names the closest valid key
    if fmt not in FORMATS:
        raise Inf2ServeError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if not NAME_RE.match(name):
        raise Inf2ServeError(f"--name {name!r}: use letters, digits, '_', '-' and '.', "
                             "starting with a letter or digit")
    if link and fmt != "no-archive":
        raise Inf2ServeError("--link only applies to --format no-archive (archives copy bytes)")
    checkpoint = Path(checkpoint)
    check_checkpoint(checkpoint, needs_weights=config.handler.backend != "synthetic")
    ckpt_name = config.handler.checkpoint
    if Path(ckpt_name).is_absolute() or ".." in Path(ckpt_name).parts:
        raise Inf2ServeError(f"handler.checkpoint: {ckpt_name!r} must be a relative path inside "
                             "the archive, e.g. 'model'")
    entries = [Entry(ENTRY_FILE.name, src=ENTRY_FILE)]
    for pkg in RUNTIME_PACKAGES:
        pkg_dir = _package_dir(pkg)
        if pkg_dir is None:
            if pkg == "handlers" or config.handler.backend in NEURON_BACKENDS:
                raise Inf2ServeError(f"runtime package {pkg!r} not found; reinstall inf2serve "
                                     "(pip install -e .)")
            continue
        entries += _walk(pkg_dir, f"runtime/{pkg}")
    entries += _walk(checkpoint, ckpt_name, link=link)
    if neuron_cache is not None:
        if not Path(neuron_cache).is_dir():
            raise Inf2ServeError(f"--neuron-cache {neuron_cache}: no such directory")
        entries += _walk(Path(neuron_cache), config.handler.neuron.cache_dir)
    entries.append(Entry("model-config.yaml", data=Path(config_path).read_bytes()))
    entries.append(Entry("requirements.txt", data=requirements_txt(config).encode()))

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise Inf2ServeError(f"--out {out_dir}: exists and is not a directory")
    target = archive_path(out_dir, name, fmt)
    # one name, one archive: serve would otherwise pick whichever suffix it finds first
    existing = tuple(p for p in {archive_path(out_dir, name, f) for f in FORMATS}
                     if p.exists() or p.is_symlink())
    if existing and not force:
        raise Inf2ServeError(f"{existing[0]} exists; pass --force to replace it")
    return Plan(name, fmt, target, tuple(sorted(existing)), tuple(entries),
                manifest_json(name, version))


def _write_folder(plan: Plan, dest: Path, advance: Advance) -> None:
    for e in plan.entries:
        path = dest / e.arcname
        path.parent.mkdir(parents=True, exist_ok=True)
        if e.data is not None:
            path.write_bytes(e.data)
        else:
            copy_path(e.src, path, advance, link=e.link)
    (dest / "MAR-INF").mkdir(exist_ok=True)
    (dest / "MAR-INF" / "MANIFEST.json").write_text(plan.manifest)


def _write_zip(plan: Plan, dest: Path, advance: Advance) -> None:
    method = zipfile.ZIP_STORED if plan.fmt == "zip-store" else zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(dest, "w", method, compresslevel=COMPRESS_LEVEL) as zf:
        for e in plan.entries:
            if e.data is not None:
                zf.writestr(e.arcname, e.data)
                continue
            info = zipfile.ZipInfo.from_file(e.src, e.arcname)
            info.compress_type, info.external_attr = method, 0o644 << 16
            with open(e.src, "rb") as fsrc, zf.open(info, "w", force_zip64=True) as fdst:
                copy_stream(fsrc, fdst, advance)
        zf.writestr("MAR-INF/MANIFEST.json", plan.manifest)


def _write_tgz(plan: Plan, dest: Path, advance: Advance) -> None:
    # torch-model-archiver nests tgz members under <name>/; TorchServe expects that
    with tarfile.open(dest, "w:gz", compresslevel=COMPRESS_LEVEL) as tar:
        def add(arcname: str, data: bytes) -> None:
            info = tarfile.TarInfo(f"{plan.name}/{arcname}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))

        for e in plan.entries:
            if e.data is not None:
                add(e.arcname, e.data)
                continue
            info = tar.gettarinfo(str(e.src), arcname=f"{plan.name}/{e.arcname}")
            info.mode, info.uid, info.gid, info.uname, info.gname = 0o644, 0, 0, "", ""
            with open(e.src, "rb") as fsrc:
                tar.addfile(info, CountingReader(fsrc, advance))
        add("MAR-INF/MANIFEST.json", plan.manifest.encode())


WRITERS = {"no-archive": _write_folder, "mar": _write_zip, "zip-store": _write_zip,
           "tgz": _write_tgz}


def execute(plan: Plan, *, show_progress: bool = True) -> Path:
    """Write the archive in a work dir next to the target, then rename it into place."""
    with staged(plan.target, label=plan.name) as built:
        if plan.fmt == "no-archive":
            built.mkdir()
        with progress_bar(plan.total_bytes, f"packaging {plan.name}", show_progress) as advance:
            WRITERS[plan.fmt](plan, built, advance)
        built.chmod(0o755 if built.is_dir() else 0o644)
    for other in plan.replaces:
        if other != plan.target:
            remove_path(other)
    return plan.target


def package(config_path: Path, checkpoint: Path, name: str, fmt: str, out_dir: Path,
            force: bool = False, version: str = "1.0", *, neuron_cache: Path | None = None,
            link: bool = False, show_progress: bool = False) -> Path:
    """Validate, plan and write; returns the archive path in `out_dir`."""
    plan = plan_package(config_path, checkpoint, name, fmt, out_dir, force=force,
                        version=version, neuron_cache=neuron_cache, link=link)
    return execute(plan, show_progress=show_progress)


def _run(args: argparse.Namespace) -> int:
    plan = plan_package(Path(args.config), Path(args.checkpoint), args.name, args.format,
                        Path(args.out), force=args.force, version=args.version,
                        neuron_cache=Path(args.neuron_cache) if args.neuron_cache else None,
                        link=args.link)
    print(plan.describe())
    if args.dry_run:
        print("dry run: nothing written")
        return 0
    target = execute(plan, show_progress=True)
    print(f"packaged {args.name} -> {target}")
    print(f"next: inf2serve serve --model-store {target.parent} --models {args.name}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "package", help="validate model-config.yaml and build a TorchServe archive",
        description="Validate model-config.yaml, then build a self-contained TorchServe archive "
        "(runtime and requirements.txt inside: pinned for torch; empty for neuron, so the Neuron "
        "SDK's packages stay). The archive is built next to the output and renamed into place "
        "when complete.\n\nexamples:\n"
        "  inf2serve package --config model_configs/tiny-llama-cpu.yaml "
        "--checkpoint demo/tiny-llama --name tiny-llama --out model_store\n"
        "  inf2serve package --config llama.yaml --checkpoint /data/llama-7b --name llama "
        "--format no-archive --link --out /models --dry-run",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="model-config.yaml")
    p.add_argument("--checkpoint", required=True, help="serving checkpoint directory")
    p.add_argument("--name", required=True, help="model name (archive name)")
    p.add_argument("--format", choices=list(FORMATS), default="mar",
                   help="mar (zip, deflate), tgz, zip-store (zip, no compression) or no-archive "
                   "(a folder: fastest to write and to load; best for large models)")
    p.add_argument("--out", default="model_store", help="model store directory")
    p.add_argument("--version", default="1.0")
    p.add_argument("--neuron-cache", help="pre-compiled Neuron cache directory to include")
    p.add_argument("--link", action="store_true",
                   help="no-archive: hard-link checkpoint files instead of copying (same "
                   "filesystem; falls back to copying)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing archive of this name (after the new one is complete)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.set_defaults(func=_run)
