"""OpenAI tool calling: request checks, rendering through the model's template, and tool
calls read back from the answer, streamed and not (pure; no server, no model)."""

from __future__ import annotations

import json

import pytest

from handlers.api.chat_template import LLAMA3_CHAT, takes_tools
from handlers.api.openai import ChatCompletionsApi
from handlers.api.openai_framing import DONE, OpenAIJsonFramer, OpenAISseFramer, ResponseMeta
from handlers.api.tool_calls import parse_tools
from handlers.api.tool_parsers import ToolCallReader
from handlers.api.tool_parsers.llama3_json import Llama3JsonParser
from handlers.engine.scheduler import FinishEvent
from handlers.errors import RequestError
from tests.unit.test_openai_api import make_service, make_tokenizer

#: Llama 3.1's tool format, cut down: tool definitions as JSON in the first user turn, an
#: assistant's calls as {"name", "parameters"} after <|python_tag|>, results as `ipython`
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{% set role = 'ipython' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}"
    "{% if loop.first and tools %}"
    "{{ 'Call a function with JSON. Functions:\n' }}"
    "{% for t in tools %}{{ t | tojson }}{{ '\n' }}{% endfor %}{% endif %}"
    "{% if message.tool_calls %}{% for c in message.tool_calls %}"
    "{{ '<|python_tag|>{\"name\": \"' + c.function.name + '\", \"parameters\": ' "
    "+ c.function.arguments | tojson + '}' }}{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
ASK = [{"role": "user", "content": "hi there"}]
CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def chat(tokenizer, body: dict, template: str = TOOL_TEMPLATE):
    service = make_service(tokenizer, max_length=512, chat_template=template)
    return ChatCompletionsApi().prepare({"messages": ASK, **body}, "application/json", service)


def refused(tokenizer, body: dict, template: str = TOOL_TEMPLATE) -> RequestError:
    with pytest.raises(RequestError) as info:
        chat(tokenizer, body, template)
    assert info.value.status == 400
    return info.value


def finish(text: str, reason: str = "stop") -> FinishEvent:
    return FinishEvent(reason=reason, text=text, prompt_tokens=3, completion_tokens=9,
                       token_ids=())


#: what the framers read calls with, for a request offering WEATHER and CLOCK
READER = ToolCallReader.of(Llama3JsonParser(), [WEATHER, CLOCK])


def parse_tool_calls(text: str) -> list[dict] | None:
    return READER.calls(text)


def meta(tools: bool = True) -> ResponseMeta:
    return ResponseMeta("chatcmpl-x", 0, "m", chat=True, tool_calls=READER if tools else None)


# --- which templates call tools ---

def test_a_template_with_a_tool_format_is_told_from_one_without(tokenizer) -> None:
    assert takes_tools(tokenizer, TOOL_TEMPLATE)
    assert not takes_tools(tokenizer, "llama-2") and not takes_tools(tokenizer, LLAMA3_CHAT)
    assert not takes_tools(tokenizer, "")  # no template at all


# --- the request ---

def test_tools_are_rendered_through_the_models_template(tokenizer) -> None:
    prepared = chat(tokenizer, {"tools": [WEATHER, CLOCK]})
    assert '"name": "get_weather"' in prepared.request.prompt
    assert '"name": "get_time"' in prepared.request.prompt
    assert prepared.framer.meta.tool_calls


def test_a_named_tool_renders_that_tool_alone_and_none_renders_none(tokenizer) -> None:
    named = chat(tokenizer, {"tools": [WEATHER, CLOCK], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}})
    assert "get_time" in named.request.prompt and "get_weather" not in named.request.prompt
    plain = chat(tokenizer, {"tools": [WEATHER], "tool_choice": "none"})
    assert "get_weather" not in plain.request.prompt and not plain.framer.meta.tool_calls


def test_without_a_tool_format_auto_and_none_are_plain_chat(tokenizer) -> None:
    """What a chat UI that always sends its built-in tools needs (Open WebUI)."""
    without = chat(tokenizer, {}, "llama-2").request.prompt
    for choice in ("auto", "none", None):
        prepared = chat(tokenizer, {"tools": [WEATHER], "tool_choice": choice}, "llama-2")
        assert prepared.request.prompt == without and not prepared.framer.meta.tool_calls


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forcing_a_call_from_a_model_without_a_tool_format_is_a_400(tokenizer, choice) -> None:
    err = refused(tokenizer, {"tools": [WEATHER], "tool_choice": choice}, "llama-2")
    assert err.field == "tool_choice" and "no tool format" in err.message


