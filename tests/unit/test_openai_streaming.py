"""One chat answer, every way it can be asked for: the same content and calls.

The handler runs with TorchServe's real worker-side encoder (tests/unit/ts_frontend.py
plays the Java frontend) and a service whose engine delivers scripted text through the
real QueueSink: to the writer's callback, or on the queue when the framer counts tokens
(continuous usage). Whatever the stream options (include_usage, continuous_usage_stats),
tools and logprobs, the streamed answer must carry the non-streamed answer's content,
calls, finish_reason and logprobs, whole and in order, before `[DONE]`; and no model text
-- a malformed call, a call of a tool nobody offered -- fails the request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from types import SimpleNamespace

import pytest
from ts.context import Context, RequestProcessor
from ts.protocol.otf_message_handler import create_predict_response

from handlers.backends import capabilities_for
from handlers.config import parse_config
from handlers.engine.core import QueueSink
from handlers.engine.messages import ModelLimits
from handlers.engine.scheduler import ErrorEvent, FinishEvent, TextEvent
from handlers.torchserve.generation_handler import GenerationHandler
from tests.unit.test_openai_api import make_tokenizer
from tests.unit.test_tool_calls import ASK, CLOCK, TOOL_TEMPLATE, WEATHER
from tests.unit.ts_frontend import decode, http_view

#: model answers as the engine streams them, piece by piece
ANSWERS = {
    "call": ["<|python_tag|>", '{"name": "get_', 'weather", "parameters": ',
             '{"city": "Paris"}}'],
    "two calls": ['{"name": "get_time", "parameters": {}}', ";", ' {"name": "get_weather", ',
                  '"parameters": {"city": "Oslo"}}'],
    "prose": [" It is", " sunny", " in Paris."],
    # issue 36: a call followed by another JSON value failed the whole request
    "call then a number": ['{"name": "get_weather", "parameters": {"city": "Paris"}}', "; 42"],
    "call then a list": ['{"name": "get_weather", "parameters": {}}', ' ["x"]'],
    "unknown tool": ['{"name": "launch_rockets", ', '"parameters": {}}'],
    "cut short": ['{"name": "get_weather", "parameters": {"ci'],
}


class ScriptedService:
    """GenerationService's surface, with a real tokenizer and tool template; `submit`
    delivers the scripted answer through the engine's QueueSink, all in one step or one
    piece per step."""

    def __init__(self, pieces: list[str], per_step: bool, reason: str = "stop") -> None:
        self.config = parse_config({"handler": {
            "max_length": 512, "max_new_tokens_limit": 64, "chat_template": TOOL_TEMPLATE}})
        self.tokenizer = TOKENIZER
        self.limits = ModelLimits(1, 512, None, capabilities_for(self.config.handler))
        self.engine = SimpleNamespace(cancel=lambda request_id: None, down=None)
        self.clients: dict[str, str] = {}
        self.pieces, self.per_step, self.reason = pieces, per_step, reason

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def submit(self, request_id, request, prompt_ids, loop, on_text=None) -> asyncio.Queue:
        sink = QueueSink(loop, asyncio.Queue(), on_text)
        ids = tuple(7 + i % 5 for i in range(len(self.pieces)))  # one token per piece
        k = request.sampling.logprobs
        logprobs = None if k is None else tuple(
            (-0.25 * (i + 1), tuple((t, -0.25 * (i + 1)) for t in ids[:k]))
            for i in range(len(ids)))
        events = [TextEvent(p, tokens=i + 1) for i, p in enumerate(self.pieces)]
        events.append(FinishEvent(self.reason, len(prompt_ids), len(ids), "".join(self.pieces),
                                  ids, logprobs))
        if self.per_step:  # the engine's steps: one callback each, as deliver() makes them
            for event in events:
                QueueSink.put_all(loop, [(sink, event)])
        else:
            QueueSink.put_all(loop, [(sink, e) for e in events])
        return sink.queue


class Socket:
    def __init__(self) -> None:
        self.sent = b""

    def sendall(self, data: bytes) -> None:
        self.sent += data


def ask(service: ScriptedService, body: dict, status: int = 200):
    """One chat request through the handler, as its client sees it."""
    handler = GenerationHandler()
    handler.service = service
    context = Context("tiny", "/m", {}, 1, None, "0.12.0")
    context.request_processor = [RequestProcessor({"url_path": "v1/chat/completions"})]
    context.request_ids = {0: "req-1"}
    context.cl_socket = Socket()
    ret = asyncio.run(handler.handle([{"body": {"messages": ASK, **body}}], context))
    context.cl_socket.sendall(create_predict_response(ret, context.request_ids,
                                                      "Prediction success", 200, context))
    view = http_view(decode(context.cl_socket.sent))
    assert (view.status, view.complete, view.forgotten) == (status, True, True), view.body[:300]
    return view


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in tool_calls or ()]


def whole(view) -> dict:
    body = json.loads(view.body)
    choice = body["choices"][0]
    return {"content": choice["message"]["content"] or "",
            "calls": calls_of(choice["message"].get("tool_calls")),
            "finish_reason": choice["finish_reason"],
            "logprobs": (choice["logprobs"] or {}).get("content"), "usage": body["usage"]}


def streamed(view, include_usage: bool, continuous: bool) -> dict:
    """The SSE answer accumulated as OpenAI clients accumulate it; checks its framing."""
    wire = view.body.decode()
    assert view.headers["content-type"] == "text/event-stream"
    assert wire.endswith("data: [DONE]\n\n") and wire.count("[DONE]") == 1
    events = [json.loads(e[len("data: "):]) for e in wire.split("\n\n")
              if e.startswith("data: {")]
    out: dict = {"content": "", "calls": [], "finish_reason": None, "logprobs": None,
                 "usage": None}
    for i, event in enumerate(events):
        assert "error" not in event, event
        if continuous:  # vLLM's continuous_usage_stats: counts on every chunk
            assert event["usage"]["prompt_tokens"] > 0
        elif include_usage and i < len(events) - 1:
            assert event["usage"] is None  # OpenAI: null on every chunk but the last
        else:
            assert "usage" not in event or i == len(events) - 1
        if not event["choices"]:  # the usage chunk
            assert include_usage and i == len(events) - 1
            out["usage"] = event["usage"]
            continue
        choice = event["choices"][0]
        assert out["finish_reason"] is None, "nothing after the finish_reason chunk"
        delta = choice["delta"]
        out["content"] += delta.get("content") or ""
        out["calls"] += calls_of(delta.get("tool_calls"))
        if choice.get("logprobs"):
            out["logprobs"] = (out["logprobs"] or []) + choice["logprobs"]["content"]
        out["finish_reason"] = choice["finish_reason"]
    return out


TOKENIZER = make_tokenizer()
OPTIONS = list(itertools.product((False, True), repeat=2))  # include_usage, continuous


@pytest.mark.parametrize("per_step", [False, True], ids=["one step", "a step per piece"])
@pytest.mark.parametrize("answer", list(ANSWERS))
def test_every_stream_option_gives_the_non_streamed_answer(answer, per_step) -> None:
    pieces = ANSWERS[answer]
    for logprobs, tools in itertools.product((False, True), repeat=2):
        body: dict = {"tools": [WEATHER, CLOCK]} if tools else {}
        if logprobs:
            body.update(logprobs=True, top_logprobs=2)
        expected = whole(ask(ScriptedService(pieces, per_step), body))
        if not tools or answer not in ("call", "two calls"):  # the model's text, as it is
            assert (expected["content"], expected["calls"]) == ("".join(pieces), [])
            assert expected["finish_reason"] == "stop"
        for include_usage, continuous in OPTIONS:
            options = {"include_usage": include_usage, "continuous_usage_stats": continuous}
            view = ask(ScriptedService(pieces, per_step),
                       {**body, "stream": True, "stream_options": options})
            got = streamed(view, include_usage, continuous and include_usage)
            where = f"{answer}: tools={tools} logprobs={logprobs} {options}"
            for key in ("content", "calls", "finish_reason", "logprobs"):
                assert got[key] == expected[key], f"{where}: {key}"
            if include_usage:
                assert got["usage"] == expected["usage"], where


@pytest.mark.parametrize("answer", ["call then a number", "call then a list", "unknown tool",
                                    "cut short"])
def test_text_that_is_no_whole_call_is_the_answers_content_never_a_failure(answer) -> None:
    """Issue 36: `{...call...}; 42` was a 500 (not streamed) and a bare JSON error line in
    a 200 event stream (streamed), with no finish_reason and no [DONE]."""
    text = "".join(ANSWERS[answer])
    body = {"tools": [WEATHER], "tool_choice": "auto"}
    plain = json.loads(ask(ScriptedService(ANSWERS[answer], False), body).body)
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert plain["choices"][0]["finish_reason"] == "stop"
    view = ask(ScriptedService(ANSWERS[answer], False), {**body, "stream": True})
    got = streamed(view, False, False)
    assert (got["content"], got["calls"], got["finish_reason"]) == (text, [], "stop")


def test_a_call_cut_short_by_max_tokens_is_content_with_finish_reason_length() -> None:
    pieces = ANSWERS["cut short"]
    view = ask(ScriptedService(pieces, True, reason="length"),
               {"tools": [WEATHER], "stream": True})
    got = streamed(view, False, False)
    assert (got["content"], got["calls"], got["finish_reason"]) == ("".join(pieces), [],
                                                                    "length")


def test_an_error_while_a_call_is_held_back_is_a_proper_status() -> None:
    """Nothing went out (the framer held the text): the client gets the error's status."""
    class Failing(ScriptedService):
        def submit(self, request_id, request, prompt_ids, loop, on_text=None):
            sink = QueueSink(loop, asyncio.Queue(), on_text)
            QueueSink.put_all(loop, [(sink, TextEvent('{"name": "get_', 1)),
                                     (sink, ErrorEvent(504, "the deadline passed"))])
            return sink.queue

    view = ask(Failing([], False), {"tools": [WEATHER], "stream": True}, status=504)
    assert json.loads(view.body)["error"]["message"] == "the deadline passed"
