"""Tool calling, reasoning and structured outputs through a real TorchServe, with the
official `openai` client.

The models are tests/scripted_checkpoint.py's: real checkpoints whose greedy answers are
scripted. The Llama one answers its tool-format prompt with a JSON call of `get_weather`
and a tool result with a sentence; it is served twice: with its own template (a tool
format) and with the llama-2 preset (none), which must answer a request carrying tools as
plain chat. The Qwen2.5 and Mistral v0.3 ones, under their families' published templates
(Qwen2.5's through the `qwen2.5` preset), call `get_weather` in their own formats; the
Qwen3 one thinks before it answers, unless `enable_thinking` is false. Beside them, the
JSON checkpoint (the tiny demo model's vocabulary, logits leaning to JSON punctuation and
EOS) answers the schema corpus (tests/data/structured) under `response_format`, streamed
and not, and every function schema as a forced tool call. Six archives, one TorchServe.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest

from handlers.presets.chat_templates import PRESETS
from tests.e2e.harness import ArchiveSpec, attach_logs_fixture, build_store, running_server
from tests.scripted_checkpoint import (
    TOOL_TEMPLATE,
    build_json_checkpoint,
    build_scripted_checkpoint,
)
from tests.structured_walk import corpus, corpus_tools, json_schema_answer

pytestmark = pytest.mark.e2e
TOOLS_MODEL, PLAIN_MODEL, JSON_MODEL = "scripted-tools", "scripted-plain", "scripted-json"
#: the JSON model serves the corpus: named tools' prompts hold one schema each
JSON_HANDLER = {"max_length": 2048, "max_new_tokens_limit": 200, "threads": 1,
                "chat_template": "", "batch_size": 8}
#: served name -> (scripted family, chat_template): Qwen2.5's through the preset (the
#: archive's own copy of the published template), the others through their checkpoints'
FAMILIES = {"scripted-qwen": ("qwen2.5", "qwen2.5"), "scripted-mistral": ("mistral", ""),
            "scripted-qwen3": ("qwen3", "")}
QWEN3_MODEL = "scripted-qwen3"
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
    build_store(root, build_json_checkpoint(root / "json"),  # the same store
                [ArchiveSpec(JSON_MODEL, handler=JSON_HANDLER)])
    for name, (family, template) in FAMILIES.items():  # engine inline: one process to load
        build_store(root, build_scripted_checkpoint(root / family, family),
                    [ArchiveSpec(name, handler={**HANDLER, "chat_template": template,
                                                "engine_process": "inline"})])
    with running_server(store, root / "run", [TOOLS_MODEL, PLAIN_MODEL, JSON_MODEL,
                                              *FAMILIES],
                        openai_port=0) as srv:
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


def streamed_calls(stream) -> tuple[list[str], str, list[str], str, list]:
    """(names, arguments, ids, content, finish reasons) of a streamed chat answer."""
    names, arguments, ids, content, reasons = [], "", [], "", []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            names += [call.function.name] if call.function.name else []
            ids += [call.id] if call.id else []
            arguments += call.function.arguments or ""
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    return names, arguments, ids, content, reasons


@pytest.mark.parametrize("model", ["scripted-qwen", "scripted-mistral"])
def test_qwen_and_mistral_call_tools_in_their_own_formats(server, model) -> None:
    """The format follows the checkpoint's template: Qwen2.5's <tool_call> tags, Mistral
    v0.3's [TOOL_CALLS] list (the control token is special, so the text served lacks it),
    each call with an id the template takes back (Mistral's: 9 letters and digits)."""
    openai = client(server, model)
    answer = openai.chat.completions.create(model=model, messages=ASK, tools=[WEATHER],
                                            temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    names, arguments, ids, content, reasons = streamed_calls(openai.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], temperature=0, stream=True))
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris"}
    assert content == "" and reasons == ["tool_calls"]
    if model == "scripted-mistral":
        assert all(len(i) == 9 and i.isalnum() for i in [call.id, *ids])


