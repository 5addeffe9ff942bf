"""The grammar layer (handlers/structured): request fields -> GrammarSpec -> compiled
grammar -> masks, over the corpus of real schemas, with the demo model's tokenizer."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import jsonschema
import numpy as np
import pytest

from archive_tools.demo_model import SIZES, build_tokenizer
from handlers.api.tool_parsers.hermes import HermesParser
from handlers.api.tool_parsers.llama3_json import Llama3JsonParser
from handlers.api.tool_parsers.mistral import MistralArgsParser, MistralParser
from handlers.errors import RequestError
from handlers.structured import spec as specs
from handlers.structured.compiler import GrammarCompiler, grammar_tokenizer
from handlers.structured.masks import RowGrammar, allowed, apply_bitmask
from tests.structured_walk import (
    corpus,
    corpus_tools,
    finished_answers,
    schema_spec,
    stand_in,
    walk,
)

CORPUS = corpus()
FUNCTIONS, TOOLS = corpus_tools()
WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return build_tokenizer(SIZES["tiny"], seed=0)


@pytest.fixture(scope="module")
def stand_in_model(hf_tokenizer):
    compiler, model = stand_in(hf_tokenizer)
    yield compiler, model
    compiler.close()


@pytest.fixture(scope="module")
def compiler(stand_in_model):
    return stand_in_model[0]


@pytest.fixture(scope="module")
def model(stand_in_model):
    return stand_in_model[1]


# -- request fields ------------------------------------------------------------------------
def test_text_and_absent_formats_ask_for_no_grammar() -> None:
    assert specs.response_format(None) is None
    assert specs.response_format({"type": "text"}) is None


@pytest.mark.parametrize("value, field, words", [
    ("json", "response_format", "expected an object"),
    ({"type": "xml"}, "response_format.type", "json_object, json_schema"),
    ({"type": "json_schema"}, "response_format.json_schema", "name and schema"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
     "response_format.json_schema.name", "letters, digits"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": [], "strict": True}},
     "response_format.json_schema.schema", "JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict", "true or false"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}},
     "response_format.json_schema", "unknown key"),
    ({"type": "json_object", "schema": {}}, "response_format", "unknown key"),
])
def test_a_malformed_response_format_names_the_field(value, field, words) -> None:
    with pytest.raises(RequestError) as info:
        specs.response_format(value)
    assert info.value.field == field and words in info.value.message


def test_a_schema_past_the_size_or_depth_bound_is_refused_before_compiling() -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 90}
                                            for i in range(specs.MAX_SCHEMA_BYTES // 100)}}
    deep: dict = {"type": "string"}
    for _ in range(specs.MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    for schema, words in ((big, "bytes"), (deep, "deeper")):
        with pytest.raises(RequestError) as info:
            schema_spec(schema)
        assert info.value.field == "response_format.json_schema.schema"
        assert words in info.value.message


def test_equal_schemas_share_a_key_whatever_their_key_order() -> None:
    a = schema_spec({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = schema_spec({"properties": {"x": {"type": "integer"}}, "type": "object"})
    assert a.key == b.key != schema_spec({"type": "object"}).key
    assert schema_spec({"type": "object"}, strict=False).key != schema_spec({"type": "object"}).key


# -- the corpus through the grammar ------------------------------------------------------
def test_the_corpus_is_large_real_and_sourced() -> None:
    entries = CORPUS["schemas"]
    assert len(entries) >= 50
    assert len({e["id"] for e in entries}) == len(entries)
    for e in entries + CORPUS["unsupported"]:
        assert e["source"].startswith("github.com/") and "@" in e["source"], e["id"]
        # a valid schema of its draft (regex formats unchecked: the sources use ECMA-262
        # named groups, (?<name>...), which Python's re spells (?P<name>...))
        validator = jsonschema.validators.validator_for(e["schema"])
        validator.check_schema(e["schema"], format_checker=None)


@pytest.mark.parametrize("name", ["openai-cookbook/math_reasoning", "bfcl/uber.eat.order",
                                  "schemastore/kind-cluster"])
def test_nested_corpus_schemas_give_valid_answers(compiler, model, name) -> None:
    """A few of the corpus here (this file also runs under transformers 4.x and Python 3.10);
    all of it in test_structured_corpus.py."""
    entry = next(e for e in CORPUS["schemas"] if e["id"] == name)
    texts = finished_answers(compiler, model, schema_spec(entry["schema"]), seeds=(0, 1))
    assert texts
    for text in texts:
        jsonschema.validate(json.loads(text), entry["schema"])


def test_json_object_gives_a_json_object(compiler, model) -> None:
    texts = finished_answers(compiler, model, specs.response_format({"type": "json_object"}),
                             seeds=range(4))
    assert texts
    assert all(isinstance(json.loads(t), dict) for t in texts)


def test_required_calls_one_or_more_listed_functions(compiler, model) -> None:
    fmt = specs.ToolCallFormat(prefix="<call>", suffix="</call>", separator="\n")
    by_name = {e["name"]: e["schema"] for e in FUNCTIONS}
    texts = finished_answers(compiler, model, specs.forced_tool_call(TOOLS, None, fmt),
                             seeds=range(6))
    assert texts
    for text in texts:
        parts = text.split("\n")
        for part in parts:
            assert part.startswith("<call>") and part.endswith("</call>")
            call = json.loads(part.removeprefix("<call>").removesuffix("</call>"))
            jsonschema.validate(call["parameters"], by_name[call["name"]])


#: the corpus' three smallest function schemas
SMALL_TOOLS = sorted(TOOLS, key=lambda t: len(json.dumps(t["function"]["parameters"])))[:3]


@pytest.fixture(scope="module")
def family_model():
    """The demo tokenizer with Mistral's control tokens as special tokens and Qwen's tags as
    added ones that are not special, as their tokenizers have them."""
    tok = build_tokenizer(SIZES["tiny"], seed=0)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    compiler, model = stand_in(tok)
    yield tok, compiler, model
    compiler.close()


@pytest.mark.parametrize("parser", [HermesParser(), MistralParser(), MistralArgsParser(),
                                    Llama3JsonParser()], ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("named", [False, True])
def test_forced_calls_are_written_in_the_family_format(family_model, parser, named) -> None:
    """`required` (or a named function) in Qwen's, Mistral's and Llama's formats: each
    finished answer is calls its parser reads back -- as the model wrote it and as the
    server decodes it, without special tokens --, of the offered functions, with valid
    arguments; Mistral's control tokens are written as the special tokens they are."""
    tok, compiler, (masks, bias, eos) = family_model
    fmt = parser.grammar if not named else replace(parser.grammar, separator=None)
    choice = SMALL_TOOLS[0]["function"]["name"] if named else None
    compiled = compiler.compile(specs.forced_tool_call(SMALL_TOOLS, choice, fmt))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in SMALL_TOOLS}
    finished = 0
    for seed in range(3):
        tokens, done = walk(RowGrammar(compiled.matcher()), masks, bias, eos,
                            np.random.default_rng(seed))
        if not done:
            continue
        finished += 1
        tokens = [t for t in tokens if t not in eos]
        for text in (compiler.tokenizer().decode_str(tokens),
                     tok.decode(tokens, skip_special_tokens=True)):
            calls = parser.parse(text)
            assert calls, text
            assert not named or [c.name for c in calls] == [choice]
            for call in calls:
                jsonschema.validate(call.arguments, schemas[call.name])
        if isinstance(parser, (MistralParser, MistralArgsParser)):
            assert tok.convert_tokens_to_ids("[TOOL_CALLS]") in tokens
    assert finished


