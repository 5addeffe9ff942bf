"""How generated text is framed on the wire, one class per format.

A framer turns events into bytes for one request: `chunk` for streamed text,
`final` for the last piece of a stream (or the whole body when not streaming),
`error` for a failure. The handler never formats text itself, so a new wire
format (e.g. OpenAI server-sent events) is one more framer.
"""

from __future__ import annotations

import json
from typing import Protocol

from handlers.engine.scheduler import FinishEvent

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 499: "cancelled", 503: "overloaded_error",
               504: "timeout"}


def usage(event: FinishEvent, details: bool) -> dict:
    out = {"finish_reason": event.reason, "prompt_tokens": event.prompt_tokens,
           "completion_tokens": event.completion_tokens}
    if details:
        out["token_ids"] = list(event.token_ids)
    return out


def error_body(status: int, message: str, field: str | None = None) -> dict:
    return {"error": {"code": status, "type": ERROR_TYPES.get(status, "server_error"),
                      "field": field, "message": message}}


class Framer(Protocol):
    content_type: str
    streaming: bool

    def chunk(self, text: str) -> str: ...

    def final(self, event: FinishEvent) -> str: ...

    def error(self, status: int, message: str, field: str | None = None,
              in_stream: bool = False) -> str: ...


class TextFramer:
    """Raw text chunks: what `curl -N` users read."""

    content_type = "text/plain; charset=utf-8"
    streaming = True

    def chunk(self, text: str) -> str:
        return text

    def final(self, event: FinishEvent) -> str:
        return ""

    def error(self, status: int, message: str, field: str | None = None,
              in_stream: bool = False) -> str:
        if in_stream:  # the 200 status has gone out; say it in the text
            return f"\n[error {status}: {message}]\n"
        return json.dumps(error_body(status, message, field))


class NdjsonFramer:
    """One JSON object per line; the last one carries finish_reason and usage.

    Each `chunk` frames all the text one HTTP chunk carries, so every HTTP chunk is exactly
    one object: what TorchServe's own LLM clients expect (they `json.loads` each chunk that
    `requests`' `iter_content(chunk_size=None)` yields and read its `text`)."""

    content_type = "application/x-ndjson"
    streaming = True

    def __init__(self, details: bool = False) -> None:
        self.details = details

    def chunk(self, text: str) -> str:
        return json.dumps({"text": text}, ensure_ascii=False) + "\n"

    def final(self, event: FinishEvent) -> str:
        return json.dumps({"text": "", **usage(event, self.details)}) + "\n"

    def error(self, status: int, message: str, field: str | None = None,
              in_stream: bool = False) -> str:
        return json.dumps(error_body(status, message, field)) + ("\n" if in_stream else "")


class JsonFramer:
    """Non-streaming: one JSON object when generation is done."""

    content_type = "application/json"
    streaming = False

    def __init__(self, details: bool = False) -> None:
        self.details = details

    def chunk(self, text: str) -> str:
        return ""

    def final(self, event: FinishEvent) -> str:
        return json.dumps({"text": event.text, **usage(event, self.details)}, ensure_ascii=False)

    def error(self, status: int, message: str, field: str | None = None,
              in_stream: bool = False) -> str:
        return json.dumps(error_body(status, message, field))


def native_framer(stream: bool, stream_format: str, details: bool = False) -> Framer:
    if not stream:
        return JsonFramer(details)
    return NdjsonFramer(details) if stream_format == "ndjson" else TextFramer()