def test_a_qwen3_answer_comes_back_as_reasoning_and_content(server) -> None:
    """The word-level tokenizer decodes its words joined by spaces: hence the blanks."""
    openai = client(server, QWEN3_MODEL)
    message = openai.chat.completions.create(model=QWEN3_MODEL, messages=ASK,
                                             temperature=0).choices[0].message
    assert message.reasoning_content == " The user wants the weather. "
    assert message.content == " It is sunny in Paris."
    reasoning, content, first = "", "", None
    for chunk in openai.chat.completions.create(model=QWEN3_MODEL, messages=ASK,
                                                temperature=0, stream=True):
        delta = chunk.choices[0].delta
        first = first or ("reasoning" if getattr(delta, "reasoning_content", None) else
                          "content" if delta.content else None)
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (first, reasoning, content) == ("reasoning", message.reasoning_content,
                                           message.content)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_enable_thinking_false_answers_without_reasoning(server, stream) -> None:
    """The template closes an empty thinking block in the prompt; the model answers."""
    answer = client(server, QWEN3_MODEL).chat.completions.create(
        model=QWEN3_MODEL, messages=ASK, temperature=0, stream=stream,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    if not stream:
        message = answer.choices[0].message
        assert message.content == "It is sunny in Paris." and message.reasoning_content is None
        return
    deltas = [chunk.choices[0].delta for chunk in answer]
    assert "".join(d.content or "" for d in deltas) == "It is sunny in Paris."
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)


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
    """The router `serve` starts: GET /v1/models lists them all, `model` routes each chat, the
    same token is checked by TorchServe itself."""
    from openai import AuthenticationError, OpenAI

    assert server.openai_url.endswith("/v1")
    openai = OpenAI(base_url=server.openai_url, api_key=server.inference_token, max_retries=0,
                    timeout=60)
    assert sorted(m.id for m in openai.models.list()) == sorted([JSON_MODEL, PLAIN_MODEL,
                                                                 TOOLS_MODEL, *FAMILIES])
    plain = openai.chat.completions.create(model=PLAIN_MODEL, messages=ASK, temperature=0)
    assert plain.choices[0].message.content == "Hello from a plain chat."
    stream = openai.chat.completions.create(model=TOOLS_MODEL, messages=ASK, tools=[WEATHER],
                                            temperature=0, stream=True)
    called = [c.function.name for chunk in stream for c in chunk.choices[0].delta.tool_calls or ()
              if chunk.choices and c.function and c.function.name]
    assert called == ["get_weather"]
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=server.openai_url, api_key="wrong", max_retries=0).models.list()


@pytest.mark.parametrize("family, model_type, template", [
    ("llama", "llama", TOOL_TEMPLATE), ("qwen2.5", "llama", PRESETS["qwen2.5"]),
    ("qwen3", "qwen3", PRESETS["qwen3"]), ("mistral", "mistral", PRESETS["mistral"])])
def test_scripted_checkpoints_are_hub_checkpoints(tmp_path: Path, family, model_type,
                                                  template) -> None:
    """The files are what a hub checkpoint holds, so packaging checks treat them as one,
    with the family's published template."""
    out = build_scripted_checkpoint(tmp_path / "s", family)
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == template


# --- structured outputs: the corpus through the JSON model ---

CORPUS = corpus()["schemas"]
FUNCTIONS, FUNCTION_TOOLS = corpus_tools()
#: sampled (as the corpus' unit tests' stand-in model samples): a greedy model of constant
#: logits would repeat its best token inside a string forever
SAMPLED = {"temperature": 1.0, "seed": 1, "max_tokens": 200}


def _structured(server, i: int, entry: dict) -> tuple[str, str]:
    """(finish_reason, text) of one corpus schema's chat answer; odd ones streamed, as
    `inf2serve chat` reads them."""
    return json_schema_answer(client(server, JSON_MODEL), JSON_MODEL, entry["schema"],
                              f"Answer as JSON: {entry['id']}", i % 2 == 1, **SAMPLED)


def test_every_corpus_schema_answers_json_that_validates(server) -> None:
    """Each of the corpus' schemas as a strict json_schema response_format (half streamed):
    every answer that ends with "stop" parses and validates; one cut by max_tokens is
    "length" (25 of 69 end within 200 tokens at seed 1: the JSON model's strings run long)."""
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda a: _structured(server, *a), enumerate(CORPUS)))
    for entry, (reason, text) in zip(CORPUS, answers, strict=True):
        assert reason in ("stop", "length"), (entry["id"], reason)
        if reason == "stop":
            jsonschema.validate(json.loads(text), entry["schema"])
    stopped = sum(reason == "stop" for reason, _ in answers)
    assert stopped >= len(CORPUS) // 4, [(e["id"], r) for e, (r, _) in zip(
        CORPUS, answers, strict=True)]