@pytest.mark.parametrize("body, field", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[1].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_name_the_field(tokenizer, body, field) -> None:
    assert refused(tokenizer, body).field == field


def test_an_error_never_echoes_a_large_value(tokenizer) -> None:
    err = refused(tokenizer, {"tools": [WEATHER], "tool_choice": "x" * 10_000})
    assert len(err.message) < 300 and "10002 characters" in err.message


def test_a_tool_result_goes_back_through_the_template(tokenizer) -> None:
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}]
    prompt = chat(tokenizer, {"messages": messages, "tools": [WEATHER]}).request.prompt
    assert '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}' in prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n22 C<|eot_id|>" in prompt
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_tool_messages_need_a_template_that_reads_them(tokenizer) -> None:
    err = refused(tokenizer, {"messages": [*ASK, {"role": "tool", "tool_call_id": "c",
                                                  "content": "x"}]}, "llama-2")
    assert err.field == "messages[1].role"
    bad_args = [*ASK, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    assert refused(tokenizer, {"messages": bad_args, "tools": [WEATHER]}).field == \
        "messages[1].tool_calls[0].function.arguments"


# --- reading calls out of the answer (vLLM's llama3_json format) ---

@pytest.mark.parametrize("text, calls", [
    (CALL, [("get_weather", {"city": "Paris"})]),
    (f"<|python_tag|>{CALL}", [("get_weather", {"city": "Paris"})]),
    (' {"name": "get_time", "arguments": {}}', [("get_time", {})]),
    (f'{CALL}; {{"name": "get_time", "parameters": {{}}}}',
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("It is sunny in Paris.", None),
    ('{"name": "get_weather", "parameters": {"city": ', None),  # cut short
    ('{"city": "Paris"}', None),  # no name
    (f"{CALL} and then some prose", None),
])
def test_tool_calls_are_parsed_as_vllm_reads_llama3_json(text, calls) -> None:
    parsed = parse_tool_calls(text)
    if calls is None:
        assert parsed is None
        return
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] \
        == calls
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in parsed)


def test_a_whole_answer_that_calls_a_tool(tokenizer) -> None:
    body = json.loads(OpenAIJsonFramer(meta()).final(finish(CALL)))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    prose = json.loads(OpenAIJsonFramer(meta()).final(finish("Sunny.")))["choices"][0]
    assert prose["message"] == {"role": "assistant", "content": "Sunny."}
    assert prose["finish_reason"] == "stop"
    untouched = json.loads(OpenAIJsonFramer(meta(tools=False)).final(finish(CALL)))
    assert untouched["choices"][0]["message"]["content"] == CALL


def events(wire: str) -> list[dict]:
    return [json.loads(e[len("data: "):]) for e in wire.split("\n\n")
            if e.startswith("data: {")]


def test_a_streamed_call_is_held_back_then_sent_as_tool_call_deltas() -> None:
    framer = OpenAISseFramer(meta())
    pieces = [" ", '{"name": "get_', 'weather", "parameters": ', '{"city": "Paris"}}']
    assert [framer.chunk(p) for p in pieces] == ["", "", "", ""]  # no content leaks out
    wire = framer.final(finish(CALL))
    assert wire.endswith(DONE)
    first, last = events(wire)
    delta = first["choices"][0]["delta"]
    assert delta["role"] == "assistant" and delta["content"] is None
    call = delta["tool_calls"][0]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert last["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_prose_under_tools_flows_from_its_first_word() -> None:
    framer = OpenAISseFramer(meta())
    assert framer.chunk(" ") == ""  # blanks alone decide nothing
    first = events(framer.chunk("Sunny"))
    assert first[0]["choices"][0]["delta"]["content"] == " Sunny"
    assert events(framer.chunk(" today"))[0]["choices"][0]["delta"]["content"] == " today"
    last = events(framer.final(finish(" Sunny today")))
    assert last[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_streamed_brace_that_is_no_call_comes_out_as_content() -> None:
    framer = OpenAISseFramer(meta())
    assert framer.chunk("{not json") == ""
    out = events(framer.final(finish("{not json")))
    assert out[0]["choices"][0]["delta"]["content"] == "{not json"
    assert out[-1]["choices"][0]["finish_reason"] == "stop"


def test_parse_tools_is_none_without_tools() -> None:
    assert parse_tools({}) is None and parse_tools({"tools": [], "tool_choice": "none"}) is None
