"""The native API's other dialects: TorchServe's LLM example clients (`max_tokens`, one JSON
object per chunk) and a JSON string body; and the documented limits match the enforced ones."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from handlers.api.framing import NdjsonFramer, TextFramer, native_framer
from handlers.api.request import MAX_TEMPERATURE, MAX_TOP_K, decode_body, parse_request
from handlers.config import parse_config
from handlers.errors import RequestError

CFG = parse_config({"handler": {"max_length": 128, "max_new_tokens_limit": 64,
                                "defaults": {"max_new_tokens": 16}}}).handler
DOC = Path(__file__).resolve().parents[2] / "docs" / "request-api.md"


def test_max_tokens_is_an_alias_of_max_new_tokens() -> None:
    r = parse_request({"prompt": "x", "max_tokens": 5}, CFG)
    assert r.max_new_tokens == 5
    same = parse_request({"prompt": "x", "max_tokens": 5, "max_new_tokens": 5}, CFG)
    assert same.max_new_tokens == 5


@pytest.mark.parametrize("other", [6, True, 5.0])
def test_max_tokens_and_max_new_tokens_that_differ_name_both(other) -> None:
    with pytest.raises(RequestError) as err:
        parse_request({"prompt": "x", "max_tokens": other, "max_new_tokens": 5}, CFG)
    assert err.value.status == 400 and err.value.field == "max_tokens"
    assert "max_new_tokens" in err.value.message and "alias" in err.value.message


def test_a_bad_max_tokens_is_named_as_sent() -> None:
    with pytest.raises(RequestError) as err:
        parse_request({"prompt": "x", "max_tokens": 0}, CFG)
    assert err.value.field == "max_tokens" and "[1, " in err.value.message


def test_a_budget_over_the_servers_limit_is_capped_not_refused() -> None:
    """A chat UI's `max_tokens: 1000` reads as "as many as you allow" (handler limit 64)."""
    capped = parse_request({"prompt": "x", "max_tokens": 1000}, CFG)
    assert capped.max_new_tokens == 64 and capped.up_to_limit
    within = parse_request({"prompt": "x", "max_tokens": 64}, CFG)
    assert within.max_new_tokens == 64 and not within.up_to_limit


def test_framing_follows_the_dialect_unless_stream_format_is_named() -> None:
    example = parse_request({"prompt": "x", "max_tokens": 5}, CFG)  # TorchServe's examples
    assert example.stream and example.stream_format == "ndjson"
    assert parse_request({"prompt": "x", "max_new_tokens": 5}, CFG).stream_format == "text"
    named = parse_request({"prompt": "x", "max_tokens": 5, "stream_format": "text"}, CFG)
    assert named.stream_format == "text"
    assert isinstance(native_framer(True, example.stream_format), NdjsonFramer)
    assert isinstance(native_framer(True, "text"), TextFramer)


def test_each_ndjson_chunk_is_one_json_object_with_text() -> None:
    """As TorchServe's client reads a chunk: json.loads(chunk)["text"], the last one too."""
    framer = NdjsonFramer()
    for piece in ("Once", " upon a", " \u00e9t\u00e9 \U0001f600", ""):
        assert json.loads(framer.chunk(piece))["text"] == piece


@pytest.mark.parametrize("payload,content_type", [
    ("hello", "application/json"),  # TorchServe decoded the JSON string itself
    (b'"hello"', "application/json"),
    (b'"hello"', "application/json; charset=utf-8"),  # TorchServe hands these over as bytes
])
def test_a_json_string_body_is_the_prompt(payload, content_type) -> None:
    body = decode_body(payload, content_type, string_is_prompt=True)
    assert parse_request(body, CFG).prompt == "hello"


def test_a_json_string_where_an_object_is_needed_says_what_to_send() -> None:
    with pytest.raises(RequestError) as err:
        decode_body(b'"hello"', "application/json")
    assert err.value.field == "body" and "JSON string" in err.value.message
    assert '{"prompt"' in err.value.message and "malformed" not in err.value.message


@pytest.mark.parametrize("payload", [b"[1, 2]", b"3", b"true", [1], 3.5, False])
def test_other_json_values_say_what_to_send(payload) -> None:
    with pytest.raises(RequestError) as err:
        decode_body(payload, "application/json", string_is_prompt=True)
    assert "expected a JSON object" in err.value.message
    assert "the prompt as a JSON string" in err.value.message


def _doc_row(field: str) -> str:
    row = next(line for line in DOC.read_text().splitlines() if line.startswith(f"| `{field}`"))
    return row.split("|")[4]


def test_documented_sampling_limits_are_the_enforced_ones() -> None:
    assert f"0 … {MAX_TEMPERATURE:g}" in _doc_row("temperature")
    assert f"0 … {MAX_TOP_K:,}" in _doc_row("top_k")
    parse_request({"prompt": "x", "temperature": MAX_TEMPERATURE, "top_k": MAX_TOP_K}, CFG)
    for field, value in (("temperature", MAX_TEMPERATURE + 0.5), ("top_k", MAX_TOP_K + 1)):
        with pytest.raises(RequestError, match=re.escape(f"{value}")):
            parse_request({"prompt": "x", field: value}, CFG)
