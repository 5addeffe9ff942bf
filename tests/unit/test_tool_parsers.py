"""Tool calls read out of model answers: the format chosen by the template's probe call,
the rules of each format (Llama 3.1's JSON, Qwen's <tool_call> tags, Mistral's
[TOOL_CALLS] list and its v11 name[ARGS] form), and random and cut-short answers
(hypothesis) that never fail a request -- whatever the text, the reader answers calls or
None, and a streamed answer reads the same as the whole one."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handlers.api.chat_template import PROBE_NAME, rendered_probe_call
from handlers.api.openai import ChatCompletionsApi
from handlers.api.openai_framing import OpenAIJsonFramer, OpenAISseFramer, ResponseMeta
from handlers.api.tool_calls import call_reader
from handlers.api.tool_parsers import PARSERS, Call, ToolCallReader, ToolParser, parser_for
from handlers.api.tool_parsers.hermes import HermesParser
from handlers.api.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonParser
from handlers.api.tool_parsers.mistral import MistralArgsParser, MistralParser
from handlers.engine.scheduler import FinishEvent
from tests.unit.test_openai_api import make_service, make_tokenizer
from tests.unit.test_tool_calls import CALL, CLOCK, TOOL_TEMPLATE, WEATHER

READER = ToolCallReader.of(Llama3JsonParser(), [WEATHER, CLOCK])
NAMES = ("get_weather", "get_time")


#: a v11 Mistral template, cut down to how it writes an assistant turn's calls
MISTRAL_V11_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ '[TOOL_CALLS]' + c.function.name + '[ARGS]' + c.function.arguments | tojson }}"
    "{% endfor %}{{ eos_token }}"
    "{% elif m.role == 'user' %}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% endif %}{{ '[INST]' + m.content + '[/INST]' }}"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}")


def read(text: str, reader: ToolCallReader = READER) -> list[tuple[str, dict]] | None:
    calls = reader.calls(text)
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


@pytest.mark.parametrize("template, parser", [
    ("qwen2.5", HermesParser), ("qwen3", HermesParser), ("mistral", MistralParser),
    (MISTRAL_V11_TEMPLATE, MistralArgsParser), (TOOL_TEMPLATE, Llama3JsonParser),
    ("llama-3", Llama3JsonParser),  # renders no call: the fallback
], ids=["qwen2.5", "qwen3", "mistral v0.3", "mistral v11", "llama 3.1", "no calls"])
def test_each_familys_template_picks_its_format(template, parser) -> None:
    assert type(call_reader(make_tokenizer(), template, [WEATHER]).parser) is parser


@pytest.mark.parametrize("template, parser", [
    ("qwen2.5", HermesParser()), ("qwen3", HermesParser()), (TOOL_TEMPLATE, Llama3JsonParser()),
    (MISTRAL_V11_TEMPLATE, MistralArgsParser()),
])
def test_a_format_writes_a_call_as_its_template_does(template, parser) -> None:
    """`render` is the format's one statement of how a call is written (a grammar that
    forces a call is built from it): the template writes the same text for the probe."""
    rendered = rendered_probe_call(make_tokenizer(), template)
    assert parser.render([Call(PROBE_NAME, {})]) in rendered


@pytest.mark.parametrize("parser", [p() for p in PARSERS], ids=lambda p: type(p).__name__)
def test_every_format_reads_back_the_calls_it_writes(parser) -> None:
    calls = [Call("get_weather", {"city": "Zürich", "days": [1, 2]}), Call("get_time", {})]
    assert parser.parse(parser.render(calls)) == calls
    assert parser.parse(parser.render(calls[:1])) == calls[:1]
    assert parser.may_open(parser.render(calls)[:3]) is not False


def test_mistral_writes_what_its_v03_template_writes_less_the_id() -> None:
    rendered = rendered_probe_call(make_tokenizer(), "mistral")
    written = MistralParser().render([Call(PROBE_NAME, {})])
    assert rendered.startswith(written[:-2]) and written.endswith("}]")


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


# --- Qwen's <tool_call> tags (vLLM's hermes) ---

HERMES = ToolCallReader.of(HermesParser(), [WEATHER, CLOCK])
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("text, calls", [
    (QWEN_CALL, [("get_weather", {"city": "Paris"})]),
    (f"\n\n{QWEN_CALL}\n", [("get_weather", {"city": "Paris"})]),
    ('<tool_call> {"name": "get_time", "arguments": {}} </tool_call>', [("get_time", {})]),
    (f'{QWEN_CALL}\n<tool_call>\n{{"name": "get_time", "arguments": "{{}}"}}\n</tool_call>',
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    # stopped at <|im_end|> before the closing tag: the last call's JSON is whole
    ('<tool_call>\n{"name": "get_time", "arguments": {}}', [("get_time", {})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n<tool_call>', None),
    ('<tool_call>\n{"name": "get_time", "argu', None),  # cut short
    (f"Let me check. {QWEN_CALL}", None),  # prose first: the model's own text
    (f"{QWEN_CALL} Done.", None),
    ('<tool_call>{"name": "get_time", "parameters": {}}</tool_call>', None),  # not hermes
    ('<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', None),
    ("<tool_call>[1, 2]</tool_call>", None), ("<tool_call></tool_call>", None),
    ("<tool_call>", None), ("</tool_call>", None), ("<tool_call>" * 50_000, None),
])
def test_qwen_calls_are_taken_whole_or_not_at_all(text, calls) -> None:
    assert read(text, HERMES) == calls


@pytest.mark.parametrize("text, opens", [
    ("", True), ("\n\n", True), ("<", True), ("<tool_", True), ("<tool_call>", True),
    ("<tool_call>\n{", True), ("<tool_response>", False), ("<think>", False), ("Sunny", False),
    ("{", False),
])
def test_streamed_qwen_text_is_held_only_while_it_may_open_a_call(text, opens) -> None:
    assert HERMES.may_open(text) is opens


# --- Mistral's [TOOL_CALLS] (vLLM's mistral): the v0.3 list and the v11 name[ARGS] form ---

MISTRAL = ToolCallReader.of(MistralParser(), [WEATHER, CLOCK])
MISTRAL_V11 = ToolCallReader.of(MistralArgsParser(), [WEATHER, CLOCK])
LIST = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.mark.parametrize("text, calls", [
    (f"[TOOL_CALLS] {LIST}", [("get_weather", {"city": "Paris"})]),
    (f"[TOOL_CALLS]{LIST}", [("get_weather", {"city": "Paris"})]),
    (f" {LIST}", [("get_weather", {"city": "Paris"})]),  # the special token decoded away
    ('[{"name": "get_time", "arguments": {}, "id": "a1b2c3d4e"}, '
     '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]',
     [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    (f"[TOOL_CALLS] {LIST} and more", None), (f"Here: {LIST}", None),
    (f"[TOOL_CALLS] {LIST} {LIST}", None),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"ci', None),  # cut short
    ('[TOOL_CALLS] [{"name": "launch_rockets", "arguments": {}}]', None),
    ("[TOOL_CALLS] []", None), ("[1, 2]", None), ('["get_time"]', None),
    ('[TOOL_CALLS] {"name": "get_time", "arguments": {}}', None),  # no list
    ("[TOOL_CALLS]", None), ("[" * 100_000, None),
])
def test_mistral_v03_calls_are_taken_whole_or_not_at_all(text, calls) -> None:
    assert read(text, MISTRAL) == calls


@pytest.mark.parametrize("text, calls", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', [("get_weather", {"city": "Paris"})]),
    ('[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}[TOOL_CALLS]get_weather[ARGS]'
     '{"city": "Oslo"}', [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    ('get_weather{"city": "Paris"}', [("get_weather", {"city": "Paris"})]),  # tokens gone
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', None),
    ('[TOOL_CALLS]get_weather[ARGS]["Paris"]', None),
    ('[TOOL_CALLS]launch_rockets[ARGS]{}', None), ("[TOOL_CALLS]get_time", None),
    ('Sure{"city": "Paris"}', None), ('get_weather {"city": "Paris"} thanks', None),
    ("[TOOL_CALLS]get_time[CALL_ID][ARGS]{}", None),
])
def test_mistral_v11_calls_are_taken_whole_or_not_at_all(text, calls) -> None:
    assert read(text, MISTRAL_V11) == calls


@pytest.mark.parametrize("reader, text, opens", [
    (MISTRAL, "", True), (MISTRAL, "[", True), (MISTRAL, "[TOOL", True),
    (MISTRAL, "[TOOL_CALLS] [", True), (MISTRAL, " [{", True), (MISTRAL, "[ ", True),
    (MISTRAL, "[1]", False), (MISTRAL, "[link](x)", False), (MISTRAL, "Sure", False),
    (MISTRAL_V11, "[TOOL_CALLS]get", True), (MISTRAL_V11, "get_weather", True),
    (MISTRAL_V11, "get_weather[AR", True), (MISTRAL_V11, 'get_weather{"', True),
    (MISTRAL_V11, "Sure, here", False), (MISTRAL_V11, "[x", False),
])
def test_streamed_mistral_text_is_held_only_while_it_may_open_a_call(reader, text, opens):
    assert reader.may_open(text) is opens


def test_mistral_calls_get_the_ids_its_template_accepts_back() -> None:
    """Mistral's templates refuse a call id that is not 9 letters and digits: the ids given
    out here go back through the template with the tool's result."""
    tokenizer = make_tokenizer()
    (call,) = MISTRAL.calls(f"[TOOL_CALLS] {LIST}")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])
    assert READER.calls(CALL)[0]["id"].startswith("chatcmpl-tool-")
    service = make_service(tokenizer, max_length=1024, chat_template="mistral")
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "22 C"}]
    prepared = ChatCompletionsApi().prepare({"messages": messages, "tools": [WEATHER]},
                                            "application/json", service)
    assert call["id"] in prepared.request.prompt and "[TOOL_RESULTS]" in prepared.request.prompt


