"""GrammarSpec -> compiled grammar, off the step loop, bounded in time, size and count.

The engine is llguidance (docs/structured_outputs.md says why: mask time, compile time,
no dependencies, one abi3 wheel for Python 3.10+). Compiling has two parts: the JSON
Schema or Lark text becomes llguidance's grammar (`grammar_text`, pure and cheap), and an
`LLMatcher` built from it and the model's tokenizer (the lexer over the vocabulary: up
to hundreds of ms for a large schema). The compiled matcher is kept as a template per
(spec, tokenizer) in a bounded LRU; each request gets a `deep_copy` (tens of us).

Bounds (what a client can make the server spend):
- the schema's size and depth, by the request parser (handlers/structured/spec.py);
- the work itself, by llguidance's parser limits (`LIMITS`: lexer fuel, grammar size,
  lexer states), which end a compile with an error rather than a long run;
- the wait: `compile()` runs on the compiler's own threads (llguidance releases the GIL
  while it builds) and a caller waits at most `timeout_s`; a compile past it is refused
  (the thread still ends within the fuel bound, and its result is then cached);
- the cache: at most `max_entries` templates, least recently used dropped first.

The tokenizer conversion (`grammar_tokenizer`) walks the whole vocabulary once per
model (seconds at 128k entries), so it runs on the compiler's thread too, started at
load, never on the step loop.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from handlers.errors import RequestError
from handlers.structured.spec import JSON_OBJECT, JSON_SCHEMA, TOOL_CALLS, GrammarSpec

logger = logging.getLogger(__name__)

#: how long a request waits for its grammar before a 400
COMPILE_TIMEOUT_S = 10.0
#: compiled templates kept per compiler (one compiler per loaded model)
MAX_ENTRIES = 256
#: llguidance's parser limits, tighter than its defaults where a client sends the grammar:
#: lexer fuel (~50k/ms) bounds a compile's regex work to ~2 s, the grammar to 200k symbols
LIMIT_ARGS = {"initial_lexer_fuel": 100_000_000, "max_grammar_size": 200_000,
              "max_lexer_states": 100_000, "step_lexer_fuel": 200_000,
              "step_max_items": 50_000, "verbose_errors": False}
#: JSON written without whitespace between tokens: with whitespace allowed a weak model
#: can emit newlines forever (vLLM's --disable-any-whitespace exists for that), and every
#: client parses compact JSON
JSON_OPTIONS = {"whitespace_flexible": False}


def limits() -> Any:
    import llguidance

    return llguidance.LLParserLimits(**LIMIT_ARGS)


def grammar_tokenizer(hf_tokenizer: Any, vocab_size: int,
                      eos_ids: list[int] | None = None) -> Any:
    """The model's tokenizer as llguidance sees it: every token's bytes, over `vocab_size`
    ids (the logits' width, which may exceed the tokenizer's; the extra ids are never
    allowed). A fast (tokenizers-backed) tokenizer is needed, as in transformers 4.36+ for
    Llama; its tokenizer.json is read by llguidance's own Rust tokenizers, so the same
    conversion serves transformers 4.x and 5.x. `eos_ids`: every id that ends a sequence
    (Llama 3's eot and end_of_text), allowed wherever the grammar is complete."""
    from llguidance.hf import from_tokenizer

    if not eos_ids:
        return from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
    try:
        return from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
    except TypeError:  # llguidance < 1.7 (what glibc < 2.31 gets) takes one EOS id
        return from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_ids[0])


def grammar_text(spec: GrammarSpec, special: Mapping[str, int] | None = None) -> str:
    """llguidance's grammar for a spec (`special`: the tokenizer's special tokens by text,
    which a tool-call format may name)."""
    import llguidance

    # strict: every keyword enforced or a 400; otherwise the rest approximated (unknown
    # keywords ignored, oneOf as anyOf), as OpenAI's non-strict mode promises no more
    strict = {"lenient": not spec.strict, "coerce_one_of": not spec.strict}
    if spec.kind == JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults={**JSON_OPTIONS, **strict})
    if spec.kind == JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(
            spec.schema, defaults={**JSON_OPTIONS, **strict})
    if spec.kind == TOOL_CALLS:
        return llguidance.LLMatcher.grammar_from_lark(tool_call_lark(spec, special))
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


