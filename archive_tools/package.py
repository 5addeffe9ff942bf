"""`inf2serve package`: validate model-config.yaml, then build a TorchServe archive.

Archive layout (the same for every format):
    handler_entry.py      TorchServe entry point; puts runtime/ on sys.path
    runtime/handlers/     the toolkit's runtime (config, scheduler, backends)
    runtime/neuron_cache/ compile-cache library
    model-config.yaml     validated config, plus the frontend keys the handler needs
                          where it leaves them out (archive_tools/load_checks.py)
    <checkpoint>/         weights + tokenizer (handler.checkpoint, default "model")
    <draft checkpoint>/   speculation's draft model (--draft-checkpoint; at
                          handler.neuron.speculation.draft_checkpoint)
    neuron_cache/         pre-compiled Neuron artifacts (optional)
    requirements.txt      runtime dependencies (torch: pinned; neuron: none, the SDK's stay),
                          then the lines of --requirements-file
    <handler>.py, extras  --handler FILE and --extra-files, at the top as torch-model-archiver
                          puts them
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
import ast
import glob
import importlib.metadata
import importlib.util
import io
import re
import shlex
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
from archive_tools.load_checks import check_draft, check_load
from archive_tools.load_checks import check_loads as check_loads  # `prepare` imports it here
from handlers.config import ModelConfig
from handlers.errors import Inf2ServeError

FORMATS = {"mar": ".mar", "tgz": ".tar.gz", "zip-store": ".mar", "no-archive": ""}
RUNTIME_PACKAGES = ("handlers", "neuron_cache")
ENTRY_FILE = Path(__file__).resolve().parent / "data" / "handler_entry.py"
NEURON_BACKENDS = ("neuron", "nxdi")  # the Neuron SDK brings torch and transformers
PINNED = ("transformers", "tokenizers", "safetensors", "pyyaml")  # torch backend, as built
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-.]*$")  # torch-model-archiver's rule
RUNTIMES = ("python", "python3")  # model_archiver's RuntimeType, less LSP (C++ handlers)
USER_HANDLER_LINE = 'USER_HANDLER = ""'  # in data/handler_entry.py; --handler fills it in
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
    left_out: tuple[Path, ...] = ()  # checkpoint files not packaged (a second weight format)
    warnings: tuple[str, ...] = ()  # from the load checks: works, with a cost worth knowing
    notes: tuple[str, ...] = ()  # frontend keys written, generation defaults taken

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def describe(self) -> str:
        lines = [f"package {self.name} ({self.fmt}) -> {self.target}",  # + MANIFEST.json
                 f"  {len(self.entries) + 1} files, {human(self.total_bytes)}"]
        lines += [f"  replaces {p}" for p in self.replaces]
        if self.left_out:
            size = sum(p.stat().st_size for p in self.left_out)
            names = ", ".join(p.name for p in self.left_out[:3])
            more = f" and {len(self.left_out) - 3} more" if len(self.left_out) > 3 else ""
            lines.append(f"  leaves out {names}{more} ({human(size)}): the safetensors are "
                         "the one weight format packaged")
        linked = sum(e.size for e in self.entries if e.link)
        if linked:
            lines.append(f"  hard-links {human(linked)} of checkpoint (no copy)")
        lines += [f"note: {n}" for n in self.notes] + [f"warning: {w}" for w in self.warnings]
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


def manifest_json(name: str, version: str, runtime: str = "python") -> str:
    """MAR-INF/MANIFEST.json exactly as torch-model-archiver writes it."""
    from model_archiver.model_archiver_config import ModelArchiverConfig
    from model_archiver.model_packaging_utils import ModelExportUtils

    return ModelExportUtils.generate_manifest_json(ModelArchiverConfig(
        model_name=name, handler=ENTRY_FILE.name, version=version, runtime=runtime,
        config_file="model-config.yaml", requirements_file="requirements.txt"))


def user_handler_class(path: Path) -> str:
    """The one class of `path` that subclasses GenerationHandler (directly, or through another
    class of the file), found without running the file; handler_entry.py picks the same class
    by issubclass in the worker."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError) as exc:
        raise Inf2ServeError(f"--handler {path}: not valid Python ({exc})") from exc
    ours: dict[str, list[str]] = {}  # class -> the qualifying bases it names
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")
                     for b in node.bases]
            if "GenerationHandler" in names or any(n in ours for n in names):
                ours[node.name] = names
    leaves = [c for c in ours if not any(c in bases for bases in ours.values())]
    if len(leaves) != 1:
        found = f"{len(leaves)} ({', '.join(leaves)})" if leaves else "none"
        raise Inf2ServeError(
            f"--handler {path}: expected one class subclassing GenerationHandler, found {found};"
            " write `from handlers.torchserve.generation_handler import GenerationHandler` and "
            "`class MyHandler(GenerationHandler): ...` (override make_backend, serve_one, ...)")
    return leaves[0]