# --- fuzzing: random and cut-short answers, in every format ---

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
    | st.text(max_size=8) | st.sampled_from(NAMES),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["name", "parameters", "arguments", "x"]) | st.text(
        max_size=4), inner, max_size=3),
    max_leaves=8)
arguments = st.dictionaries(st.text(max_size=5), json_values, max_size=3)
names = st.sampled_from([*NAMES, "other_tool", ""])
#: Llama's JSON as models vary it: either arguments key, arguments as an object or a string
llama_calls = st.builds(
    lambda name, key, args, as_string: json.dumps(
        {"name": name, key: json.dumps(args) if as_string else args}),
    names, st.sampled_from(["parameters", "arguments"]), arguments, st.booleans())
#: each format: its reader, the text that marks it, and any more ways its calls vary
FORMATS = {
    "llama3_json": (READER, [";", "; ", PYTHON_TAG, "{", "}"], llama_calls),
    "hermes": (HERMES, ["<tool_call>", "</tool_call>", "<tool_call>\n", "\n</tool_call>"],
               st.nothing()),
    "mistral": (MISTRAL, ["[TOOL_CALLS]", "[TOOL_CALLS] [", "[", "]", ", "], st.nothing()),
    "mistral v11": (MISTRAL_V11, ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "a1b2c3d4e",
                                  "get_time", "{"], st.nothing()),
}


