"""The import graph of the shipped packages: no circles, and layers import downwards only.

Read from the source with `ast` (no third-party tool): every import counts -- at module
level, inside a function (lazy) and under TYPE_CHECKING -- because each is an arrow a
reader has to follow. `neuron_cache` (the compile cache) is the lowest layer, `handlers`
(the runtime inside every archive) sits on it, and `archive_tools` (the CLI) and `bench`
on both.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("neuron_cache", "handlers", "archive_tools")
#: (importer package, imported package) pairs that point upwards
FORBIDDEN = {("neuron_cache", "handlers"), ("neuron_cache", "archive_tools"),
             ("neuron_cache", "bench"), ("handlers", "archive_tools"), ("handlers", "bench")}


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py of the packages (a package is its
    __init__)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The known modules `name` imports, resolved to the deepest module named."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                anchor = name.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(root: Path = ROOT, packages: tuple[str, ...] = SHIPPED) -> dict[str, set[str]]:
    mods = modules(root, packages)
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if (a.split(".")[0], b.split(".")[0]) in FORBIDDEN)


#: the runtime's concerns, lowest first: each imports only those before it (and the shared
#: modules at the top of handlers/: config, errors, presets)
CONCERNS = ("handlers.structured", "handlers.backends", "handlers.engine", "handlers.api",
            "handlers.torchserve")
#: all that handlers.config may import of the runtime: the named presets it validates
#: (handlers/presets: data beneath config), the errors it raises and the strict YAML reader
#: of model-config.yaml (handlers/config_yaml.py: a key given twice)
BELOW_CONFIG = ("handlers.presets", "handlers.errors", "handlers.config_yaml")


def concern(module: str) -> str | None:
    return next((c for c in CONCERNS if module == c or module.startswith(c + ".")), None)


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def against_the_concerns(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for a, targets in edges.items():
        for b in targets:
            ca, cb = concern(a), concern(b)
            if ca and cb and CONCERNS.index(cb) > CONCERNS.index(ca):
                bad.append(f"{a} -> {b}")
            below = _within(a, ("handlers.config", *BELOW_CONFIG))
            if below and b.startswith("handlers") and not _within(b, BELOW_CONFIG):
                bad.append(f"{a} -> {b}")  # config (and what it reads) sits below every concern
    return sorted(bad)


def test_the_runtime_folders_are_layers() -> None:
    """handlers/structured turns a requested shape into token masks (below every backend
    that applies them), handlers/backends runs the model, handlers/engine schedules it,
    handlers/api turns HTTP into requests, handlers/torchserve adapts all of it to
    TorchServe: the folder tree is the architecture, and no arrow points up it.
    handlers.config, which every concern reads, reads none of them: the presets it checks
    names against live beneath it."""
    edges = graph()
    assert against_the_concerns(edges) == []
    assert {t for t in edges["handlers.config"] if t.startswith("handlers")} <= {
        "handlers.errors", "handlers.presets.chat_templates", "handlers.presets.synthetic_timing",
        "handlers.config_yaml"}


@pytest.mark.parametrize("target", ["handlers.api.chat_template",
                                    "handlers.backends.synthetic_backend",
                                    "handlers.engine.core", "handlers.checkpoint_checks"])
def test_config_importing_a_concern_is_caught(target: str) -> None:
    """The arrows config had (api/chat_template's presets, backends/synthetic_timing) are
    refused if they come back, and so is a preset module importing a concern."""
    edges = graph()
    for importer in ("handlers.config", "handlers.presets.chat_templates"):
        changed = {**edges, importer: edges[importer] | {target}}
        assert against_the_concerns(changed) == [f"{importer} -> {target}"]


def test_an_arrow_up_the_runtime_folders_is_caught() -> None:
    edges = graph()
    edges["handlers.engine.core"] = edges["handlers.engine.core"] | {"handlers.api.request"}
    assert against_the_concerns(edges) == ["handlers.engine.core -> handlers.api.request"]


def test_the_shipped_packages_have_no_import_circle() -> None:
    assert cycles(graph()) == []


def test_layers_import_downwards_only() -> None:
    edges = graph(ROOT, (*SHIPPED, "bench"))
    assert upward(edges) == []


def test_a_circle_added_back_is_caught() -> None:
    """The check is not vacuous: the routing split (handlers/api/routes.py) undone -- the native
    API importing the OpenAI one back -- is reported as a circle, and so is a three-module
    loop in a scratch tree."""
    edges = graph()
    assert "handlers.api.native" in edges["handlers.api.openai"]
    edges["handlers.api.native"] = edges["handlers.api.native"] | {"handlers.api.openai"}
    assert ["handlers.api.native", "handlers.api.openai"] in cycles(edges)


def test_a_lazy_or_type_checking_import_counts(tmp_path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg import c\n")
    (pkg / "c.py").write_text("def f():\n    from . import a\n")
    assert cycles(graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_an_import_pointing_up_is_caught(tmp_path) -> None:
    for package, body in (("neuron_cache", "from handlers.errors import ConfigError\n"),
                          ("handlers", "X = 1\n")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "m.py").write_text(body)
    (tmp_path / "handlers" / "errors.py").write_text("")
    assert upward(graph(tmp_path, ("neuron_cache", "handlers"))) == [
        "neuron_cache.m -> handlers.errors"]