def test_json_object_on_completions_and_native_and_a_400_naming_the_schema(server) -> None:
    openai = client(server, JSON_MODEL)
    done = openai.completions.create(model=JSON_MODEL, prompt="Some JSON:",
                                     extra_body={"response_format": {"type": "json_object"}},
                                     **SAMPLED)
    # an object of any keys may run past the budget: "length", a prefix of one
    assert done.choices[0].finish_reason in ("stop", "length")
    if done.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(done.choices[0].text), dict)
    assert done.choices[0].text.startswith("{")
    native = httpx.post(f"{server.inference_url}/predictions/{JSON_MODEL}",
                        json={"prompt": "Some JSON:", "stream": False, "temperature": 1.0,
                              "seed": 2, "response_format": {"type": "json_object"}},
                        headers={"Authorization": f"Bearer {server.inference_token}"},
                        timeout=60)
    assert native.status_code == 200, native.text
    answer = native.json()
    if answer["finish_reason"] == "stop":
        assert isinstance(json.loads(answer["text"]), dict)
    assert answer["text"].startswith("{")
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as info:  # llguidance refuses an unknown format
        openai.chat.completions.create(model=JSON_MODEL, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
                "type": "object", "properties": {"a": {"type": "string", "format": "ipv7"}}}}})
    assert info.value.body["param"] == "response_format.json_schema"


def _named_call(server, entry: dict) -> tuple[str, list]:
    answer = client(server, JSON_MODEL).chat.completions.create(
        model=JSON_MODEL, messages=ASK, tools=FUNCTION_TOOLS,
        tool_choice={"type": "function", "function": {"name": entry["name"]}}, **SAMPLED)
    choice = answer.choices[0]
    return choice.finish_reason, choice.message.tool_calls or []


def test_a_named_function_of_the_corpus_is_called_with_valid_arguments(server) -> None:
    """Every function schema of the corpus, forced by name: the answer is a call of it whose
    arguments validate, finish_reason "tool_calls" (or "length" if cut)."""
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda e: _named_call(server, e), FUNCTIONS))
    for entry, (reason, calls) in zip(FUNCTIONS, answers, strict=True):
        assert reason in ("tool_calls", "length"), (entry["id"], reason)
        if reason == "tool_calls":
            (call,) = calls
            assert call.function.name == entry["name"]
            jsonschema.validate(json.loads(call.function.arguments), entry["schema"])
    assert sum(r == "tool_calls" for r, _ in answers) >= len(FUNCTIONS) // 4


#: the corpus' smallest function schemas, offered in pairs to `required`
SMALL = sorted(FUNCTION_TOOLS, key=lambda t: len(json.dumps(t["function"]["parameters"])))[:8]


def _required_streamed(server, tools: list) -> tuple[list, dict]:
    stream = client(server, JSON_MODEL).chat.completions.create(
        model=JSON_MODEL, messages=ASK, tools=tools, tool_choice="required", stream=True,
        **SAMPLED)
    calls: dict[int, list] = {}
    reasons = []
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or ():
            calls.setdefault(call.index, [None, ""])
            calls[call.index][0] = call.function.name or calls[call.index][0]
            calls[call.index][1] += call.function.arguments or ""
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    return reasons, calls


def test_required_streams_calls_of_the_offered_functions(server) -> None:
    """`required` over pairs of functions, streamed: each answer that ends is calls of the
    offered functions with valid arguments, "tool_calls"; one cut is "length"."""
    pairs = [SMALL[i:i + 2] for i in range(0, len(SMALL), 2)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda tools: _required_streamed(server, tools), pairs))
    for tools, (reasons, calls) in zip(pairs, answers, strict=True):
        assert reasons in (["tool_calls"], ["length"]), reasons
        if reasons == ["tool_calls"]:
            schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
            assert calls
            for name, arguments in calls.values():
                jsonschema.validate(json.loads(arguments), schemas[name])
    assert any(reasons == ["tool_calls"] for reasons, _ in answers)
