"""OpenAI wire formats: JSON bodies and server-sent events for completions and chat.

Framers follow handlers/framing.py's protocol, so the handler streams OpenAI
exactly as it streams the native contract. Each `chunk` is one SSE event, which
the handler sends as its own intermediate response (one event per chunk on the
wire); `final` carries the finish_reason event, the optional usage event and
`data: [DONE]`. Errors use OpenAI's shape {"error": {message, type, param, code}}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from handlers.framing import ERROR_TYPES
from handlers.scheduler import FinishEvent

DONE = "data: [DONE]\n\n"
# OpenAI answers an unknown URL with invalid_request_error; other statuses as natively
OPENAI_ERROR_TYPES = {**ERROR_TYPES, 404: "invalid_request_error"}


def error_object(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": OPENAI_ERROR_TYPES.get(status, "server_error"),
                      "param": param or None, "code": status}}


def sse(obj: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(event: FinishEvent) -> dict:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens}


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response repeats."""

    id: str
    created: int
    model: str
    chat: bool
    include_usage: bool = False

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


class OpenAIErrorFramer:
    """Frames only errors: used before a request is parsed (malformed JSON, bad path)."""

    content_type = "application/json"
    streaming = False

    def chunk(self, text: str) -> str:
        return ""

    def final(self, event: FinishEvent) -> str:
        return ""

    def error(self, status: int, message: str, field: str | None = None,
              in_stream: bool = False) -> str:
        if in_stream:  # the 200 went out: an error event, then end the stream as usual
            return sse(error_object(status, message, field)) + DONE
        return json.dumps(error_object(status, message, field), ensure_ascii=False)


class OpenAIJsonFramer(OpenAIErrorFramer):
    """Non-streaming: one `text_completion` or `chat.completion` object at the end."""

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta

    def final(self, event: FinishEvent) -> str:
        if self.meta.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": event.text},
                      "logprobs": None, "finish_reason": event.reason}
            obj = self.meta.head("chat.completion")
        else:
            choice = {"index": 0, "text": event.text, "logprobs": None,
                      "finish_reason": event.reason}
            obj = self.meta.head("text_completion")
        return json.dumps({**obj, "choices": [choice], "usage": usage(event)},
                          ensure_ascii=False)


class OpenAISseFramer(OpenAIErrorFramer):
    """Streaming: `data: {chunk}` events, the first chat delta carrying the role."""

    content_type = "text/event-stream"
    streaming = True

    def __init__(self, meta: ResponseMeta) -> None:
        self.meta = meta
        self.role_sent = False

    def _event(self, choices: list[dict], event: FinishEvent | None = None) -> str:
        obj = self.meta.head("chat.completion.chunk" if self.meta.chat else "text_completion")
        obj["choices"] = choices
        if self.meta.include_usage:  # OpenAI: null on every chunk but the last
            obj["usage"] = usage(event) if event is not None else None
        return sse(obj)

    def _choice(self, text: str, finish_reason: str | None) -> dict:
        if not self.meta.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        delta: dict[str, str] = {}
        if not self.role_sent:
            delta["role"] = "assistant"
            self.role_sent = True
        if text or "role" in delta:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def chunk(self, text: str) -> str:
        if not text:
            return ""
        return self._event([self._choice(text, None)])

    def final(self, event: FinishEvent) -> str:
        out = self._event([self._choice("", event.reason)])
        if self.meta.include_usage:
            out += self._event([], event)
        return out + DONE


def openai_framer(meta: ResponseMeta, stream: bool) -> OpenAIJsonFramer | OpenAISseFramer:
    return OpenAISseFramer(meta) if stream else OpenAIJsonFramer(meta)
