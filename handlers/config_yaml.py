"""model-config.yaml read strictly: `yaml.safe_load`, but a key given twice is refused.

YAML lets a mapping repeat a key and keeps the last value (PyYAML, and SnakeYAML in
TorchServe's frontend, whose LoaderOptions allow duplicates by default), so `batch_size: 8`
then `batch_size: 2` silently serves 2. Packaging, `validate` and the worker's start read
the file through here and refuse it with the key's path and both line numbers. The check
walks the composed node tree (no Python objects are built twice); a merge key (`<<: *base`)
is not a duplicate of the keys it brings in, which a mapping may override.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from handlers.errors import ConfigError

MERGE_TAG = "tag:yaml.org,2002:merge"


def duplicate_keys(text: str) -> list[tuple[str, int, int]]:
    """(dotted key, first line, repeated line) of every key a mapping gives twice (1-based
    lines, in document order)."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    found: list[tuple[str, int, int]] = []
    seen_nodes: set[int] = set()  # an alias reuses a node: walk it once

    def walk(node: yaml.Node | None, path: str) -> None:
        if node is None or id(node) in seen_nodes:
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if key.tag == MERGE_TAG:
                    continue
                name = key.value if isinstance(key, yaml.ScalarNode) else None
                child = f"{path}.{name}" if path and name is not None else (name or path)
                if name is not None:
                    line = key.start_mark.line + 1
                    if (key.tag, name) in first:
                        found.append((child, first[(key.tag, name)], line))
                    else:
                        first[(key.tag, name)] = line
                walk(value, child or path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{path}[{i}]")

    walk(root, "")
    return found


def check_duplicates(text: str, where: str | Path) -> None:
    """ConfigError naming the first key given twice, with both lines; nothing otherwise."""
    dups = duplicate_keys(text)
    if dups:
        key, first, again = dups[0]
        more = f" (and {len(dups) - 1} more key(s) given twice)" if len(dups) > 1 else ""
        raise ConfigError(f"{where}: {key} is given twice, at line {first} and line {again}"
                          f"{more}; YAML would silently keep the last one: remove one of them")


def load_yaml(text: str, where: str | Path) -> Any:
    """`yaml.safe_load(text)`, refusing a key given twice; YAMLError passes through."""
    data = yaml.safe_load(text)
    check_duplicates(text, where)
    return data