def tool_call_schema(spec: GrammarSpec) -> dict[str, Any]:
    """One call of any of the spec's functions: {name_key: const name, args_key: its
    parameters}, the name first (properties in schema order)."""
    fmt = spec.tool_format
    calls, defs = [], {}
    for i, (name, params) in enumerate(json.loads(spec.schema)):
        if _local_refs(params):
            # its "#/..." pointers would resolve against the call's root, not its parameters:
            # its definitions move to the root's $defs under names of their own, and its
            # pointers follow them (pydantic's nested models, as Instructor and LangChain
            # send them, are "#/$defs/Model"; SchemaStore's "#/definitions/x")
            params, moved = _hoisted(params, f"inf2serve_{i}")
            defs.update(moved)
        calls.append({"type": "object", "additionalProperties": False,
                      "properties": {fmt.name_key: {"const": name}, fmt.args_key: params},
                      "required": [fmt.name_key, fmt.args_key]})
    out = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**out, "$defs": defs} if defs else out


def _local_refs(node: Any) -> bool:
    """Whether a schema holds a "$ref" to a JSON pointer within its own document."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return True
        return any(_local_refs(v) for v in node.values())
    if isinstance(node, list):
        return any(_local_refs(v) for v in node)
    return False


def _hoisted(params: dict, prefix: str) -> tuple[dict, dict]:
    """(params without its $defs / definitions, those as root $defs entries named
    prefix_$defs_name / prefix_definitions_name), every "#..." pointer rewritten to them;
    a pointer anywhere else in params ("#", "#/properties/...") to a root copy of it."""
    # its $id would make its pointers resolve against it again; $schema only names a draft
    params = {k: v for k, v in params.items() if k not in ("$id", "$schema")}
    own = {group: params.pop(group) for group in ("$defs", "definitions")
           if isinstance(params.get(group), dict)}
    whole = f"{prefix}_root"

    def target(ref: str) -> str:
        parts = ref[1:].split("/")
        if len(parts) >= 3 and parts[0] == "" and parts[1] in own:
            name = f"{prefix}_{parts[1]}_{parts[2]}"
            return "/".join(["#", "$defs", name, *parts[3:]])
        return f"#/$defs/{whole}{ref[1:]}"

    def repoint(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: repoint(v) for k, v in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                out["$ref"] = target(ref)
            return out
        if isinstance(node, list):
            return [repoint(v) for v in node]
        return node

    moved = {f"{prefix}_{group}_{name}": repoint(schema)
             for group, entries in own.items() for name, schema in entries.items()}
    params = repoint(params)
    if _points_to([params, *moved.values()], f"#/$defs/{whole}"):
        moved[whole] = params
    return params, moved


def _points_to(node: Any, base: str) -> bool:
    """Whether a schema holds a "$ref" starting with `base`."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(base):
            return True
        return any(_points_to(v, base) for v in node.values())
    if isinstance(node, list):
        return any(_points_to(v, base) for v in node)
    return False


def tool_call_lark(spec: GrammarSpec, special: Mapping[str, int] | None = None) -> str:
    """Lark text: the thinking the prompt leaves room for, the family's opening, one call or
    one or more joined by its separator, its closing. `special`: the tokenizer's special
    tokens by text, which a literal never matches in llguidance, so the format's text that
    is one of them is written as that token (`<[id]>`)."""
    fmt = spec.tool_format

    def lit(text: str) -> str:
        return _literal(text, special or {})

    options = {**JSON_OPTIONS, "lenient": not spec.strict, "coerce_one_of": not spec.strict}
    if fmt.args_marker is None:  # each call one JSON object
        body = json.dumps({**tool_call_schema(spec), "x-guidance": options})
        call = _seq(lit(fmt.prefix), f"%json {body}", lit(fmt.suffix))
    else:  # name, marker, arguments object: one alternative per function
        calls = [_seq(json.dumps(name), lit(fmt.args_marker),
                      f"%json {json.dumps({**params, 'x-guidance': options})}")
                 for name, params in json.loads(spec.schema)]
        call = _seq(lit(fmt.prefix), f"({' | '.join(calls)})", lit(fmt.suffix))
    if fmt.separator is None:
        calls_rule = "call"
    elif fmt.separator == "":
        calls_rule = "call+"
    else:
        calls_rule = f"call ({lit(fmt.separator)} call)*"
    think = {"inside": "think BLANKS",
             "auto": f"({lit(THINK)} think BLANKS)?"}.get(fmt.reasoning or "", "")
    rules = [f"start: {_seq(think, lit(fmt.start), calls_rule, lit(fmt.end))}",
             f"call: {call}"]
    if think:  # any text, ended by the first </think> (lazy: the shortest match)
        rules += ["think[lazy]: /(?s:.*)<\\/think>/", "BLANKS: /[ \\t\\r\\n]*/"]
    return "\n".join(rules) + "\n"


