"""Bad input, 30+ kinds per API, through TorchServe's own worker-side decoding and the handler.

Each raw body goes the way the frontend sends it: encoded as ModelRequestEncoder does
(pytorch/serve@v0.12.0:frontend/server/src/main/java/org/pytorch/serve/util/codec/
ModelRequestEncoder.java:64-106), read back by TorchServe's real `retrieve_msg` (which
parses application/json itself, or forwards the raw bytes when that fails:
ts/protocol/otf_message_handler.py:332-343) and batched by the real
`Service.retrieve_data_for_inference`. All of them, bad and good, go through one `handle`
call: each bad one must get a complete 4xx JSON naming its field, the good ones 200.
"""

from __future__ import annotations

import asyncio
import json
import struct
from types import SimpleNamespace

import pytest
from ts.context import Context
from ts.protocol.otf_message_handler import create_predict_response, retrieve_msg
from ts.service import Service

from handlers.api.request import check_length
from handlers.backends.base import Capabilities
from handlers.config import parse_config
from handlers.engine.messages import ModelLimits
from handlers.engine.scheduler import FinishEvent, TextEvent
from handlers.torchserve.generation_handler import GenerationHandler
from tests.unit.test_openai_api import make_tokenizer
from tests.unit.ts_frontend import decode, http_view

JSON = "application/json"
DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def body(obj: dict) -> bytes:
    return json.dumps(obj).encode()


def raw(text: str) -> bytes:
    """JSON written by hand: lone surrogates, NaN, huge integers."""
    return text.encode()


P = {"prompt": "hi there"}
NATIVE_BAD = [  # (name, raw body, content type, field)
    ("nested 100,000 deep", DEEP, JSON, "body"),
    ("20 MB prompt", body({"prompt": "hi " * 7_000_000}), JSON, "prompt"),
    ("lone surrogate in prompt", raw('{"prompt": "hi \\ud800"}'), JSON, "prompt"),
    ("lone low surrogate", raw('{"prompt": "\\udfff there"}'), JSON, "prompt"),
    ("lone surrogate in stop", raw('{"prompt": "hi", "stop": ["\\ud83d"]}'), JSON, "stop[0]"),
    ("lone surrogate in a key", raw('{"prompt": "hi", "\\ud800": 1}'), JSON, "body"),
    ("surrogate as raw bytes", b'{"prompt": "\xed\xa0\x80"}', JSON, "body"),
    ("bool max_new_tokens", body({**P, "max_new_tokens": True}), JSON, "max_new_tokens"),
    ("1.5 max_new_tokens", body({**P, "max_new_tokens": 1.5}), JSON, "max_new_tokens"),
    ("max_new_tokens 0", body({**P, "max_new_tokens": 0}), JSON, "max_new_tokens"),
    ("max_new_tokens -1", body({**P, "max_new_tokens": -1}), JSON, "max_new_tokens"),
    ("max_new_tokens string", body({**P, "max_new_tokens": "5"}), JSON, "max_new_tokens"),
    ("max_new_tokens null", body({**P, "max_new_tokens": None}), JSON, "max_new_tokens"),
    ("seed 2**64", body({**P, "seed": 2**64}), JSON, "seed"),
    ("seed of 5000 digits", raw('{"prompt": "hi", "seed": ' + "9" * 5000 + "}"), JSON, "body"),
    ("bool seed", body({**P, "seed": False}), JSON, "seed"),
    ("1,000 stop strings", body({**P, "stop": [f"s{i}" for i in range(1000)]}), JSON, "stop"),
    ("empty stop string", body({**P, "stop": ""}), JSON, "stop"),
    ("empty stop in a list", body({**P, "stop": ["a", ""]}), JSON, "stop"),
    ("stop of 10,000 chars", body({**P, "stop": "x" * 10_000}), JSON, "stop"),
    ("stop a number", body({**P, "stop": 5}), JSON, "stop"),
    ("temperature NaN", raw('{"prompt": "hi", "temperature": NaN}'), JSON, "temperature"),
    ("temperature Infinity", raw('{"prompt": "hi", "temperature": Infinity}'), JSON,
     "temperature"),
    ("bool temperature", body({**P, "temperature": True}), JSON, "temperature"),
    ("top_p 0", body({**P, "top_p": 0}), JSON, "top_p"),
    ("top_k 1.5", body({**P, "top_k": 1.5}), JSON, "top_k"),
    ("min over max", body({**P, "max_new_tokens": 2, "min_new_tokens": 3}), JSON,
     "min_new_tokens"),
    ("stream a string", body({**P, "stream": "yes"}), JSON, "stream"),
    ("stream_format sse", body({**P, "stream_format": "sse"}), JSON, "stream_format"),
    ("details 1", body({**P, "details": 1}), JSON, "details"),
    ("timeout 0", body({**P, "timeout": 0}), JSON, "timeout"),
    ("timeout over the cap", body({**P, "timeout": 3601}), JSON, "timeout"),
    ("bool timeout", body({**P, "timeout": True}), JSON, "timeout"),
    ("unknown field", body({**P, "max_token": 3}), JSON, "max_token"),
    ("no prompt", body({"max_new_tokens": 3}), JSON, "prompt"),
    ("blank prompt", body({"prompt": "  "}), JSON, "prompt"),
    ("prompt a list", body({"prompt": ["hi"]}), JSON, "prompt"),
    ("a JSON array", body([1, 2]), JSON, "body"),  # type: ignore[arg-type]
    ("malformed JSON", b'{"prompt": ', JSON, "body"),
    ("empty body", b"", JSON, "body"),
    ("invalid UTF-8 text", b"\xff\xfe", "text/plain", "body"),
    ("too many tokens", body({"prompt": "hi " * 600}), JSON, "prompt"),
]