def handler_entries(handler: Path) -> list[Entry]:
    """--handler FILE: the file at the top of the archive (as torch-model-archiver puts it)
    and a handler_entry.py that serves its class."""
    handler = Path(handler)
    if ":" in handler.name:
        raise Inf2ServeError(f"--handler {handler}: a module:function entry point cannot "
                             "extend the inf2serve handler; pass a .py file with a subclass of "
                             "GenerationHandler")
    if not handler.is_file():
        raise Inf2ServeError(f"--handler {handler}: no such file")
    if handler.suffix != ".py" or not handler.stem.isidentifier():
        raise Inf2ServeError(f"--handler {handler}: expected a Python file whose name is a "
                             "module name, e.g. my_handler.py")
    if handler.stem in (Path(ENTRY_FILE).stem, *RUNTIME_PACKAGES):
        raise Inf2ServeError(f"--handler {handler}: the module name {handler.stem!r} is the "
                             "toolkit's own; rename the file")
    user_handler_class(handler)
    entry = ENTRY_FILE.read_text()
    if entry.count(USER_HANDLER_LINE) != 1:
        raise Inf2ServeError(f"{ENTRY_FILE}: no {USER_HANDLER_LINE!r} line; reinstall inf2serve")
    entry = entry.replace(USER_HANDLER_LINE, f"USER_HANDLER = {handler.stem!r}")
    return [Entry(ENTRY_FILE.name, data=entry.encode()), Entry(handler.name, src=handler)]


def extra_file_entries(spec: str) -> list[Entry]:
    """--extra-files a,b,dir,*.json as torch-model-archiver reads it: comma-separated paths or
    wildcards; a file goes to the top of the archive, a folder's contents do."""
    entries = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            raise Inf2ServeError(f"--extra-files {spec!r}: an empty name; separate paths with "
                                 "single commas")
        wildcard = any(c in item for c in "*?[")
        paths = sorted(Path(p) for p in glob.glob(item)) if wildcard else [Path(item)]
        if not paths or not paths[0].exists():
            raise Inf2ServeError(f"--extra-files {item}: no such file or directory"
                                 + (" (the wildcard matched nothing)" if wildcard else ""))
        for path in paths:
            if path.is_dir():
                entries += [Entry(e.arcname.split("/", 1)[1], src=e.src)
                            for e in _walk(path, ".")]
            else:
                entries.append(Entry(path.name, src=path))
    return entries


def check_collisions(entries: list[Entry], extras: list[Entry]) -> None:
    """An extra file must not replace one of ours, nor another extra file."""
    ours = {e.arcname.split("/", 1)[0] for e in entries} | {"MAR-INF"}
    seen: dict[str, Path] = {}
    for e in extras:
        top = e.arcname.split("/", 1)[0]
        if top in ours:
            raise Inf2ServeError(f"--extra-files {e.src}: {e.arcname!r} would replace the "
                                 f"archive's own {top!r}; rename it or put it in a folder")
        if e.arcname in seen:
            raise Inf2ServeError(f"--extra-files {e.src}: {e.arcname!r} is also given as "
                                 f"{seen[e.arcname]}; each name may appear once")
        seen[e.arcname] = e.src


