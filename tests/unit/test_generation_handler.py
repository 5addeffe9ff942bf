"""Every answer the handler gives, as TorchServe 0.12's frontend turns it into HTTP.

The handler runs with TorchServe's real Python worker side (Context, message encoder)
and a fake service; tests/unit/ts_frontend.py plays the Java frontend. Each answer
must reach its client whole, with its status and headers, and leave the frontend's
in-flight map (else the frontend keeps it for good: issue 12).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from ts.context import Context, RequestProcessor
from ts.protocol.otf_message_handler import create_predict_response

from handlers.backends.base import Capabilities
from handlers.config import parse_config
from handlers.engine.messages import ModelLimits
from handlers.engine.scheduler import ErrorEvent, FinishEvent, TextEvent
from handlers.errors import CapacityError
from handlers.torchserve.generation_handler import GenerationHandler
from handlers.torchserve.service import GenerationService
from tests.unit.ts_frontend import HttpView, decode, http_view

DONE = FinishEvent("length", 3, 2, "Hi!")


class Socket:
    def __init__(self) -> None:
        self.sent = b""

    def sendall(self, data: bytes) -> None:
        self.sent += data


class FakeService:
    """What the handler asks of GenerationService; submit replays canned events."""

    def __init__(self, events: list, full: bool = False) -> None:
        self.config = parse_config({"handler": {}})
        self.limits = ModelLimits(1, 512, None, Capabilities())
        self.tokenizer = SimpleNamespace(name_or_path="tiny")
        self.engine = SimpleNamespace(cancel=lambda request_id: None, down=None)
        self.events, self.full = events, full

    def encode(self, prompt: str) -> list[int]:
        return [ord(c) for c in prompt]

    def submit(self, request_id, request, prompt_ids, loop, on_text=None) -> asyncio.Queue:
        if self.full:
            raise CapacityError("3 requests are waiting (handler.max_queue=3)", retry_after_s=2)
        events: asyncio.Queue = asyncio.Queue()
        for event in self.events:
            events.put_nowait(event)
        return events


def answer(body: dict | bytes, events: list | None = None, url_path: str = "",
           full: bool = False) -> HttpView:
    """One request through the handler and TorchServe's async worker, as the client sees it."""
    handler = GenerationHandler()
    handler.service = FakeService([TextEvent("Hi"), TextEvent("!"), DONE]
                                  if events is None else events, full)
    context = Context("tiny", "/m", {}, 1, None, "0.12.0")
    context.request_processor = [RequestProcessor({"url_path": url_path})]
    context.request_ids = {0: "req-1"}
    context.cl_socket = Socket()
    ret = asyncio.run(handler.handle([{"body": body}], context))
    # what ts/async_service.py:91-93 sends once `handle` returns
    context.cl_socket.sendall(create_predict_response(ret, context.request_ids,
                                                      "Prediction success", 200, context))
    return http_view(decode(context.cl_socket.sent))