@pytest.mark.parametrize("reasoning, thought, ok", [
    ("inside", "Paris, then. </think>", True), ("auto", "<think>Paris.</think>\n", True),
    ("auto", "", True), (None, "<think>Paris.</think>", False),
    ("inside", "", False)])  # inside the reasoning, only </think> leaves it
def test_a_forced_call_may_follow_the_thinking_the_prompt_leaves_room_for(
        family_model, reasoning, thought, ok) -> None:
    _, compiler, _ = family_model
    fmt = replace(HermesParser.grammar, reasoning=reasoning)
    matcher = compiler.compile(specs.forced_tool_call(WEATHER_TOOL, None, fmt)).matcher()
    text = thought + ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n'
                      '</tool_call>')
    assert HermesParser().parse(text.rpartition("</think>")[2])  # a call, in compact JSON
    accepted = matcher.consume_tokens(compiler.tokenizer().tokenize_str(text))
    assert (accepted and matcher.is_accepting()) == ok


def test_forcing_a_function_not_listed_names_tool_choice() -> None:
    with pytest.raises(RequestError) as info:
        specs.forced_tool_call(TOOLS, "no_such_function")
    assert info.value.field == "tool_choice"


# -- what the engine cannot do exactly -----------------------------------------------------
@pytest.mark.parametrize("entry", CORPUS["unsupported"], ids=lambda e: e["id"])
def test_strict_with_a_schema_the_engine_would_approximate_is_a_400(compiler, entry) -> None:
    with pytest.raises(RequestError) as info:
        compiler.compile(schema_spec(entry["schema"], strict=True))
    assert info.value.field == "response_format.json_schema"
    assert info.value.message and "\n" not in info.value.message
    assert len(info.value.message) < 400  # the reason, not the grammar


