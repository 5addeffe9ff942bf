"""OpenAI-compatible completions, chat completions and model listing.

Reached as /predictions/{model}/{version}/v1/... (TorchServe passes the tail as the
`url_path` header; see handlers/apis.py). An OpenAI body is checked against the
fields this server honours, mapped onto the native fields and validated by the
same `parse_request`, so batching, limits and streaming are the native ones; only
the names in errors (max_tokens, messages) and the wire format are OpenAI's.
Fields clients send with harmless default values are accepted; any other value,
and any unknown field, is rejected naming the field.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from handlers.apis import Api, Immediate, Prepared
from handlers.chat_template import encode_chat, render_chat
from handlers.errors import RequestError
from handlers.openai_framing import OpenAIErrorFramer, ResponseMeta, openai_framer
from handlers.request import (
    GenerationRequest,
    check_length,
    closest_hint,
    decode_body,
    parse_request,
)

# OpenAI field -> native field, for the fields we honour
MAPPED = {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
          "stop": "stop", "seed": "seed", "stream": "stream", "top_k": "top_k",
          "min_tokens": "min_new_tokens",
          "timeout": "timeout"}  # our extension (OpenAI has no server-side deadline field)
# fields accepted only with the value that changes nothing: (check, what is allowed)
def _number(expected: int) -> Callable[[Any], bool]:
    """`v == 1` alone would take true for 1 and false for 0."""
    return lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and v == expected


HARMLESS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_number(1), "1 (one choice per request)"),
    "frequency_penalty": (_number(0), "0"),
    "presence_penalty": (_number(0), "0"),
    "logit_bias": (lambda v: v == {}, "{} or null"),
    "logprobs": (lambda v: v is False, "false or null"),
    "top_logprobs": (_number(0), "0 or null"),
    "user": (lambda v: isinstance(v, str), "a string"),
    "echo": (lambda v: v is False, "false"),
    "best_of": (_number(1), "1"),
    "suffix": (lambda v: v == "", "\"\" or null"),
    "store": (lambda v: v is False, "false"),
    "metadata": (lambda v: isinstance(v, dict), "an object"),
    "service_tier": (lambda v: v in ("auto", "default"), "'auto' or 'default'"),
    "response_format": (lambda v: v == {"type": "text"}, "{\"type\": \"text\"}"),
    "tools": (lambda v: v == [], "[] (no tool calling)"),
    "tool_choice": (lambda v: v in ("none", "auto"), "'none' (no tool calling)"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "true or false"),
}
COMMON = ("model", "stream_options", "n", "frequency_penalty", "presence_penalty", "logit_bias",
          "user", *[k for k in MAPPED if k != "max_tokens"])
COMPLETION_FIELDS = ("prompt", "max_tokens", "logprobs", "echo", "best_of", "suffix", *COMMON)
CHAT_FIELDS = ("messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
               "store", "metadata", "service_tier", "response_format", "tools", "tool_choice",
               "parallel_tool_calls", *COMMON)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MESSAGE_KEYS = ("role", "content", "name")
ENDPOINTS = ("v1/completions", "v1/chat/completions", "v1/models")


def decode_json(payload: Any, content_type: str) -> dict[str, Any]:
    """TorchServe hands over a dict (JSON it decoded) or the raw bytes it could not decode."""
    if payload is None or payload in (b"", ""):
        raise RequestError("", "empty request body; send a JSON object")
    try:
        return decode_body(payload, "application/json")
    except RequestError as exc:  # OpenAI names no param for a body it cannot read
        raise RequestError("" if exc.field == "body" else exc.field, exc.message,
                           exc.status) from exc


def check_fields(body: dict[str, Any], allowed: tuple[str, ...]) -> dict[str, Any]:
    """Drop nulls (clients send them for 'unset'); reject unknown fields and non-defaults."""
    body = {k: v for k, v in body.items() if v is not None}
    for key, value in body.items():
        if key not in allowed:
            raise RequestError(str(key), "unrecognized request argument"
                               f"{closest_hint(key, allowed)}")
        if key in HARMLESS and not HARMLESS[key][0](value):
            raise RequestError(key, f"{value!r} is not supported; this server accepts only "
                               f"{HARMLESS[key][1]}")
    if "model" in body and not isinstance(body["model"], str):
        raise RequestError("model", f"expected a string, got {body['model']!r}")
    return body


def include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if body.get("stream") is not True:
        raise RequestError("stream_options", "only allowed when stream is true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError("stream_options", "expected {\"include_usage\": true|false}")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise RequestError("stream_options", f"include_usage: expected true or false, "
                           f"got {value!r}")
    return value


def to_generation_request(body: dict[str, Any], prompt: str, config: Any,
                          names: dict[str, str]) -> GenerationRequest:
    """Validate through the native parser; `names` maps native fields back for errors."""
    native = {MAPPED[k]: v for k, v in body.items() if k in MAPPED}
    native["prompt"] = prompt
    native["stream"] = body.get("stream", False)  # OpenAI's default, whatever the config says
    try:
        return parse_request(native, config)
    except RequestError as exc:
        raise RequestError(names.get(exc.field, exc.field), exc.message, exc.status) from exc


def check_fit(prompt_ids: list[int], request: GenerationRequest, max_length: int,
              names: dict[str, str]) -> None:
    try:
        check_length(len(prompt_ids), request.max_new_tokens, max_length)
    except RequestError as exc:
        raise RequestError(names.get(exc.field, exc.field), exc.message, exc.status) from exc


def completion_prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise RequestError("prompt", "send one prompt as a string; lists of prompts and "
                           "token-id prompts are not supported")
    if not isinstance(prompt, str):
        raise RequestError("prompt", f"required: a non-empty string, got {prompt!r}")
    return prompt


def _content(value: Any, where: str) -> str:
    """A message's text: a string or a list of {"type": "text", "text": ...} parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in value):
        return "\n".join(p["text"] for p in value)
    raise RequestError(f"{where}.content", "expected a string or a list of text parts "
                       "({\"type\": \"text\", \"text\": ...}); images and audio are not supported")


def parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "required: a non-empty list of {\"role\", \"content\"} "
                           "objects")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(where, f"expected an object, got {message!r}")
        extra = [k for k, v in message.items() if k not in MESSAGE_KEYS and v is not None]
        if extra:
            raise RequestError(f"{where}.{extra[0]}", "not supported (no tool calling); a "
                               "message has role, content and optionally name")
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role", f"{role!r} is not allowed; choose one of "
                               f"{', '.join(repr(r) for r in ROLES)}")
        out.append({"role": ROLES[role], "content": _content(message.get("content"), where)})
    return out


@functools.lru_cache(maxsize=8)
def served_name(checkpoint_dir: str) -> str:
    """The TorchServe model name from the archive's MAR-INF/MANIFEST.json, found above the
    checkpoint; the checkpoint directory's name when there is none."""
    path = Path(checkpoint_dir)
    for parent in [path, *path.parents][:4]:
        manifest = parent / "MAR-INF" / "MANIFEST.json"
        if manifest.is_file():
            try:
                return str(json.loads(manifest.read_text())["model"]["modelName"])
            except (OSError, ValueError, KeyError, TypeError):
                break
    return path.name or "model"


def _checkpoint_dir(service: Any) -> str:
    return str(getattr(service.tokenizer, "name_or_path", "") or "model")


def _meta(body: dict[str, Any], service: Any, chat: bool) -> ResponseMeta:
    model = body.get("model") or served_name(_checkpoint_dir(service))
    prefix = "chatcmpl" if chat else "cmpl"
    return ResponseMeta(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, chat,
                        include_usage(body))


class CompletionsApi:
    """POST v1/completions: {"model", "prompt", "max_tokens", ...}."""

    error_framer = OpenAIErrorFramer()
    names = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}

    def prepare(self, payload: Any, content_type: str, service: Any) -> Prepared:
        body = check_fields(decode_json(payload, content_type), COMPLETION_FIELDS)
        prompt = completion_prompt(body)
        request = to_generation_request(body, prompt, service.config.handler, self.names)
        meta = _meta(body, service, chat=False)
        prompt_ids = service.encode(request.prompt)
        check_fit(prompt_ids, request, service.backend.max_length, self.names)
        return Prepared(request, prompt_ids, openai_framer(meta, request.stream))


class ChatCompletionsApi:
    """POST v1/chat/completions: {"model", "messages", "max_tokens", ...}."""

    error_framer = OpenAIErrorFramer()

    def prepare(self, payload: Any, content_type: str, service: Any) -> Prepared:
        body = check_fields(decode_json(payload, content_type), CHAT_FIELDS)
        limit = "max_tokens"
        if "max_completion_tokens" in body:  # the newer name; max_tokens may repeat it
            value = body.pop("max_completion_tokens")
            if body.setdefault("max_tokens", value) != value:
                raise RequestError("max_completion_tokens", "differs from max_tokens; send one")
            limit = "max_completion_tokens"
        names = {"max_new_tokens": limit, "min_new_tokens": "min_tokens", "prompt": "messages"}
        messages = parse_messages(body)
        handler = service.config.handler
        text = render_chat(service.tokenizer, messages, handler.chat_template)
        request = to_generation_request(body, text, handler, names)
        meta = _meta(body, service, chat=True)
        prompt_ids = encode_chat(service.tokenizer, text)
        check_fit(prompt_ids, request, service.backend.max_length, names)
        return Prepared(request, prompt_ids, openai_framer(meta, request.stream))


class ModelsApi:
    """GET (or POST) v1/models: the one model this archive serves."""

    error_framer = OpenAIErrorFramer()

    def prepare(self, payload: Any, content_type: str, service: Any) -> Immediate:
        checkpoint = _checkpoint_dir(service)
        try:
            created = int(Path(checkpoint).stat().st_mtime)
        except OSError:
            created = 0
        model = {"id": served_name(checkpoint), "object": "model", "created": created,
                 "owned_by": "inf2serve", "max_model_len": service.backend.max_length}
        return Immediate(json.dumps({"object": "list", "data": [model]}))


class UnknownEndpoint:
    """A v1/ path we do not serve: 404 in OpenAI's error shape."""

    error_framer = OpenAIErrorFramer()

    def __init__(self, path: str) -> None:
        self.path = path

    def prepare(self, payload: Any, content_type: str, service: Any) -> Prepared:
        raise RequestError("", f"unknown endpoint {self.path!r}; this model serves "
                           f"{', '.join(ENDPOINTS)}", status=404)


ROUTES: dict[str, Callable[[], Api]] = {"v1/completions": CompletionsApi,
                                        "v1/chat/completions": ChatCompletionsApi,
                                        "v1/models": ModelsApi}


def openai_api(path: str) -> Api:
    """The Api for a url_path starting with v1/ (called by handlers.apis.select_api)."""
    factory = ROUTES.get(path.strip("/"))
    return factory() if factory else UnknownEndpoint(path)