def user_requirements(path: Path) -> str:
    """--requirements-file: appended to the archive's requirements.txt, which TorchServe
    installs only with install_py_dep_per_model=true (ModelManager.setupModelDependencies)."""
    path = Path(path)
    if not path.is_file():
        raise Inf2ServeError(f"--requirements-file {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise Inf2ServeError(f"--requirements-file {path}: not UTF-8 text") from exc
    return f"# from --requirements-file {path.name}\n{text.rstrip()}\n"


def plan_package(config_path: Path, checkpoint: Path, name: str, fmt: str, out_dir: Path, *,
                 force: bool = False, version: str = "1.0", neuron_cache: Path | None = None,
                 link: bool = False, handler: Path | None = None, extra_files: str | None = None,
                 requirements_file: Path | None = None, runtime: str = "python",
                 draft_checkpoint: Path | None = None) -> Plan:
    """Validate every input (the load checks a worker would fail on, first) and list what
    goes where; writes nothing."""
    if fmt not in FORMATS:
        raise Inf2ServeError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if not NAME_RE.match(name):
        raise Inf2ServeError(f"--name {name!r}: use letters, digits, '_', '-' and '.', "
                             "starting with a letter or digit")
    if link and fmt != "no-archive":
        raise Inf2ServeError("--link only applies to --format no-archive (archives copy bytes)")
    if runtime not in RUNTIMES:
        raise Inf2ServeError(f"--runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}")
    checkpoint = Path(checkpoint)
    loaded = check_load(Path(config_path), checkpoint)  # ConfigError names the closest key
    config, left_out = loaded.config, loaded.left_out
    ckpt_name = config.handler.checkpoint
    if Path(ckpt_name).is_absolute() or ".." in Path(ckpt_name).parts:
        raise Inf2ServeError(f"handler.checkpoint: {ckpt_name!r} must be a relative path inside "
                             "the archive, e.g. 'model'")
    user = handler_entries(handler) if handler is not None else []
    entries = user[:1] or [Entry(ENTRY_FILE.name, src=ENTRY_FILE)]
    for pkg in RUNTIME_PACKAGES:
        pkg_dir = _package_dir(pkg)
        if pkg_dir is None:
            if pkg == "handlers" or config.handler.backend in NEURON_BACKENDS:
                raise Inf2ServeError(f"runtime package {pkg!r} not found; reinstall inf2serve "
                                     "(pip install -e .)")
            continue
        entries += _walk(pkg_dir, f"runtime/{pkg}")
    skip = set(left_out)
    entries += [e for e in _walk(checkpoint, ckpt_name, link=link) if e.src not in skip]
    entries += draft_entries(config, checkpoint, draft_checkpoint, link)
    if neuron_cache is not None:
        if not Path(neuron_cache).is_dir():
            raise Inf2ServeError(f"--neuron-cache {neuron_cache}: no such directory")
        entries += _walk(Path(neuron_cache), config.handler.neuron.cache_dir)
    entries.append(Entry("model-config.yaml", data=loaded.archive_yaml))
    requirements = requirements_txt(config)
    if requirements_file is not None:
        requirements += user_requirements(requirements_file)
    entries.append(Entry("requirements.txt", data=requirements.encode()))
    extras = user[1:] + (extra_file_entries(extra_files) if extra_files else [])
    check_collisions(entries, extras)
    entries += extras

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
                manifest_json(name, version, runtime), left_out, loaded.warnings, loaded.notes)


def _nested(a: str, b: str) -> bool:
    """Whether one relative path is the other or inside it."""
    pa, pb = Path(a).parts, Path(b).parts
    n = min(len(pa), len(pb))
    return pa[:n] == pb[:n]


def draft_entries(config: ModelConfig, checkpoint: Path, draft: Path | None,
                  link: bool) -> list[Entry]:
    """--draft-checkpoint DIR, checked as the model is (load_checks.check_draft), at
    handler.neuron.speculation.draft_checkpoint inside the archive; the flag and the key
    come together or not at all."""
    key = "handler.neuron.speculation.draft_checkpoint"
    name = config.handler.neuron.speculation.draft_checkpoint
    if draft is None:
        if name:
            raise Inf2ServeError(f"{key} is {name!r} but no --draft-checkpoint was given; pass "
                                 f"the draft model's checkpoint directory (packaged at {name}/)")
        return []
    if config.handler.backend not in NEURON_BACKENDS:
        raise Inf2ServeError(f"--draft-checkpoint {draft}: speculative decoding runs on the "
                             f"Neuron backends only (neuron, nxdi), and handler.backend is "
                             f"{config.handler.backend!r}; leave out the flag")
    if not name:
        raise Inf2ServeError(f"--draft-checkpoint {draft}: {key} is not set; set it (e.g. "
                             "'draft', where the archive holds the draft) or leave out the flag")
    others = (config.handler.checkpoint, config.handler.neuron.cache_dir)
    if Path(name).is_absolute() or ".." in Path(name).parts or any(
            _nested(name, other) for other in others):
        raise Inf2ServeError(f"{key}: {name!r} must be a relative path inside the archive, apart "
                             f"from handler.checkpoint and handler.neuron.cache_dir, e.g. 'draft'")
    skip = set(check_draft(config, checkpoint, Path(draft)))
    return [e for e in _walk(Path(draft), name, link=link) if e.src not in skip]


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
            link: bool = False, show_progress: bool = False, handler: Path | None = None,
            extra_files: str | None = None, requirements_file: Path | None = None,
            runtime: str = "python", draft_checkpoint: Path | None = None) -> Path:
    """Validate, plan and write; returns the archive path in `out_dir`."""
    plan = plan_package(config_path, checkpoint, name, fmt, out_dir, force=force,
                        version=version, neuron_cache=neuron_cache, link=link, handler=handler,
                        extra_files=extra_files, requirements_file=requirements_file,
                        runtime=runtime, draft_checkpoint=draft_checkpoint)
    return execute(plan, show_progress=show_progress)


