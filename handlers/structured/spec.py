"""What a request asks the answer to look like, read and checked once: a `GrammarSpec`.

OpenAI's `response_format` (`{"type": "json_object"}` or `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`) and a forced tool call (`tool_choice:
"required"` or a named function, over the request's `tools`) both become one frozen
`GrammarSpec`: plain data that crosses the engine-process pipe and is the key of the
compiled-grammar cache. Nothing here imports the grammar engine, so the API side can
refuse a malformed field with a 400 naming it before any grammar work, and a request
without these fields never reaches this package.

The bounds are here because they are the request's: a schema past MAX_SCHEMA_BYTES (as
canonical JSON) or nested deeper than MAX_SCHEMA_DEPTH is refused by name before the
engine sees it; what the engine itself may spend on a compile is bounded in
`handlers/structured/compiler.py`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from handlers.errors import RequestError

#: the largest schema (canonical JSON, bytes) a request may send; OpenAI's own limits are
#: 5000 properties and 1000 enum values at 10 levels, far under this
MAX_SCHEMA_BYTES = 256 * 1024
#: nesting of JSON containers in a schema (a schema, not a document: 10 levels are OpenAI's)
MAX_SCHEMA_DEPTH = 64
#: OpenAI's rule for response_format.json_schema.name and function names
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
JSON_OBJECT, JSON_SCHEMA, TOOL_CALLS = "json_object", "json_schema", "tool_calls"
FORMAT_TYPES = ("text", JSON_OBJECT, JSON_SCHEMA)


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes tool calls, the one statement of it that both the grammar
    forcing a call and the tests' scripted answers are built from: `start`, then each call
    as `prefix + {"<name_key>": "<name>", "<args_key>": {...}} + suffix` -- or, with an
    `args_marker`, as `prefix + name + args_marker + {...} + suffix` --, calls joined by
    `separator` (None: one call only), then `end`. Llama 3.1's JSON format is the default;
    Qwen's is `<tool_call>` tags around each call, Mistral v0.3's one `[TOOL_CALLS] [...]`
    list, Mistral v11's `[TOOL_CALLS]name[ARGS]{...}` per call. Text that is a special
    token of the model's tokenizer (Mistral's `[TOOL_CALLS]`, `[ARGS]`) is forced as that
    token, as the model writes it.

    `reasoning` is the request's, not the family's: where a thinking template's answer
    starts (handlers/api/reasoning.py): "inside" its reasoning (any text up to `</think>`
    comes before the calls), "auto" (an optional `<think>...</think>` block may), or None
    (the calls come first) -- the model thinks before it is held to the calls, as vLLM
    applies a grammar only after the reasoning ends."""

    name_key: str = "name"
    args_key: str = "parameters"
    prefix: str = ""
    suffix: str = ""
    separator: str | None = None
    start: str = ""
    end: str = ""
    args_marker: str | None = None
    reasoning: str | None = None

    def render(self, calls: Sequence[Any]) -> str:
        """The answer text of a model calling `calls` (each with .name and .arguments)."""
        def one(c: Any) -> str:
            if self.args_marker is not None:
                return c.name + self.args_marker + json.dumps(c.arguments, ensure_ascii=False)
            return json.dumps({self.name_key: c.name, self.args_key: c.arguments},
                              ensure_ascii=False)

        body = (self.separator or "").join(self.prefix + one(c) + self.suffix for c in calls)
        return self.start + body + self.end


@dataclass(frozen=True)
class GrammarSpec:
    """One request's constraint. `schema` is canonical JSON text (sorted keys, no spaces)
    so equal schemas share a cache entry; for TOOL_CALLS it is the JSON list of
    (name, parameters) pairs. `field` is what a 400 about it names."""

    kind: str
    schema: str = ""
    strict: bool = False
    name: str = ""
    field: str = "response_format"
    tool_format: ToolCallFormat | None = None

    @property
    def key(self) -> str:
        """A digest of everything that decides the grammar (not the error field)."""
        text = json.dumps([self.kind, self.schema, self.strict,
                           None if self.tool_format is None else vars(self.tool_format)],
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


def brief(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def canonical(schema: Any, field: str) -> str:
    """The schema as canonical JSON text, refused by name past the size or depth bound."""
    _check_depth(schema, field)
    try:
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise RequestError(field, f"not a JSON schema: {exc}") from exc
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise RequestError(field, f"schema of {len(text.encode()):,} bytes; at most "
                           f"{MAX_SCHEMA_BYTES:,} are accepted")
    return text


def _check_depth(value: Any, field: str) -> None:
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise RequestError(field, f"schema nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, Mapping):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def response_format(value: Any, field: str = "response_format") -> GrammarSpec | None:
    """`response_format` of a chat or completions request (or the native API's field of
    the same shape) -> a GrammarSpec, or None for none / `{"type": "text"}`."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise RequestError(field, f"expected an object such as {{\"type\": \"json_object\"}}, "
                           f"got {brief(value)}")
    kind = value.get("type")
    if kind not in FORMAT_TYPES:
        raise RequestError(f"{field}.type", f"expected one of {', '.join(FORMAT_TYPES)}, "
                           f"got {brief(kind)}")
    unknown = sorted(set(value) - {"type", JSON_SCHEMA})
    if unknown:
        raise RequestError(field, f"unknown key {brief(unknown[0])}; allowed: type, json_schema")
    if kind == "text":
        return None
    if kind == JSON_OBJECT:
        return GrammarSpec(JSON_OBJECT, field=field)
    sub = f"{field}.json_schema"
    js = value.get(JSON_SCHEMA)
    if not isinstance(js, Mapping):
        raise RequestError(sub, f"expected an object with name and schema, got {brief(js)}")
    unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
    if unknown:
        raise RequestError(sub, f"unknown key {brief(unknown[0])}; allowed: name, schema, "
                           "strict, description")
    name = js.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise RequestError(f"{sub}.name", "expected 1 to 64 letters, digits, _ or -, got "
                           f"{brief(name)}")
    strict = js.get("strict", False)
    if strict is None:
        strict = False
    if not isinstance(strict, bool):
        raise RequestError(f"{sub}.strict", f"expected true or false, got {brief(strict)}")
    schema = js.get("schema", {})
    if not isinstance(schema, Mapping):
        raise RequestError(f"{sub}.schema", f"expected a JSON Schema object, got {brief(schema)}")
    return GrammarSpec(JSON_SCHEMA, canonical(schema, f"{sub}.schema"), strict, name, sub)


def forced_tool_call(tools: Sequence[Mapping[str, Any]], choice: str | None,
                     tool_format: ToolCallFormat = ToolCallFormat(),
                     field: str = "tool_choice") -> GrammarSpec:
    """A grammar forcing calls of `tools` (OpenAI's `tools` list, already checked by the
    API): every listed function for `tool_choice: "required"` (choice None), or the one
    named. A function without `parameters` takes an empty object, as OpenAI's does."""
    pairs, strict = [], False
    for tool in tools:
        fn = tool.get("function", {})
        if choice is not None and fn.get("name") != choice:
            continue
        pairs.append((fn.get("name"), fn.get("parameters") or {"type": "object",
                                                              "properties": {}}))
        strict = strict or fn.get("strict") is True  # OpenAI's per-function strict
    if not pairs:
        raise RequestError(field, f"names no function of tools: {brief(choice)}")
    return GrammarSpec(TOOL_CALLS, canonical(pairs, "tools"), strict, choice or "", field,
                       tool_format)
