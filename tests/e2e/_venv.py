"""A virtualenv with torchserve, torch and transformers but not inf2serve.

It proves an archive is self-contained: the worker imports our runtime from the
archive (runtime/ inside it), never from an installed toolkit.

Default ("link", about a second): `python -m venv --without-pip`, then a .pth in its
site-packages pointing at ONE directory of symlinks to exactly the distributions
torchserve, torch, transformers, tokenizers, safetensors, pyyaml and prometheus-client
(the workers' metrics, which the base image has with the toolkit) need (their
requirement closure, resolved from this interpreter's installed metadata, dist-info
included so version checks work). inf2serve and everything else are absent.
INF2SERVE_E2E_VENV=pip instead pip-installs the same pins (slow; from the local
wheel cache/index the machine's pip config points at, CPU torch only).

Given a transformers 4.x overlay (tests/overlays.py), the closure is resolved with the
overlay's distributions first, as PYTHONPATH would import them: the venv then holds the
overlay's transformers, tokenizers and huggingface_hub and this interpreter's torch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOTS = ("torchserve", "torch", "transformers", "tokenizers", "safetensors", "pyyaml",
         "prometheus-client")
PIP_PINS = ("torch==2.13.0+cpu", "transformers==5.23.0", "tokenizers==0.23.3", "safetensors",
            "torchserve==0.12.0", "pyyaml", "prometheus-client")
EXCLUDED = {"inf2serve", "torch-model-archiver"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(roots: tuple[str, ...] = ROOTS,
                        overlay: Path | None = None) -> list[metadata.Distribution]:
    """Installed distributions needed by `roots` (markers evaluated, extras ignored).

    A name installed twice resolves to the first on the path (`overlay`, then sys.path),
    as the import system would pick it.
    """
    from packaging.requirements import Requirement

    path = ([str(overlay)] if overlay else []) + sys.path
    installed: dict[str, metadata.Distribution] = {}
    for d in metadata.distributions(path=path):
        installed.setdefault(_norm(d.metadata["Name"]), d)
    todo, seen = [_norm(r) for r in roots], {}
    while todo:
        name = todo.pop()
        if name in seen or name in EXCLUDED or name not in installed:
            continue
        dist = seen[name] = installed[name]
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_norm(req.name))
    return list(seen.values())


def _top_levels(dist: metadata.Distribution) -> set[str]:
    """Top-level names a distribution installs into site-packages (packages, modules, dist-info)."""
    out = set()
    for f in dist.files or []:
        first = f.parts[0]
        if first in ("..", "__pycache__") or first.endswith(".pth"):
            continue
        out.add(first)
    return out


def make_link_venv(dest: Path, overlay: Path | None = None,
                   roots: tuple[str, ...] = ROOTS) -> Path:
    """Venv whose only third-party packages are symlinks to the closure; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    py = dest / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True,
                               text=True).stdout.strip())
    deps = dest / "deps"
    deps.mkdir()
    for dist in requirement_closure(roots, overlay):
        root = Path(dist.locate_file(""))
        for name in _top_levels(dist):
            src = root / name
            if src.exists() and not (deps / name).exists():
                (deps / name).symlink_to(src)
    (site / "e2e_deps.pth").write_text(f"{deps}\n")
    _console_script(dest, "torchserve", "ts.model_server", "start")
    return py


def _console_script(venv: Path, name: str, module: str, func: str) -> None:
    script = venv / "bin" / name
    script.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom {module} import {func}\n"
                      f"sys.exit({func}())\n")
    script.chmod(0o755)


def make_pip_venv(dest: Path, overlay: Path | None = None) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(dest)], check=True)
    py = dest / "bin" / "python"
    pins = list(PIP_PINS)
    if overlay is not None:  # the overlay's versions instead of ours
        found = {_norm(d.metadata["Name"]): d.version
                 for d in metadata.distributions(path=[str(overlay)])}
        pins = [p for p in pins if _norm(re.split(r"[=<>]", p)[0]) not in found]
        pins += [f"{name}=={version}" for name, version in sorted(found.items())]
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--only-binary=:all:", *pins],
                   check=True)
    return py


def make_serving_venv(dest: Path, overlay: Path | None = None,
                      roots: tuple[str, ...] = ROOTS) -> Path:
    """The serving venv's python (kind chosen by $INF2SERVE_E2E_VENV: link or pip)."""
    kind = os.environ.get("INF2SERVE_E2E_VENV", "link")
    if kind == "pip":
        return make_pip_venv(dest, overlay)
    return make_link_venv(dest, overlay, roots)


def importable(python: Path, module: str, cwd: Path) -> bool:
    """Whether `module` imports in that interpreter, run from a neutral cwd, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    r = subprocess.run([str(python), "-c", f"import {module}"], cwd=cwd, env=env,
                       capture_output=True)
    return r.returncode == 0