C = {"model": "tiny", "prompt": "hi there"}
M = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}]}
COMPLETIONS, CHAT = "v1/completions", "v1/chat/completions"
OPENAI_BAD = [  # (name, raw body, url path, param)
    ("nested 100,000 deep", DEEP, COMPLETIONS, None),
    ("20 MB prompt", body({**C, "prompt": "hi " * 7_000_000}), COMPLETIONS, "prompt"),
    ("20 MB message", body({**M, "messages": [{"role": "user", "content": "hi " * 7_000_000}]}),
     CHAT, "messages"),
    ("lone surrogate in prompt", raw('{"prompt": "hi \\ud800"}'), COMPLETIONS, "prompt"),
    ("lone surrogate in content", raw('{"messages": [{"role": "user", "content": "\\udc00"}]}'),
     CHAT, "messages[0].content"),
    ("lone surrogate in model", raw('{"model": "\\ud800", "prompt": "hi"}'), COMPLETIONS,
     "model"),
    ("bool max_tokens", body({**C, "max_tokens": True}), COMPLETIONS, "max_tokens"),
    ("1.5 max_tokens", body({**C, "max_tokens": 1.5}), COMPLETIONS, "max_tokens"),
    ("max_tokens 0", body({**C, "max_tokens": 0}), COMPLETIONS, "max_tokens"),
    ("chat max_tokens 0", body({**M, "max_tokens": 0}), CHAT, "max_tokens"),
    ("max_completion_tokens 1.5", body({**M, "max_completion_tokens": 1.5}), CHAT,
     "max_completion_tokens"),
    ("seed 2**64", body({**C, "seed": 2**64}), COMPLETIONS, "seed"),
    ("1,000 stop strings", body({**C, "stop": [f"s{i}" for i in range(1000)]}), COMPLETIONS,
     "stop"),
    ("empty stop string", body({**M, "stop": ""}), CHAT, "stop"),
    ("unknown role", body({**M, "messages": [{"role": "wizard", "content": "hi"}]}), CHAT,
     "messages[0].role"),
    ("empty messages", body({**M, "messages": []}), CHAT, "messages"),
    ("messages an object", body({**M, "messages": {"role": "user"}}), CHAT, "messages"),
    ("message a string", body({**M, "messages": ["hi"]}), CHAT, "messages[0]"),
    ("image part", body({**M, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}), CHAT, "messages[0].content"),
    ("empty parts", body({**M, "messages": [{"role": "user", "content": []}]}), CHAT,
     "messages[0].content"),
    ("null content", body({**M, "messages": [{"role": "user", "content": None}]}), CHAT,
     "messages[0].content"),
    ("tool_calls", body({**M, "messages": [{"role": "user", "content": "hi",
                                             "tool_calls": []}]}), CHAT,
     "messages[0].tool_calls"),
    ("n true", body({**C, "n": True}), COMPLETIONS, "n"),
    ("n 2", body({**C, "n": 2}), COMPLETIONS, "n"),
    ("frequency_penalty false", body({**C, "frequency_penalty": False}), COMPLETIONS,
     "frequency_penalty"),
    ("logprobs 'yes'", body({**M, "logprobs": "yes"}), CHAT, "logprobs"),
    ("another model", body({**M, "model": "gpt-4"}), CHAT, "model"),
    ("temperature -1", body({**C, "temperature": -1}), COMPLETIONS, "temperature"),
    ("top_p 2", body({**M, "top_p": 2}), CHAT, "top_p"),
    ("stream a string", body({**C, "stream": "yes"}), COMPLETIONS, "stream"),
    ("stream_options alone", body({**C, "stream_options": {"include_usage": True}}),
     COMPLETIONS, "stream_options"),
    ("unknown field", body({**C, "max_token": 3}), COMPLETIONS, "max_token"),
    ("model a number", body({**C, "model": 5}), COMPLETIONS, "model"),
    ("two prompts", body({**C, "prompt": ["a", "b"]}), COMPLETIONS, "prompt"),
    ("two prompts", body({**C, "prompt": [[1, 2], [3]]}), COMPLETIONS, "prompt"),
    ("token id outside the vocabulary", body({**C, "prompt": [1, 10**6]}), COMPLETIONS, "prompt"),
    ("timeout 0", body({**C, "timeout": 0}), COMPLETIONS, "timeout"),
    ("timeout a string", body({**M, "timeout": "5"}), CHAT, "timeout"),
    ("tools", body({**M, "tools": [{"type": "function"}]}), CHAT, "tools[0].function"),
    ("min_tokens over max", body({**C, "max_tokens": 2, "min_tokens": 3}), COMPLETIONS,
     "min_tokens"),
    ("malformed JSON", b'{"prompt": ', COMPLETIONS, None),
    ("empty body", b"", CHAT, None),
    ("too many tokens", body({**C, "prompt": "hi " * 600}), COMPLETIONS, "prompt"),
]
GOOD = [  # (raw body, url path): must stream or answer 200 beside the bad ones
    (body({"prompt": "hi there", "max_new_tokens": 2}), ""),
    (body({"prompt": "hi", "stop": ["x"], "timeout": 5, "seed": 2**63 - 1}), ""),
    (body({**C, "max_tokens": 2, "timeout": 2.5}), COMPLETIONS),
    # a list of text parts is valid OpenAI: accepted and joined
    (body({**M, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                          {"type": "text", "text": "there"}]}]}),
     CHAT),
]


