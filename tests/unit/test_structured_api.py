"""Structured outputs at the API (pure; no server, no model): `response_format` on chat,
completions and the native API becomes the request's grammar (`sampling.grammar`), a
forced `tool_choice` becomes a grammar of the offered functions in the template's call
format, and a backend that applies no grammar refuses either with a 400 naming the field
the client sent."""

from __future__ import annotations

import json

import pytest

from handlers.api.native import NativeApi
from handlers.api.openai import ChatCompletionsApi, CompletionsApi
from handlers.errors import RequestError
from handlers.structured.spec import JSON_OBJECT, JSON_SCHEMA, TOOL_CALLS
from tests.unit.test_openai_api import CHAT, make_service, make_tokenizer
from tests.unit.test_tool_calls import ASK, CLOCK, TOOL_TEMPLATE, WEATHER
from tests.unit.test_tool_parsers import MISTRAL_V11_TEMPLATE

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA,
                                                    "strict": True}}
#: a synthetic device without host sampling returns no logits a mask could apply to
NO_LOGITS = {"backend": "synthetic", "synthetic": {"decode_step_ms": 10}}


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def prepare(api, tokenizer, body: dict, **handler):
    service = make_service(tokenizer, max_length=512, **handler)
    return api.prepare(body, "application/json", service).request


def test_response_format_is_the_grammar_of_chat_completions_and_native(tokenizer) -> None:
    chat = prepare(ChatCompletionsApi(), tokenizer, {"messages": CHAT,
                                                     "response_format": AS_SCHEMA},
                   chat_template="llama-2")
    done = prepare(CompletionsApi(), tokenizer, {"prompt": "hi", "response_format": AS_SCHEMA})
    native = prepare(NativeApi(), tokenizer, {"prompt": "hi", "response_format": AS_SCHEMA})
    for request in (chat, done, native):
        g = request.sampling.grammar
        assert (g.kind, g.strict, g.name) == (JSON_SCHEMA, True, "place")
        assert json.loads(g.schema) == SCHEMA and g.field == "response_format.json_schema"
    obj = prepare(CompletionsApi(), tokenizer, {"prompt": "hi", "stream": True,
                                                "response_format": {"type": "json_object"}})
    assert obj.sampling.grammar.kind == JSON_OBJECT and obj.stream
    text = prepare(CompletionsApi(), tokenizer, {"prompt": "hi",
                                                 "response_format": {"type": "text"}})
    assert text.sampling.grammar is None


@pytest.mark.parametrize("api, body", [
    (CompletionsApi(), {"prompt": "hi"}), (NativeApi(), {"prompt": "hi"}),
    (ChatCompletionsApi(), {"messages": ASK})])
def test_a_backend_without_logits_refuses_response_format_naming_it(tokenizer, api,
                                                                    body) -> None:
    with pytest.raises(RequestError) as info:
        prepare(api, tokenizer, {**body, "response_format": {"type": "json_object"}},
                chat_template=TOOL_TEMPLATE, **NO_LOGITS)
    assert info.value.field == "response_format" and "host_sampling_vocab" in info.value.message


def test_required_is_a_grammar_of_every_offered_function(tokenizer) -> None:
    request = prepare(ChatCompletionsApi(), tokenizer, {
        "messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required"},
        chat_template=TOOL_TEMPLATE)
    g = request.sampling.grammar
    assert (g.kind, g.field, g.name) == (TOOL_CALLS, "tool_choice", "")
    assert [name for name, _ in json.loads(g.schema)] == ["get_weather", "get_time"]
    assert (g.tool_format.name_key, g.tool_format.args_key, g.tool_format.separator) == (
        "name", "parameters", "; ")  # what the template's format (llama3_json) reads back


def test_a_named_function_is_a_grammar_of_one_call_of_it(tokenizer) -> None:
    request = prepare(ChatCompletionsApi(), tokenizer, {
        "messages": ASK, "tools": [WEATHER, CLOCK],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        chat_template=TOOL_TEMPLATE)
    g = request.sampling.grammar
    assert g.name == "get_weather" and g.tool_format.separator is None
    assert json.loads(g.schema) == [["get_weather", WEATHER["function"]["parameters"]]]


def test_auto_stays_unconstrained(tokenizer) -> None:
    request = prepare(ChatCompletionsApi(), tokenizer, {
        "messages": ASK, "tools": [WEATHER], "tool_choice": "auto"},
        chat_template=TOOL_TEMPLATE)
    assert request.sampling.grammar is None


@pytest.mark.parametrize("body, field", [
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": AS_SCHEMA},
     "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),  # no logits to mask
])
def test_forced_calls_refused_name_the_field(tokenizer, body, field) -> None:
    handler = {"chat_template": TOOL_TEMPLATE, **(NO_LOGITS if field == "tool_choice" else {})}
    with pytest.raises(RequestError) as info:
        prepare(ChatCompletionsApi(), tokenizer, {"messages": ASK, **body}, **handler)
    assert info.value.field == field and info.value.status == 400


@pytest.mark.parametrize("template, kwargs, fmt", [
    ("qwen2.5", None, {"prefix": "<tool_call>\n", "suffix": "\n</tool_call>",
                       "args_key": "arguments", "separator": "\n", "reasoning": None}),
    ("qwen3", None, {"prefix": "<tool_call>\n", "reasoning": "auto"}),  # may think first
    ("qwen3", {"enable_thinking": False}, {"prefix": "<tool_call>\n", "reasoning": None}),
    ("mistral", None, {"start": "[TOOL_CALLS] [", "separator": ", ", "end": "]",
                       "args_key": "arguments"}),
    (MISTRAL_V11_TEMPLATE, None, {"prefix": "[TOOL_CALLS]", "args_marker": "[ARGS]",
                                  "separator": ""}),
])
def test_a_forced_call_takes_the_templates_family_format(tokenizer, template, kwargs,
                                                         fmt) -> None:
    """Qwen's and Mistral's templates force calls in their own formats (the one their
    parser reads back), a thinking template leaving room to think first."""
    request = prepare(ChatCompletionsApi(), tokenizer, {
        "messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required",
        "chat_template_kwargs": kwargs}, chat_template=template)
    g = request.sampling.grammar
    assert g.kind == TOOL_CALLS
    assert {k: getattr(g.tool_format, k) for k in fmt} == fmt
