"""The OpenAI body parsed once into a typed request, and one rule for both APIs on blank
prompts and token budgets (pure: no server, no model)."""

from __future__ import annotations

import pytest

from handlers.api.native import NativeApi
from handlers.api.openai import ChatCompletionsApi, CompletionsApi
from handlers.api.openai_request import (
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    parse_chat,
    parse_completion,
)
from handlers.api.request import parse_request
from handlers.errors import RequestError
from tests.unit.test_openai_api import make_service, make_tokenizer
from tests.unit.test_tool_calls import TOOL_TEMPLATE, WEATHER

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def service():
    return make_service(make_tokenizer(), chat_template="llama-2")


def config(service):
    return service.config.handler


def test_a_chat_body_becomes_one_typed_request_with_everything_read(service) -> None:
    body = {"model": "model", "messages": CHAT, "max_completion_tokens": 7, "min_tokens": 2,
            "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stop": "ok", "seed": 3,
            "frequency_penalty": 0.5, "ignore_eos": True, "timeout": 9, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "tools": [WEATHER], "tool_choice": "auto", "user": "u", "n": 1,
            "response_format": {"type": "text"}}
    r = parse_chat(body, "application/json", config(service))
    assert isinstance(r, ChatRequest) and r.model == "model"
    assert (r.stream, r.stream_options, r.logprobs) == (True, StreamOptions(True, True), None)
    p = r.params
    assert (p.max_new_tokens, p.min_new_tokens, p.stop, p.timeout_s, p.up_to_limit) == (
        7, 2, ("ok",), 9.0, False)
    s = p.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.min_new_tokens, s.frequency_penalty,
            s.ignore_eos) == (0.5, 0.9, 40, 3, 2, 0.5, True)
    assert r.messages == ({"role": "system", "content": "be brief"},
                          {"role": "user", "content": "hi there"})
    assert r.tools.choice == "auto" and r.tools.tools[0]["function"]["name"] == "get_weather"
    assert r.response_format is None and r.tool_turn is None and r.template_kwargs is None
    # errors name the budget as it was sent
    assert p.names.budget == "max_completion_tokens" and p.names.prompt == "messages"


def test_a_completion_body_becomes_one_typed_request(service) -> None:
    r = parse_completion({"prompt": [[7, 8]], "echo": True, "max_tokens": 0, "logprobs": 2},
                         "application/json", config(service))
    assert isinstance(r, CompletionRequest)
    assert (r.prompt, r.echo, r.score_only, r.logprobs, r.stream) == ((7, 8), True, True, 2,
                                                                      False)
    assert r.params.max_new_tokens == 1 and r.params.sampling.prompt_logprobs == 2


def test_where_a_tool_turn_is_is_kept_for_the_template_check(service) -> None:
    turns = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "get_weather", "arguments": "{}"}}]},
             {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    r = parse_chat({"messages": turns}, "application/json", config(service))
    assert r.tool_turn == "messages[1].tool_calls" and r.messages[2]["tool_call_id"] == "c1"
    with pytest.raises(RequestError) as err:  # llama-2 has no tool format
        ChatCompletionsApi().prepare({"messages": turns}, "application/json", service)
    assert err.value.field == "messages[1].tool_calls" and err.value.status == 400
    tool_service = make_service(service.tokenizer, max_length=512, chat_template=TOOL_TEMPLATE)
    prepared = ChatCompletionsApi().prepare({"messages": turns}, "", tool_service)
    assert "sunny" in prepared.request.prompt


# --- issue 37 item 11: one rule for both APIs ---

@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_a_blank_prompt_is_refused_by_completions_as_natively(service, prompt) -> None:
    for api, body in ((CompletionsApi(), {"prompt": prompt}),
                      (CompletionsApi(), {"prompt": [prompt]}),
                      (NativeApi(), {"prompt": prompt})):
        with pytest.raises(RequestError) as err:
            api.prepare(body, "application/json", service)
        assert (err.value.field, err.value.status) == ("prompt", 400)
        assert "non-empty string" in err.value.message


def test_token_ids_that_decode_to_blanks_still_run(service) -> None:
    """Ids are what run: special tokens only (here BOS) make a valid prompt."""
    prepared = CompletionsApi().prepare({"prompt": [1]}, "", service)
    assert prepared.prompt_ids == [1]


@pytest.mark.parametrize("asked", [33, 10**9, 2**31, 10**12, 2**63, 10**30])
def test_any_integer_budget_over_the_limit_is_capped_in_every_api(service, asked) -> None:
    """The limit here is 32 (handler.max_new_tokens_limit): 10^9 and 10^12 read the same."""
    cfg = config(service)
    assert parse_request({"prompt": "hi", "max_new_tokens": asked}, cfg).max_new_tokens == 32
    assert parse_request({"prompt": "hi", "max_tokens": asked}, cfg).max_new_tokens == 32
    for api, body in ((CompletionsApi(), {"prompt": "hi", "max_tokens": asked}),
                      (ChatCompletionsApi(), {"messages": CHAT, "max_tokens": asked}),
                      (ChatCompletionsApi(), {"messages": CHAT, "max_completion_tokens": asked})):
        request = api.prepare(body, "application/json", service).request
        assert request.max_new_tokens == 32 and request.up_to_limit


@pytest.mark.parametrize("value", [0, -1, -(10**12), 1.5, 1e12, "5", True, [5]])
def test_a_budget_that_is_no_positive_integer_is_refused_by_name(service, value) -> None:
    for api, body, field in (
            (NativeApi(), {"prompt": "hi", "max_new_tokens": value}, "max_new_tokens"),
            (NativeApi(), {"prompt": "hi", "max_tokens": value}, "max_tokens"),
            (CompletionsApi(), {"prompt": "hi", "max_tokens": value}, "max_tokens"),
            (ChatCompletionsApi(), {"messages": CHAT, "max_completion_tokens": value},
             "max_completion_tokens")):
        with pytest.raises(RequestError) as err:
            api.prepare(body, "application/json", service)
        assert (err.value.field, err.value.status) == (field, 400)
        assert "[1, 32]" in err.value.message and "capped" in err.value.message


def test_a_budget_that_does_not_fit_names_the_field_as_sent(service) -> None:
    """Fitting the context (handlers/api/request.fit_to_context) names what the client sent:
    max_tokens natively too when that alias was used, messages for a chat's prompt."""
    small = make_service(service.tokenizer, max_length=40, chat_template="llama-2")
    for api, body, field in (
            (NativeApi(), {"prompt": "hi " * 30, "max_tokens": 20}, "max_tokens"),
            (NativeApi(), {"prompt": "hi " * 30, "max_new_tokens": 20}, "max_new_tokens"),
            (ChatCompletionsApi(), {"messages": CHAT, "max_completion_tokens": 32},
             "max_completion_tokens"),
            (ChatCompletionsApi(), {"messages": [{"role": "user", "content": "hi " * 50}]},
             "messages")):
        with pytest.raises(RequestError) as err:
            api.prepare(body, "application/json", small)
        assert (err.value.field, err.value.status) == (field, 400)


def test_a_chat_too_large_to_tokenize_is_refused_before_rendering(service) -> None:
    huge = [{"role": "user", "content": "hi " * 2000}]  # 6,000 chars > 64 x 64
    with pytest.raises(RequestError) as err:
        parse_chat({"messages": huge}, "application/json", config(service))
    assert err.value.field == "messages" and "refused untokenized" in err.value.message