def pieces(fmt: str):
    """Calls as the format writes them (one or two, of offered tools or not), the format's
    markers, JSON values and prose."""
    reader, markers, more = FORMATS[fmt]
    written = st.lists(st.builds(Call, names.filter(bool), arguments), min_size=1,
                       max_size=2).map(reader.parser.render)
    return st.one_of(written, more, json_values.map(json.dumps), st.text(max_size=12),
                     st.sampled_from([*markers, " ", "\n", '"', "\\"]))


@st.composite
def answers(draw, fmt: str = "llama3_json") -> str:
    """A model's answer: calls, JSON values, markers and prose strung together, then
    maybe cut short anywhere (max_tokens) or with a character dropped."""
    text = draw(st.sampled_from(["", PYTHON_TAG, " "])) + "".join(
        draw(st.lists(pieces(fmt), min_size=1, max_size=5)))
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


@pytest.mark.parametrize("fmt", list(FORMATS))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), reason=st.sampled_from(["stop", "length"]))
def test_no_answer_fails_and_streamed_reads_as_whole(fmt, data, reason) -> None:
    reader = FORMATS[fmt][0]
    text = data.draw(answers(fmt))
    calls = read(text, reader)  # never raises
    if calls is not None:
        assert calls and all(name in NAMES and isinstance(args, dict) for name, args in calls)
    meta = ResponseMeta("chatcmpl-x", 0, "m", chat=True, tool_calls=reader)
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


@pytest.mark.parametrize("fmt", list(FORMATS))
@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=200))
def test_random_text_never_raises(fmt, text) -> None:
    reader = FORMATS[fmt][0]
    assert read(text, reader) is None or all(name in NAMES for name, _ in read(text, reader))
    assert reader.may_open(text) in (True, False)