def frontend_message(requests: list[tuple[bytes, str, str]]) -> bytes:
    """An inference message as the frontend encodes it: id, headers, the `body` parameter."""
    def field(text: str | bytes) -> bytes:
        data = text.encode() if isinstance(text, str) else text
        return struct.pack("!i", len(data)) + data

    out = bytearray(b"I")
    for i, (data, content_type, url_path) in enumerate(requests):
        out += field(f"req-{i}")
        for name, value in (("url_path", url_path), ("content-type", content_type)):
            out += field(name) + field(value)
        out += struct.pack("!i", -1)
        out += field("body") + field(content_type) + field(data) + struct.pack("!i", -1)
    return bytes(out + struct.pack("!i", -1))


class Conn:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.sent = data, 0, b""

    def recv(self, n: int) -> bytes:
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def sendall(self, data: bytes) -> None:
        self.sent += data


class FakeService:
    """The handler's view of GenerationService: real tokenizer, canned generation."""

    def __init__(self) -> None:
        self.config = parse_config({"handler": {"max_length": 64, "max_new_tokens_limit": 32,
                                                "chat_template": "llama-2",
                                                "defaults": {"max_new_tokens": 8}}})
        self.tokenizer = make_tokenizer()
        self.tokenizer.name_or_path = "/archive/tiny"  # served as "tiny" (no MANIFEST above)
        self.limits = ModelLimits(1, 64, None, Capabilities())
        self.engine = SimpleNamespace(cancel=lambda request_id: None, down=None)
        self.submitted: list = []

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def submit(self, request_id, request, prompt_ids, loop, on_text=None) -> asyncio.Queue:
        check_length(len(prompt_ids), request.max_new_tokens, 64)  # as GenerationService does
        self.submitted.append(request)
        events: asyncio.Queue = asyncio.Queue()
        for event in (TextEvent("ok"), FinishEvent("length", len(prompt_ids), 1, "ok")):
            events.put_nowait(event)
        return events