def _run(args: argparse.Namespace) -> int:
    plan = plan_package(Path(args.config), Path(args.checkpoint), args.name, args.format,
                        Path(args.out), force=args.force, version=args.version,
                        neuron_cache=Path(args.neuron_cache) if args.neuron_cache else None,
                        link=args.link, handler=Path(args.handler) if args.handler else None,
                        extra_files=args.extra_files, runtime=args.runtime,
                        requirements_file=Path(args.requirements_file)
                        if args.requirements_file else None,
                        draft_checkpoint=Path(args.draft_checkpoint)
                        if args.draft_checkpoint else None)
    print(plan.describe())
    if args.dry_run:
        print("dry run: nothing written")
        return 0
    target = execute(plan, show_progress=True)
    print(f"packaged {args.name} -> {target}")
    print(f"next: inf2serve serve --model-store {shlex.quote(str(target.parent))} --models "
          f"{shlex.quote(args.name)}")
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
        "--format no-archive --link --out /models --dry-run\n"
        "  inf2serve package --config llama.yaml --checkpoint ckpt --name llama "
        "--handler my_handler.py --extra-files prompts.json,utils/ --requirements-file r.txt\n"
        "  inf2serve package --config llama-spec.yaml --checkpoint /data/llama-8b "
        "--draft-checkpoint /data/llama-1b --name llama-spec --format no-archive",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="model-config.yaml")
    p.add_argument("--checkpoint", required=True, help="serving checkpoint directory")
    p.add_argument("--name", required=True, help="model name (archive name)")
    p.add_argument("--format", choices=list(FORMATS), default="mar",
                   help="mar (zip, deflate), tgz, zip-store (zip, no compression) or no-archive "
                   "(a folder: fastest to write and to load; best for large models); default mar")
    p.add_argument("--out", default="model_store",
                   help="model store directory (default model_store)")
    p.add_argument("--version", default="1.0", help="model version (the manifest's; "
                   "TorchServe serves it as /predictions/NAME/VERSION; default 1.0)")
    p.add_argument("--runtime", default="python", choices=RUNTIMES,
                   help="the manifest's runtime, as torch-model-archiver's (default python)")
    p.add_argument("--handler", metavar="FILE.py",
                   help="your handler: a .py file with one subclass of GenerationHandler "
                   "(override make_backend, serve_one, ...); it replaces the stock one")
    p.add_argument("--extra-files", metavar="A,B,...",
                   help="comma-separated files, folders or wildcards put at the top of the "
                   "archive (a folder's contents), as torch-model-archiver does")
    p.add_argument("--requirements-file", metavar="FILE",
                   help="pip requirements appended to the archive's requirements.txt; "
                   "TorchServe installs it only with install_py_dep_per_model=true "
                   "(`inf2serve serve --install-py-dep-per-model`)")
    p.add_argument("--draft-checkpoint", metavar="DIR",
                   help="speculative decoding's draft model checkpoint, packaged at "
                   "handler.neuron.speculation.draft_checkpoint (required when that is set)")
    p.add_argument("--neuron-cache", help="pre-compiled Neuron cache directory to include")
    p.add_argument("--link", action="store_true",
                   help="no-archive: hard-link checkpoint files instead of copying (same "
                   "filesystem; falls back to copying)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing archive of this name (after the new one is complete)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p.set_defaults(func=_run)
