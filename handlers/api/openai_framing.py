"""OpenAI wire formats: JSON bodies and server-sent events for completions and chat.

Framers follow handlers/api/framing.py's protocol, so the handler streams OpenAI
exactly as it streams the native contract. Each `chunk` is one SSE event, which
the handler sends as its own intermediate response (one event per chunk on the
wire); `final` carries the finish_reason event, the optional usage event and
`data: [DONE]`. Errors use OpenAI's shape {"error": {message, type, param, code}}.

A chat answer passes two readers, in this order: a thinking template's reasoning
(handlers/api/reasoning.py: `<think>...</think>` becomes `reasoning_content`), then the
tool-call reader on what is left (a Qwen3 answer thinks, then calls).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from handlers.api.framing import ERROR_TYPES
from handlers.api.reasoning import REASONING, Piece, ReasoningSplitter, Start, split
from handlers.api.tool_parsers import ToolCallReader
from handlers.backends.base import TokenLogprob
from handlers.engine.scheduler import FinishEvent

DONE = "data: [DONE]\n\n"
# OpenAI answers an unknown URL with invalid_request_error; other statuses as natively
OPENAI_ERROR_TYPES = {**ERROR_TYPES, 404: "invalid_request_error"}


def error_object(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": OPENAI_ERROR_TYPES.get(status, "server_error"),
                      "param": param or None, "code": status}}


def sse(obj: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(event: FinishEvent, hidden: bool = False) -> dict:
    return counts(event.prompt_tokens, 0 if hidden else event.completion_tokens)


def counts(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@dataclass(frozen=True)
class ResponseMeta:
    """What every object of one response repeats, and what the request asked to see."""

    id: str
    created: int
    model: str
    chat: bool
    include_usage: bool = False
    continuous_usage: bool = False  # usage on every chunk (vLLM's continuous_usage_stats)
    echo: str | None = None  # completions `echo`: the prompt text, put before the answer
    echo_ids: tuple[int, ...] = ()  # its token ids (logprobs with echo)
    hide_generated: bool = False  # echo with max_tokens 0: the prompt alone is the answer
    token_text: Callable[[int], str] = str  # a token id's text in logprobs
    #: tools were rendered: the calls are read out of the answer in the template's format
    tool_calls: ToolCallReader | None = None
    #: the template teaches thinking: where the answer starts (reasoning.start_of)
    reasoning: Start | None = None

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def reasoning_fields(text: str | None) -> dict[str, str | None]:
    """The reasoning under both names clients read: `reasoning_content` (DeepSeek's, vLLM's
    until 0.16, Open WebUI's) and `reasoning` (OpenAI's advice for chat completions, vLLM's
    from 0.17); vLLM sent both while it moved from one to the other."""
    return {"reasoning_content": text, "reasoning": text}


def completion_logprobs(meta: ResponseMeta, event: FinishEvent) -> dict | None:
    """Completions' shape: {tokens, token_logprobs, top_logprobs, text_offset}; each
    top_logprobs entry maps token text to logprob and holds the chosen token too (as vLLM
    answers); the prompt's first token has null entries. Offsets index the answer's text."""
    if event.logprobs is None:
        return None
    ids: list[int] = []
    entries: list[TokenLogprob | None] = []
    if meta.echo is not None and event.prompt_logprobs is not None:
        ids += meta.echo_ids
        entries += event.prompt_logprobs
    if not meta.hide_generated:
        ids += event.token_ids
        entries += event.logprobs
    text = meta.token_text
    tokens = [text(t) for t in ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top = []
    for token, entry in zip(tokens, entries, strict=True):
        if entry is None:
            top.append(None)
            continue
        alternatives = {text(t): v for t, v in entry[1]}
        alternatives.setdefault(token, entry[0])
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [e[0] if e else None for e in entries],
            "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(meta: ResponseMeta, event: FinishEvent) -> dict | None:
    """Chat's shape: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}]}]}."""
    if event.logprobs is None:
        return None

    def item(token: int, logprob: float) -> dict:
        text = meta.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [{**item(t, e[0]), "top_logprobs": [item(i, v) for i, v in e[1]]}
               for t, e in zip(event.token_ids, event.logprobs, strict=True) if e is not None]
    return {"content": content, "refusal": None}


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
        meta = self.meta
        if meta.chat:
            reasoning, text = (split(event.text, meta.reasoning) if meta.reasoning
                               else (None, event.text))
            calls = meta.tool_calls.calls(text) if meta.tool_calls else None
            message: dict[str, Any] = {"role": "assistant", "content": text}
            reason = event.reason
            if calls:  # OpenAI: content null beside the calls; vLLM: finish "tool_calls"
                message, reason = {"role": "assistant", "content": None,
                                   "tool_calls": calls}, "tool_calls"
            if meta.reasoning:  # null when the answer did not think
                message.update(reasoning_fields(reasoning))
            choice = {"index": 0, "message": message,
                      "logprobs": chat_logprobs(meta, event), "finish_reason": reason}
            obj = meta.head("chat.completion")
        else:
            text = "" if meta.hide_generated else event.text
            choice = {"index": 0, "text": (meta.echo or "") + text,
                      "logprobs": completion_logprobs(meta, event),
                      "finish_reason": event.reason}
            obj = meta.head("text_completion")
        counts = usage(event, hidden=meta.hide_generated)
        return json.dumps({**obj, "choices": [choice], "usage": counts}, ensure_ascii=False)