NATIVE = {"prompt": "Hello", "max_new_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}


@pytest.mark.parametrize("name, body, url_path, content_type", [
    ("native json", {**NATIVE, "stream": False}, "", "application/json"),
    ("native text stream", NATIVE, "", "text/plain; charset=utf-8"),
    ("native ndjson stream", {**NATIVE, "stream_format": "ndjson"}, "", "application/x-ndjson"),
    ("openai json", COMPLETION, "v1/completions", "application/json"),
    ("openai sse", {**COMPLETION, "stream": True}, "v1/completions", "text/event-stream"),
    ("model listing", {}, "v1/models", "application/json"),
])
def test_successes_arrive_whole_as_a_chunked_200_and_leave_the_map(name, body, url_path,
                                                                   content_type):
    view = answer(body, url_path=url_path)
    assert view.forgotten, name
    assert (view.status, view.framing, view.complete) == (200, "chunked", True)
    assert view.headers["content-type"] == content_type
    text = view.body.decode()
    if name == "native json":
        assert json.loads(text) == {"text": "Hi!", "finish_reason": "length",
                                    "prompt_tokens": 3, "completion_tokens": 2}
    elif name == "native text stream":
        assert text == "Hi!"
    elif name == "openai json":
        assert json.loads(text)["choices"][0]["text"] == "Hi!"
    elif name == "openai sse":
        assert text.endswith("data: [DONE]\n\n") and '"text": "Hi!"' in text
    elif name == "model listing":
        assert json.loads(text)["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("body, url_path, status, field", [
    ({**NATIVE, "temperature": -1}, "", 400, "temperature"),
    (b'{"prompt": ', "", 400, "body"),
    ({**COMPLETION, "max_tokens": -1}, "v1/completions", 400, "max_tokens"),
    (COMPLETION, "v1/embeddings", 404, None),
    (NATIVE, "v2/nothing", 404, None),  # any path is an OpenAI client's: OpenAI's shape
])
def test_bad_requests_get_a_complete_error_and_leave_the_map(body, url_path, status, field):
    view = answer(body, url_path=url_path)
    assert view.forgotten
    assert (view.status, view.framing, view.complete) == (status, "content-length", True)
    assert view.headers["content-type"] == "application/json"
    error = json.loads(view.body)["error"]
    assert error.get("field", error.get("param")) == field


@pytest.mark.parametrize("body, url_path", [(NATIVE, ""), (COMPLETION, "v1/completions")])
def test_a_full_queue_answers_503_with_retry_after_and_leaves_the_map(body, url_path):
    view = answer(body, url_path=url_path, full=True)
    assert view.forgotten
    assert (view.status, view.framing, view.complete) == (503, "content-length", True)
    assert view.headers["retry-after"] == "2"
    assert "max_queue" in json.loads(view.body)["error"]["message"]


def test_a_failure_before_the_first_chunk_is_a_complete_500():
    view = answer({**NATIVE, "stream": False}, [ErrorEvent(500, "generation failed (prefill)")])
    assert view.forgotten and (view.status, view.complete) == (500, True)
    assert json.loads(view.body)["error"]["message"] == "generation failed (prefill)"


def test_a_failure_after_the_first_chunk_is_reported_in_band():
    view = answer({**NATIVE, "stream_format": "ndjson"},
                  [TextEvent("Hi"), ErrorEvent(500, "generation failed (decode)")])
    assert view.forgotten and (view.status, view.complete) == (200, True)
    lines = [json.loads(line) for line in view.body.decode().splitlines()]
    assert lines[0] == {"text": "Hi"} and lines[-1]["error"]["code"] == 500


def test_a_stream_that_generates_no_text_still_opens_and_ends():
    view = answer(NATIVE, [FinishEvent("stop", 3, 1, "")])
    assert view.forgotten and (view.status, view.framing, view.complete) == (200, "chunked", True)
    assert view.body == b""


def test_the_fake_frontend_keeps_a_plain_answer_in_flight():
    """The rule the handler works around, as ts_frontend models it: a message without
    ts_stream_next is a complete response the frontend never forgets."""
    context = Context("tiny", "/m", {}, 1, None, "0.12.0")
    context.request_processor = [RequestProcessor({})]
    view = http_view(decode(create_predict_response(["{}"], {0: "r"}, "ok", 200, context)))
    assert (view.status, view.complete, view.forgotten) == (200, True, False)