THINK = "<think>"


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _literal(text: str, special: Mapping[str, int]) -> str:
    """`text` as Lark: string literals, and `<[id]>` for each special token's text in it."""
    parts, plain, at = [], "", 0
    names = sorted((n for n in special if n and n in text), key=len, reverse=True)
    while at < len(text):
        name = next((n for n in names if text.startswith(n, at)), None)
        if name is None:
            plain += text[at]
            at += 1
            continue
        if plain:
            parts.append(json.dumps(plain))
            plain = ""
        parts.append(f"<[{special[name]}]>")
        at += len(name)
    if plain:
        parts.append(json.dumps(plain))
    return " ".join(parts)


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """The llguidance tokenizer's special tokens by text (Mistral's [TOOL_CALLS], ...)."""
    out = {}
    for i in range(tokenizer.vocab_size):
        if tokenizer.is_special_token(i):
            name = tokenizer.decode_bytes([i]).decode("utf-8", "replace")
            if len(name) > 1:
                out.setdefault(name, i)
    return out


@dataclass
class Compiled:
    """A compiled grammar for one tokenizer: `matcher()` hands out a fresh matcher."""

    spec_key: str
    template: Any  # llguidance.LLMatcher in its start state
    seconds: float  # the compile's wall time

    def matcher(self) -> Any:
        return self.template.deep_copy()


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer on its own threads, with a bounded cache.

    `tokenizer` is a callable returning the llguidance tokenizer (built on first use, on a
    compiler thread; `start()` begins it at load)."""

    def __init__(self, tokenizer: Callable[[], Any], max_entries: int = MAX_ENTRIES,
                 timeout_s: float = COMPILE_TIMEOUT_S, threads: int = 2) -> None:
        self._make_tokenizer = tokenizer
        self._tokenizer: Future | None = None
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="inf2serve-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._special: dict[str, int] | None = None
        self.max_entries = max_entries
        self.timeout_s = timeout_s

    def start(self) -> None:
        """Begin converting the tokenizer (seconds for a large vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(self._make_tokenizer)

    def tokenizer(self) -> Any:
        self.start()
        return self._tokenizer.result()

    def ready(self) -> Future:
        """The tokenizer conversion, begun if it was not: compiles wait for it, and their
        time bound starts once it is done (it is the model's, not the request's)."""
        self.start()
        return self._tokenizer

    def submit(self, spec: GrammarSpec) -> Future:
        """A future of the Compiled grammar (cached, or compiling now). Its exception is a
        RequestError naming the spec's field."""
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f, key=spec.key: self._drop_failed(key, f))
        return future

    def compile(self, spec: GrammarSpec) -> Compiled:
        """Wait (at most timeout_s) for the spec's grammar; a RequestError naming its field
        when it cannot be compiled or takes too long. Never call from the step loop."""
        future = self.submit(spec)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise RequestError(spec.field, f"the grammar took longer than {self.timeout_s:g} s "
                               "to compile; simplify the schema") from None

    def _drop_failed(self, key: str, future: Future) -> None:
        """A failed compile is not cached: the same schema fails the same way, but quickly,
        and keeping errors would let a client fill the cache with them."""
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compile(self, spec: GrammarSpec) -> Compiled:
        import llguidance

        start = time.perf_counter()
        tokenizer = self.tokenizer()
        special = self._special_tokens(tokenizer) if spec.kind == TOOL_CALLS else None
        try:
            text = grammar_text(spec, special)
        except ValueError as exc:  # not a JSON object, which spec.py already rules out
            raise RequestError(spec.field, f"not a JSON schema: {exc}") from exc
        bounds = limits()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, tokenizer, limits=bounds)
        if failed:
            raise RequestError(spec.field, reason(messages[0], spec.strict))
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=bounds)
        if matcher.is_error():
            raise RequestError(spec.field, reason(matcher.get_error(), spec.strict))
        seconds = time.perf_counter() - start
        logger.info("compiled a %s grammar in %.3f s", spec.kind, seconds)
        return Compiled(spec.key, matcher, seconds)

    def _special_tokens(self, tokenizer: Any) -> dict[str, int]:
        with self._lock:  # one scan of the vocabulary per model (~30 ms at 150k tokens)
            if self._special is None:
                self._special = special_tokens(tokenizer)
            return self._special

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def reason(error: str, strict: bool) -> str:
    """llguidance's message, first line, bounded; with the way out where strict decides."""
    first = error.strip().splitlines()[0] if error.strip() else "grammar error"
    first = first.removeprefix("Error: ").strip()
    if len(first) > 200:
        first = first[:200] + "..."
    if strict and any(w in first for w in ("Unimplemented", "not supported", "Unknown format")):
        return (f"{first}; with strict: true every keyword must be enforced -- "
                "send strict: false to have the rest approximated")
    return first