def serve(requests: list[tuple[bytes, str, str]]):
    """All requests through TorchServe's worker side and one `handle` call; their views."""
    conn = Conn(frontend_message(requests))
    _, batch = retrieve_msg(conn)
    headers, data, ids = Service.retrieve_data_for_inference(batch)
    handler = GenerationHandler()
    handler.service = FakeService()
    context = Context("tiny", "/m", {}, len(batch), None, "0.12.0")
    context.request_processor, context.request_ids, context.cl_socket = headers, ids, conn
    ret = asyncio.run(handler.handle(data, context))
    conn.sendall(create_predict_response(ret, ids, "Prediction success", 200, context))
    predictions = decode(conn.sent)
    return [http_view([p for p in predictions if p.request_id == f"req-{i}"])
            for i in range(len(requests))], handler.service


def check(views, expected_fields, names) -> None:
    for view, expected, name in zip(views, expected_fields, names, strict=True):
        assert view.status is not None and 400 <= view.status < 500, (name, view)
        assert view.complete and view.forgotten, name
        assert view.headers["content-type"] == "application/json", name
        error = json.loads(view.body)["error"]
        assert error.get("field", error.get("param")) == expected, (name, error)


def check_good(views) -> None:
    for view in views:
        assert (view.status, view.complete, view.forgotten) == (200, True, True), view
        assert b"ok" in view.body


def test_native_bad_input_gets_400_naming_the_field_beside_good_requests():
    assert len(NATIVE_BAD) >= 30
    good = [(data, JSON, path) for data, path in GOOD]
    views, service = serve([(data, ct, "") for _, data, ct, _ in NATIVE_BAD] + good)
    check(views[:len(NATIVE_BAD)], [f for *_, f in NATIVE_BAD], [n for n, *_ in NATIVE_BAD])
    check_good(views[len(NATIVE_BAD):])
    assert len(service.submitted) == len(GOOD)  # nothing bad reached the engine


def test_openai_bad_input_gets_400_naming_the_param_beside_good_requests():
    assert len(OPENAI_BAD) >= 30
    good = [(data, JSON, path) for data, path in GOOD]
    views, service = serve([(data, JSON, path) for _, data, path, _ in OPENAI_BAD] + good)
    check(views[:len(OPENAI_BAD)], [f for *_, f in OPENAI_BAD], [n for n, *_ in OPENAI_BAD])
    check_good(views[len(OPENAI_BAD):])
    chat = service.submitted[-1]
    assert chat.prompt.endswith("hi\nthere [/INST]")  # the text parts, joined


@pytest.mark.parametrize("text", ['{"prompt": "hi", "timeout": 2.5}'])
def test_timeout_field_sets_the_deadline_and_the_config_supplies_the_default(text):
    views, service = serve([(raw(text), JSON, ""), (body(P), JSON, "")])
    check_good(views)
    assert [r.timeout_s for r in service.submitted] == [2.5, 300.0]