def test_the_chunks_of_one_step_leave_in_one_message_and_each_stream_stays_whole():
    """Two streams' text of one engine step arrives in one loop callback (QueueSink.put_all):
    one message, one sendall, holding a prediction for each; the ends come after."""
    calls: list[bytes] = []
    sock = SimpleNamespace(sendall=calls.append)
    texts: dict = {}

    class Service(FakeService):
        def submit(self, request_id, request, prompt_ids, loop, on_text=None):
            texts[request_id] = (on_text, asyncio.Queue())
            return texts[request_id][1]

    handler = GenerationHandler()
    handler.service = Service([])

    def context(request_id):
        ctx = Context("tiny", "/m", {}, 1, None, "0.12.0")
        ctx.request_processor = [RequestProcessor({"url_path": ""})]
        ctx.request_ids, ctx.cl_socket = {0: request_id}, sock
        return ctx

    async def main():
        contexts = [context(f"r{i}") for i in range(2)]
        tasks = [asyncio.create_task(handler.handle([{"body": NATIVE}], c)) for c in contexts]
        while len(texts) < 2:
            await asyncio.sleep(0)
        for step in "ab":
            for rid, (on_text, _) in texts.items():  # one step's events: one callback
                on_text(f"{step}{rid} ")
            await asyncio.sleep(0)  # the loop's next iteration sends them
        for _, events in texts.values():
            events.put_nowait(DONE)
        rets = await asyncio.gather(*tasks)
        for ctx, ret in zip(contexts, rets, strict=True):  # as ts/async_service.py:91-93
            sock.sendall(create_predict_response(ret, ctx.request_ids, "Prediction success",
                                                 200, ctx))

    asyncio.run(main())
    assert [sorted(p.request_id for p in decode(m)) for m in calls[:2]] == [["r0", "r1"]] * 2
    everything = decode(b"".join(calls))
    for rid in ("r0", "r1"):
        view = http_view([p for p in everything if p.request_id == rid])
        assert (view.status, view.framing, view.complete, view.forgotten) == (
            200, "chunked", True, True)
        assert view.body.decode() == f"a{rid} b{rid} "


def test_the_routers_cancel_ends_the_request_it_named_while_it_runs():
    """The OpenAI router names each request (x-inf2serve-client-id); when its client leaves
    it POSTs that name to inf2serve/cancel, and the running request is cancelled."""
    handler = GenerationHandler()
    service = FakeService([])
    cancelled: list[str] = []
    service.engine = SimpleNamespace(cancel=cancelled.append, down=None)
    service.clients = {}
    service.cancel_client = lambda client_id: (
        GenerationService.cancel_client(service, client_id))
    handler.service = service

    def context(url_path: str, headers: dict, request_id: str) -> Context:
        ctx = Context("tiny", "/m", {}, 1, None, "0.12.0")
        ctx.request_processor = [RequestProcessor({"url_path": url_path, **headers})]
        ctx.request_ids = {0: request_id}
        ctx.cl_socket = Socket()
        return ctx

    async def main() -> tuple[HttpView, HttpView]:
        events: asyncio.Queue = asyncio.Queue()
        service.submit = lambda *args, **kwargs: events  # runs until its queue ends
        running = asyncio.ensure_future(handler.handle(
            [{"body": NATIVE}], context("", {"X-Inf2serve-Client-Id": "c1"}, "req-1")))
        await asyncio.sleep(0.05)
        assert service.clients == {"c1": "req-1"}
        cancel = context("inf2serve/cancel", {}, "req-2")
        ret = await handler.handle([{"body": json.dumps({"client_id": "c1"}).encode()}],
                                   cancel)
        cancel.cl_socket.sendall(create_predict_response(ret, cancel.request_ids, "ok", 200,
                                                         cancel))
        events.put_nowait(ErrorEvent(499, "cancelled"))  # what the engine then sends
        await running
        again = context("inf2serve/cancel", {}, "req-3")
        ret = await handler.handle([{"body": {"client_id": "c1"}}], again)
        again.cl_socket.sendall(create_predict_response(ret, again.request_ids, "ok", 200,
                                                        again))
        return (http_view(decode(cancel.cl_socket.sent)),
                http_view(decode(again.cl_socket.sent)))

    first, second = asyncio.run(main())
    assert cancelled == ["req-1"] and service.clients == {}
    assert json.loads(first.body) == {"cancelled": True}
    assert json.loads(second.body) == {"cancelled": False}  # it ended: nothing to cancel