def test_without_strict_unsupported_keywords_are_approximated(compiler, model) -> None:
    entry = next(e for e in CORPUS["unsupported"] if "uniqueItems" in e["strict_error"])
    compiler.compile(schema_spec(entry["schema"], strict=False))  # compiles
    with pytest.raises(RequestError) as info:
        compiler.compile(schema_spec(entry["schema"], strict=True))
    assert "strict: false" in info.value.message


def test_a_remote_ref_is_refused_never_fetched(compiler) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "https://example.invalid/x.json"}}}
    with pytest.raises(RequestError) as info:
        compiler.compile(schema_spec(schema, strict=False))
    assert "not present" in info.value.message or "retriev" in info.value.message


def test_an_invalid_schema_names_the_field(compiler) -> None:
    with pytest.raises(RequestError) as info:
        compiler.compile(schema_spec({"type": "object", "properties": {"a": {"type": "nope"}}}))
    assert info.value.field == "response_format.json_schema"


# -- the compiler's bounds -----------------------------------------------------------------
def test_compiled_grammars_are_cached_per_spec_and_bounded(hf_tokenizer) -> None:
    c = GrammarCompiler(lambda: grammar_tokenizer(hf_tokenizer, hf_tokenizer.vocab_size),
                        max_entries=2)
    try:
        a, b, d = (schema_spec({"type": "object", "properties": {k: {"type": "integer"}}})
                   for k in "abd")
        first = c.compile(a)
        assert c.compile(a) is first  # cached
        c.compile(b)
        c.compile(d)  # a, least recently used, is dropped
        assert c.compile(a) is not first
        m1, m2 = first.matcher(), first.matcher()  # copies, each with its own state
        brace = c.tokenizer().tokenize_str("{")
        assert m1.consume_tokens(brace) and m1.validate_tokens(brace) == 0
        assert m2.validate_tokens(brace) == len(brace)
    finally:
        c.close()


def test_a_failed_compile_is_not_cached(compiler) -> None:
    bad = schema_spec({"type": "object", "properties": {"a": {"type": "nope"}}})
    for _ in range(2):
        with pytest.raises(RequestError):
            compiler.compile(bad)
    assert bad.key not in compiler._cache


