"""Tool calling through a real TorchServe, with the official `openai` client.

The model is tests/scripted_checkpoint.py's: a real Llama checkpoint whose greedy answer
to its tool-format prompt is a JSON call of `get_weather`, and to a tool result a sentence.
Served twice in one TorchServe: with its own template (a tool format) and with the
llama-2 preset (none), which must answer a request carrying tools as plain chat.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import ArchiveSpec, attach_logs_fixture, build_store, running_server
from tests.scripted_checkpoint import build_scripted_checkpoint

pytestmark = pytest.mark.e2e
TOOLS_MODEL, PLAIN_MODEL = "scripted-tools", "scripted-plain"
HANDLER = {"max_length": 256, "max_new_tokens_limit": 64, "threads": 1, "chat_template": ""}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tool-calling")
    checkpoint = build_scripted_checkpoint(root / "scripted")
    store = build_store(root, checkpoint, [
        ArchiveSpec(TOOLS_MODEL, handler=HANDLER),
        ArchiveSpec(PLAIN_MODEL, handler={**HANDLER, "chat_template": "llama-2"})])
    with running_server(store, root / "run", [TOOLS_MODEL, PLAIN_MODEL], openai_port=0) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


def client(server, model: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.inference_url}/predictions/{model}/1.0/v1",
                  api_key=server.inference_token, max_retries=0, timeout=60)


def test_a_tool_call_comes_back_and_its_result_is_answered(server) -> None:
    openai = client(server, TOOLS_MODEL)
    first = openai.chat.completions.create(model=TOOLS_MODEL, messages=ASK, tools=[WEATHER],
                                           temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    # the result goes back as OpenAI clients send it: the assistant turn, then the tool's
    messages = [*ASK, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}]
    second = openai.chat.completions.create(model=TOOLS_MODEL, messages=messages,
                                            tools=[WEATHER], temperature=0)
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls


@pytest.mark.parametrize("options", [
    {},
    {"stream_options": {"include_usage": True}},
    # the framer counts tokens per chunk: the calls were lost with it (issue 36)
    {"stream_options": {"include_usage": True}, "extra_body": {
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}},
    {"logprobs": True, "top_logprobs": 1, "extra_body": {
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}},
], ids=["plain", "usage", "continuous usage", "continuous usage and logprobs"])
def test_a_streamed_tool_call_arrives_as_deltas_with_no_content(server, options) -> None:
    stream = client(server, TOOLS_MODEL).chat.completions.create(
        model=TOOLS_MODEL, messages=ASK, tools=[WEATHER], temperature=0, stream=True,
        **options)
    names, arguments, content, reasons = [], "", "", []
    for chunk in stream:
        if not chunk.choices:  # the usage chunk
            assert chunk.usage.completion_tokens == 6  # the call's 5 words and EOS
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            names += [call.function.name] if call.function.name else []
            arguments += call.function.arguments or ""
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris"}
    assert content == "" and reasons == ["tool_calls"]


def test_without_a_tool_format_auto_is_plain_chat_and_required_is_a_400(server) -> None:
    openai = client(server, PLAIN_MODEL)
    plain = openai.chat.completions.create(model=PLAIN_MODEL, messages=ASK, tools=[WEATHER],
                                           tool_choice="auto", temperature=0)
    assert plain.choices[0].message.content == "Hello from a plain chat."
    assert not plain.choices[0].message.tool_calls
    r = httpx.post(f"{server.inference_url}/predictions/{PLAIN_MODEL}/1.0/v1/chat/completions",
                   json={"messages": ASK, "tools": [WEATHER], "tool_choice": "required"},
                   headers={"Authorization": f"Bearer {server.inference_token}"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tool_choice" and "no tool format" in error["message"]
    assert "get_weather" not in error["message"]  # the tools are not echoed back


def test_a_budget_over_the_limit_is_capped_for_a_chat_uis_title_request(server) -> None:
    """Open WebUI asks max_tokens 1000 for a title: capped at the limit (64), not refused."""
    answer = client(server, PLAIN_MODEL).chat.completions.create(
        model=PLAIN_MODEL, messages=ASK, max_tokens=1000, temperature=0)
    assert answer.choices[0].message.content == "Hello from a plain chat."


def test_one_base_url_lists_every_model_and_chats_with_each(server) -> None:
    """The router `serve` starts: GET /v1/models lists both, `model` routes each chat, the
    same token is checked by TorchServe itself."""
    from openai import AuthenticationError, OpenAI

    assert server.openai_url.endswith("/v1")
    openai = OpenAI(base_url=server.openai_url, api_key=server.inference_token, max_retries=0,
                    timeout=60)
    assert sorted(m.id for m in openai.models.list()) == [PLAIN_MODEL, TOOLS_MODEL]
    plain = openai.chat.completions.create(model=PLAIN_MODEL, messages=ASK, temperature=0)
    assert plain.choices[0].message.content == "Hello from a plain chat."
    stream = openai.chat.completions.create(model=TOOLS_MODEL, messages=ASK, tools=[WEATHER],
                                            temperature=0, stream=True)
    called = [c.function.name for chunk in stream for c in chunk.choices[0].delta.tool_calls or ()
              if chunk.choices and c.function and c.function.name]
    assert called == ["get_weather"]
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=server.openai_url, api_key="wrong", max_retries=0).models.list()


def test_scripted_checkpoint_is_a_plain_llama(tmp_path: Path) -> None:
    """The files are what a hub Llama checkpoint holds, so packaging checks treat it as one."""
    out = build_scripted_checkpoint(tmp_path / "s")
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert "tools" in json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
