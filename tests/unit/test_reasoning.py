"""A thinking model's reasoning read out of its answer (`<think>...</think>` ->
`reasoning_content`), where the rendered prompt says the answer starts; Qwen3's
`enable_thinking` through `chat_template_kwargs`; and random and cut-short answers
(hypothesis) that never fail and stream as they read whole, tool calls after the thinking
included."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from handlers.api.openai import ChatCompletionsApi
from handlers.api.openai_framing import OpenAIJsonFramer, OpenAISseFramer, ResponseMeta
from handlers.api.reasoning import CONTENT, REASONING, ReasoningSplitter, split, start_of
from handlers.api.tool_parsers import ToolCallReader
from handlers.api.tool_parsers.hermes import HermesParser
from handlers.errors import RequestError
from tests.unit.test_openai_api import make_service, make_tokenizer
from tests.unit.test_tool_calls import CLOCK, WEATHER
from tests.unit.test_tool_parsers import finish, splits

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def chat(tokenizer, body: dict, template: str = "qwen3"):
    service = make_service(tokenizer, max_length=1024, chat_template=template)
    return ChatCompletionsApi().prepare({"messages": ASK, **body}, "application/json", service)


# --- where the answer starts: the end of the rendered prompt ---

@pytest.mark.parametrize("prompt, start", [
    ("<|im_start|>assistant\n", "auto"),  # Qwen3 thinking: the model opens <think> itself
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "off"),  # enable_thinking false
    ("<｜Assistant｜><think>\n", "inside"),  # DeepSeek-R1-Distill: the prompt opens it
    ("<think>old</think> answer<|im_end|>\n<|im_start|>assistant\n", "auto"),
])
def test_the_prompts_end_says_where_the_answer_starts(prompt, start) -> None:
    assert start_of(prompt) == start


def test_enable_thinking_false_renders_qwen3_without_thinking(tokenizer) -> None:
    thinking = chat(tokenizer, {})
    assert thinking.request.prompt.endswith("<|im_start|>assistant\n")
    assert thinking.framer.meta.reasoning == "auto"
    off = chat(tokenizer, {"chat_template_kwargs": {"enable_thinking": False}})
    assert off.request.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.framer.meta.reasoning == "off"


def test_only_a_template_that_teaches_thinking_splits_reasoning(tokenizer) -> None:
    for template in ("qwen2.5", "mistral", "llama-3"):
        assert chat(tokenizer, {}, template).framer.meta.reasoning is None
    meta = chat(tokenizer, {}, "qwen2.5").framer.meta
    body = json.loads(OpenAIJsonFramer(meta).final(finish("<think>x</think>y", "stop")))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "<think>x</think>y"}


@pytest.mark.parametrize("kwargs, field", [
    ([1], "chat_template_kwargs"), ("enable_thinking", "chat_template_kwargs"),
    ({"tools": []}, "chat_template_kwargs.tools"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"raise_exception": 1}, "chat_template_kwargs.raise_exception"),
    ({"not a name": 1}, "chat_template_kwargs.not a name"),
])
def test_template_kwargs_that_are_no_template_variables_are_a_400(tokenizer, kwargs, field):
    with pytest.raises(RequestError) as info:
        chat(tokenizer, {"chat_template_kwargs": kwargs})
    assert (info.value.status, info.value.field) == (400, field)


def test_an_answers_reasoning_goes_back_through_the_template(tokenizer) -> None:
    """Qwen3's template shows the reasoning of the turns since the last question: a client
    sends an answer back as it came, reasoning_content included."""
    messages = [*ASK, {"role": "assistant", "reasoning_content": "It needs the tool.",
                       "tool_calls": [{"id": "c1", "type": "function", "function": {
                           "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "22 C"}]
    prompt = chat(tokenizer, {"messages": messages, "tools": [WEATHER]}).request.prompt
    assert "<think>\nIt needs the tool.\n</think>" in prompt and "<tool_response>" in prompt
    messages[1] = {**messages[1], "reasoning_content": None, "reasoning": "As vLLM 0.17 names it."}
    prompt = chat(tokenizer, {"messages": messages, "tools": [WEATHER]}).request.prompt
    assert "<think>\nAs vLLM 0.17 names it.\n</think>" in prompt
    for key in ("reasoning_content", "reasoning"):
        with pytest.raises(RequestError) as info:
            chat(tokenizer, {"messages": [*ASK, {"role": "assistant", "content": "x", key: 3},
                                          *ASK]})
        assert info.value.field == f"messages[1].{key}"


# --- reading an answer ---

@pytest.mark.parametrize("text, start, reasoning, content", [
    ("<think>\nhmm\n</think>\n\nHi", "auto", "\nhmm\n", "\n\nHi"),
    ("\n<think>hmm</think>Hi", "auto", "hmm", "Hi"),
    ("Hi", "auto", None, "Hi"),
    ("Hi <think>x</think>", "auto", None, "Hi <think>x</think>"),
    ("<think>cut short", "auto", "cut short", ""),
    ("<thi", "auto", None, "<thi"),
    ("", "auto", None, ""),
    ("<think>a</think>b</think>c", "auto", "a", "b</think>c"),
    ("hmm</think>Hi", "inside", "hmm", "Hi"),
    ("<think>hmm</think>Hi", "inside", "hmm", "Hi"),  # a repeated <think> is dropped
    ("cut short", "inside", "cut short", ""),
    ("</thi", "inside", "</thi", ""),
    ("<think>x</think>y", "off", None, "<think>x</think>y"),
    (f"<think>I need the tool.</think>\n\n{QWEN_CALL}", "auto", "I need the tool.",
     f"\n\n{QWEN_CALL}"),
])
def test_reasoning_is_split_from_the_answer(text, start, reasoning, content) -> None:
    assert split(text, start) == (reasoning, content)


def test_a_marker_split_across_pieces_is_held_until_it_is_decided() -> None:
    splitter = ReasoningSplitter("auto")
    assert splitter.feed("<th") == [] and splitter.feed("ink>ab") == [(REASONING, "ab")]
    assert splitter.feed("c</thi") == [(REASONING, "c")]
    assert splitter.feed("nk>\n\nHi") == [(CONTENT, "\n\nHi")]
    assert splitter.feed(" there") == [(CONTENT, " there")] and splitter.flush() == []


THINKING = ResponseMeta("chatcmpl-x", 0, "m", chat=True, reasoning="auto")


def sse_events(wire: str) -> list[dict]:
    assert wire.endswith("data: [DONE]\n\n")
    return [json.loads(e[len("data: "):]) for e in wire.split("\n\n") if e.startswith("data: {")]


def test_whole_and_streamed_answers_carry_reasoning_content() -> None:
    text = "<think>\nThe user wants the weather.\n</think>\n\nIt is sunny."
    body = json.loads(OpenAIJsonFramer(THINKING).final(finish(text, "stop")))
    assert body["choices"][0]["message"] == {
        "role": "assistant", "reasoning_content": "\nThe user wants the weather.\n",
        "reasoning": "\nThe user wants the weather.\n", "content": "\n\nIt is sunny."}
    framer = OpenAISseFramer(THINKING)
    wire = "".join(framer.chunk(p) for p in ["<think>", "\nThe user", " wants the weather.\n",
                                             "</think>", "\n\nIt is", " sunny."])
    deltas = [e["choices"][0]["delta"] for e in sse_events(wire + framer.final(
        finish(text, "stop")))]
    assert deltas[0] == {"role": "assistant", "reasoning_content": "\nThe user",
                         "reasoning": "\nThe user"}
    assert [d.get("reasoning_content") for d in deltas[1:3]] == [" wants the weather.\n", None]
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nIt is sunny."


def test_a_thinking_answer_that_calls_a_tool() -> None:
    meta = ResponseMeta("chatcmpl-x", 0, "m", chat=True, reasoning="auto",
                        tool_calls=ToolCallReader.of(HermesParser(), [WEATHER]))
    text = f"<think>I need the tool.</think>\n\n{QWEN_CALL}"
    choice = json.loads(OpenAIJsonFramer(meta).final(finish(text, "stop")))["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "I need the tool."
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


# --- fuzzing: random and cut-short answers ---

pieces = st.one_of(
    st.sampled_from(["<think>", "</think>", "<think>\n", "\n</think>\n\n", "<", "</", "think>",
                     "<thi", "\n", " ", QWEN_CALL, "<tool_call>", "</tool_call>"]),
    st.text(max_size=10))


@st.composite
def answers(draw) -> str:
    text = "".join(draw(st.lists(pieces, max_size=6)))
    if text and draw(st.booleans()):  # cut short anywhere (max_tokens)
        text = text[:draw(st.integers(0, len(text) - 1))]
    return text


def read_sse(wire: str) -> tuple[str, str, list, str]:
    reasoning, content, calls, reason = "", "", [], None
    for event in sse_events(wire):
        for choice in event["choices"]:
            delta = choice["delta"]
            assert delta.get("reasoning") == delta.get("reasoning_content")
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            calls += [c["function"]["name"] for c in delta.get("tool_calls") or ()]
            reason = choice["finish_reason"] or reason
    return reasoning, content, calls, reason


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=answers(), start=st.sampled_from(["auto", "inside", "off"]),
       tools=st.booleans(), data=st.data())
def test_no_answer_fails_and_streamed_reads_as_whole(text, start, tools, data) -> None:
    reasoning, content = split(text, start)  # never raises
    if start == "off":
        assert (reasoning, content) == (None, text)
    elif reasoning is not None:  # nothing is lost but the markers
        assert len(reasoning) + len(content) <= len(text)
    reader = ToolCallReader.of(HermesParser(), [WEATHER, CLOCK]) if tools else None
    meta = ResponseMeta("chatcmpl-x", 0, "m", chat=True, reasoning=start, tool_calls=reader)
    choice = json.loads(OpenAIJsonFramer(meta).final(finish(text, "length")))["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == reasoning
    framer = OpenAISseFramer(meta)
    wire = "".join(framer.chunk(piece) for piece in splits(text, data.draw))
    wire += framer.final(finish(text, "length"))
    assert read_sse(wire) == (
        reasoning or "", message["content"] or "",
        [c["function"]["name"] for c in message.get("tool_calls") or ()],
        choice["finish_reason"])