def test_a_compile_past_its_time_bound_is_a_400_and_never_blocks_the_caller_longer(
        hf_tokenizer) -> None:
    release = threading.Event()

    def slow_tokenizer():
        release.wait(5)
        return grammar_tokenizer(hf_tokenizer, hf_tokenizer.vocab_size)

    c = GrammarCompiler(slow_tokenizer, timeout_s=0.2)
    try:
        start = time.monotonic()
        with pytest.raises(RequestError) as info:
            c.compile(schema_spec({"type": "object"}))
        assert time.monotonic() - start < 2
        assert "longer than 0.2 s" in info.value.message
        assert info.value.field == "response_format.json_schema"
    finally:
        release.set()
        c.close()


# -- masks ---------------------------------------------------------------------------------
def test_apply_masks_constrained_rows_and_leaves_free_rows_bit_identical(compiler, model) -> None:
    masks, _, _ = model
    vocab = masks.vocab_size
    compiled = compiler.compile(specs.response_format({"type": "json_object"}))
    grammar = RowGrammar(compiled.matcher())
    masks.fill([(1, grammar)])
    keep = allowed(masks.bitmask[1], vocab)
    assert 0 < keep.sum() < vocab
    logits = np.random.default_rng(0).standard_normal((3, vocab)).astype(np.float32)
    before = logits.copy()
    masks.apply(logits, [1])
    assert np.array_equal(logits[[0, 2]], before[[0, 2]])
    assert np.array_equal(logits[1][keep], before[1][keep])
    assert np.isneginf(logits[1][~keep]).all()
    torch = pytest.importorskip("torch", reason="the torch path needs torch")
    for dtype in (torch.float32, torch.bfloat16):  # torch on the CPU, and not float32
        t = torch.from_numpy(before.copy()).to(dtype)
        original = t.clone()
        apply_bitmask(t, masks.bitmask, [1])
        assert torch.equal(t[[0, 2]], original[[0, 2]])
        assert torch.isneginf(t[1][torch.from_numpy(~keep)]).all()
        assert torch.equal(t[1][torch.from_numpy(keep)], original[1][torch.from_numpy(keep)])


def test_a_row_allowing_few_tokens_comes_back_compact_and_its_logits_untouched() -> None:
    vocab = 100  # not a multiple of 32: the bitmask's last word reaches past the logits
    bitmask = np.full((3, 4), -1, dtype=np.int32)
    bitmask[0] = 0
    bitmask[0, 0] = (1 << 3) | (1 << 7)
    bitmask[0, 2] = 1 << 5  # token 69
    bitmask[0, 3] = 1 << 10  # token 106: past the vocabulary, never allowed
    bitmask[2, 1] = ~(1 << 4)  # row 2 allows every token but 36
    logits = np.random.default_rng(1).standard_normal((3, vocab)).astype(np.float32)
    before = logits.copy()
    out = apply_bitmask(logits, bitmask, [0, 2], compact_limit=10)
    assert out.compact == [0] and out.masked == [2]
    assert out.ids.tolist() == [[3, 7, 69]]
    assert out.values.tolist() == [before[0, [3, 7, 69]].tolist()]
    assert np.array_equal(logits[:2], before[:2])  # compact row and free row untouched
    assert np.isneginf(logits[2, 36]) and np.isneginf(logits[2]).sum() == 1
    out = apply_bitmask(logits, bitmask, [0], compact_limit=0)
    assert out.masked == [0] and np.isfinite(logits[0]).sum() == 3


def test_a_grammar_refuses_a_token_outside_its_mask_and_says_so(compiler) -> None:
    compiled = compiler.compile(specs.response_format({"type": "json_object"}))
    grammar = RowGrammar(compiled.matcher())
    tok = compiler.tokenizer()
    not_json = tok.tokenize_str("hello")[0]
    assert grammar.accept([not_json]) == 0
    assert grammar.failed and not grammar.done