class OpenAISseFramer(OpenAIErrorFramer):
    """Streaming: `data: {chunk}` events, the first chat delta carrying the role."""

    content_type = "text/event-stream"
    streaming = True

    def __init__(self, meta: ResponseMeta, prompt_tokens: int = 0) -> None:
        self.meta = meta
        self.role_sent = False
        #: continuous usage: the handler sets `tokens` (generated so far) from each text
        #: event before the chunk holding that text is framed
        self.counts_tokens = meta.continuous_usage
        self.prompt_tokens = prompt_tokens
        self.tokens = 0
        #: with tools, text that may open a tool call is held back until it is decided:
        #: True undecided or a call (held to the end), False plain content
        self.held = ""
        self.calling = meta.tool_calls is not None
        #: a thinking template: the answer's text goes through its reasoning splitter first
        self.splitter = ReasoningSplitter(meta.reasoning) if meta.reasoning else None

    def _event(self, choices: list[dict], event: FinishEvent | None = None) -> str:
        obj = self.meta.head("chat.completion.chunk" if self.meta.chat else "text_completion")
        obj["choices"] = choices
        if event is not None:
            obj["usage"] = usage(event)
        elif self.counts_tokens:  # vLLM's continuous_usage_stats: counts so far
            obj["usage"] = counts(self.prompt_tokens, self.tokens)
        elif self.meta.include_usage:  # OpenAI: null on every chunk but the last
            obj["usage"] = None
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
        if self.splitter is None:
            return self._content(text)
        return self._pieces(self.splitter.feed(text))

    def _pieces(self, pieces: list[Piece]) -> str:
        return "".join(self._reasoning(text) if kind == REASONING else self._content(text)
                       for kind, text in pieces)

    def _reasoning(self, text: str) -> str:
        delta: dict[str, str] = reasoning_fields(text)
        if not self.role_sent:
            delta = {"role": "assistant", **delta}
            self.role_sent = True
        return self._event([{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": None}])

    def _content(self, text: str) -> str:
        if self.calling:
            self.held += text
            self.calling = self.meta.tool_calls.may_open(self.held)
            if self.calling:
                return ""
            text, self.held = self.held, ""
        if not text:
            return ""
        return self._event([self._choice(text, None)])

    def _calls(self) -> tuple[str, bool]:
        """The held answer as tool-call deltas (each call whole in one delta, which clients
        accumulate as they do partial ones), or as content when it did not parse; and
        whether it was a call."""
        held, self.held = self.held, ""
        calls = self.meta.tool_calls.calls(held) if self.meta.tool_calls else None
        if not calls:
            return (self._event([self._choice(held, None)]) if held else ""), False
        delta: dict[str, Any] = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        if not self.role_sent:
            delta = {"role": "assistant", "content": None, **delta}
            self.role_sent = True
        return self._event([{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": None}]), True

    def final(self, event: FinishEvent) -> str:
        self.tokens = event.completion_tokens
        reason = event.reason
        out = self._pieces(self.splitter.flush()) if self.splitter else ""
        if self.held:
            out, called = self._calls()
            reason = "tool_calls" if called else reason
        last = self._choice("", reason)
        if self.meta.chat and event.logprobs is not None:
            # every token's, with the last chunk: the engine streams text, not logprobs;
            # clients that accumulate a stream's logprobs (openai's) get the whole list
            last["logprobs"] = chat_logprobs(self.meta, event)
        out += self._event([last])
        if self.meta.include_usage:
            out += self._event([], event)
        return out + DONE


def openai_framer(meta: ResponseMeta, stream: bool, prompt_tokens: int = 0
                  ) -> OpenAIJsonFramer | OpenAISseFramer:
    return OpenAISseFramer(meta, prompt_tokens) if stream else OpenAIJsonFramer(meta)
