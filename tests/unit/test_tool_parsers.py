"""Tool calls read out of model answers: the format chosen by the template's probe call,
the rules of Llama 3.1's JSON format, and random and cut-short answers (hypothesis) that
never fail a request -- whatever the text, the reader answers calls or None, and a
streamed answer reads the same as the whole one."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handlers.api.chat_template import rendered_probe_call
from handlers.api.openai_framing import OpenAIJsonFramer, OpenAISseFramer, ResponseMeta
from handlers.api.tool_calls import call_reader
from handlers.api.tool_parsers import PARSERS, ToolCallReader, ToolParser, parser_for
from handlers.api.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonParser
from handlers.engine.scheduler import FinishEvent
from tests.unit.test_openai_api import make_tokenizer
from tests.unit.test_tool_calls import CALL, CLOCK, TOOL_TEMPLATE, WEATHER

READER = ToolCallReader.of(Llama3JsonParser(), [WEATHER, CLOCK])
NAMES = ("get_weather", "get_time")


def read(text: str) -> list[tuple[str, dict]] | None:
    calls = READER.calls(text)
    return None if calls is None else [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# --- the format, from the template ---

def test_every_format_is_a_small_parser_class_and_llama3_json_is_the_fallback() -> None:
    assert all(issubclass(p, ToolParser) for p in PARSERS)
    assert PARSERS[-1] is Llama3JsonParser  # accepts any template: tried last
    assert isinstance(parser_for(""), Llama3JsonParser)


def test_the_probe_call_is_what_the_template_writes_for_a_call() -> None:
    tokenizer = make_tokenizer()
    rendered = rendered_probe_call(tokenizer, TOOL_TEMPLATE)
    assert rendered.startswith("<|start_header_id|>assistant")
    assert '<|python_tag|>{"name": "inf2serve_probe_tool_7f3a", "parameters": {}}' in rendered
    assert "probe" not in rendered_probe_call(tokenizer, "llama-2")  # it writes no calls
    reader = call_reader(tokenizer, TOOL_TEMPLATE, [WEATHER])
    assert isinstance(reader.parser, Llama3JsonParser) and reader.names == {"get_weather"}


# --- Llama 3.1's JSON calls, taken whole or not at all ---

@pytest.mark.parametrize("text, calls", [
    (CALL, [("get_weather", {"city": "Paris"})]),
    (f"{PYTHON_TAG}{CALL}", [("get_weather", {"city": "Paris"})]),
    (f"\n {CALL} \n", [("get_weather", {"city": "Paris"})]),
    ('{"name": "get_time", "arguments": "{}"}', [("get_time", {})]),  # arguments as a string
    (f'{CALL};{{"name": "get_time", "arguments": {{}}}}',
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    # what issue 36 saw fail whole requests: a call followed by another JSON value
    (f"{CALL}; 42", None),
    (f'{CALL} ["x"]', None),
    (f'{CALL} "done"', None),
    (f"{CALL}; null", None),
    (f"{CALL} and some prose", None),
    ('{"name": "launch_rockets", "parameters": {}}', None),  # not among the tools
    (f'{CALL}; {{"name": "launch_rockets", "parameters": {{}}}}', None),
    ('{"name": "get_time"}', None),  # no arguments object
    ('{"name": "get_time", "parameters": {}, "arguments": {}}', None),  # both
    ('{"name": "get_time", "parameters": []}', None),
    ('{"name": "get_time", "arguments": "{oops"}', None),
    ('{"name": 3, "parameters": {}}', None),
    ('{"name": "get_time", "parameters": {"x": NaN}}', None),  # no JSON for NaN
    ("[" * 100_000, None),  # deeper than Python's recursion limit
    ("{" * 100_000, None),
    ("", None), (PYTHON_TAG, None), ("Sunny.", None),
])
def test_an_answer_is_calls_only_when_it_is_calls_of_the_offered_tools_whole(text, calls):
    assert read(text) == calls


def test_a_parser_that_raises_costs_the_answer_nothing() -> None:
    class Broken(Llama3JsonParser):
        def parse(self, text: str):
            raise RuntimeError("a bug")

        def may_open(self, text: str):
            raise RuntimeError("a bug")

    reader = ToolCallReader.of(Broken(), [WEATHER])
    assert reader.calls(CALL) is None and reader.may_open("{") is False


@pytest.mark.parametrize("text, opens", [
    ("", True), ("  \n", True), ("<|python", True), (PYTHON_TAG, True), (" {", True),
    ('{"name"', True), ("Sunny", False), ("<|eot", False), ("[", False),
])
def test_streamed_text_is_held_only_while_it_may_open_a_call(text, opens) -> None:
    assert READER.may_open(text) is opens


# --- fuzzing: random and cut-short answers ---

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
    | st.text(max_size=8) | st.sampled_from(NAMES),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["name", "parameters", "arguments", "x"]) | st.text(
        max_size=4), inner, max_size=3),
    max_leaves=8)
calls = st.builds(
    lambda name, key, args, as_string: json.dumps(
        {"name": name, key: json.dumps(args) if as_string else args}),
    st.sampled_from([*NAMES, "other_tool", ""]), st.sampled_from(["parameters", "arguments"]),
    st.dictionaries(st.text(max_size=5), json_values, max_size=3), st.booleans())
pieces = st.one_of(calls, json_values.map(json.dumps), st.text(max_size=12),
                   st.sampled_from([";", "; ", " ", "\n", PYTHON_TAG, "{", "}", '"', "\\"]))


@st.composite
def answers(draw) -> str:
    """A model's answer: calls, JSON values, separators and prose strung together, then
    maybe cut short anywhere (max_tokens) or with a character dropped."""
    text = draw(st.sampled_from(["", PYTHON_TAG, " "])) + "".join(
        draw(st.lists(pieces, min_size=1, max_size=5)))
    cut = draw(st.sampled_from(["whole", "cut", "drop"]))
    if cut != "whole" and text:
        at = draw(st.integers(0, len(text) - 1))
        text = text[:at] if cut == "cut" else text[:at] + text[at + 1:]
    return text


def splits(text: str, draw) -> list[str]:
    """The answer as the engine might stream it: split at random points."""
    points = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def finish(text: str, reason: str) -> FinishEvent:
    return FinishEvent(reason=reason, text=text, prompt_tokens=3, completion_tokens=5)


def streamed(wire: str) -> tuple[str, list, str]:
    """(content, calls as (name, arguments), finish_reason) of an SSE answer."""
    content, calls, reason = "", [], None
    assert wire.endswith("data: [DONE]\n\n")
    for event in wire.split("\n\n"):
        if not event.startswith("data: {"):
            continue
        for choice in json.loads(event[len("data: "):])["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            calls += [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                      for c in delta.get("tool_calls") or ()]
            reason = choice["finish_reason"] or reason
    return content, calls, reason


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=answers(), reason=st.sampled_from(["stop", "length"]), data=st.data())
def test_no_answer_fails_and_streamed_reads_as_whole(text, reason, data) -> None:
    calls = read(text)  # never raises
    if calls is not None:
        assert calls and all(name in NAMES and isinstance(args, dict) for name, args in calls)
    meta = ResponseMeta("chatcmpl-x", 0, "m", chat=True, tool_calls=READER)
    whole = json.loads(OpenAIJsonFramer(meta).final(finish(text, reason)))["choices"][0]
    message = whole["message"]
    if calls is None:  # whatever is no call is the model's own text, as it wrote it
        assert (message["content"], whole["finish_reason"]) == (text, reason)
        assert "tool_calls" not in message
    else:
        assert message["content"] is None and whole["finish_reason"] == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in message["tool_calls"]] == calls
    framer = OpenAISseFramer(meta)
    wire = "".join(framer.chunk(piece) for piece in splits(text, data.draw))
    wire += framer.final(finish(text, reason))
    assert streamed(wire) == (message["content"] or "", calls or [], whole["finish_reason"])


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200))
def test_random_text_never_raises(text) -> None:
    assert read(text) is None or all(name in NAMES for name, _ in read(text))
    assert READER.may_open(text) in (True, False)
