"""OpenAI-compatible completions, chat completions and model listing.

Reached as /predictions/{model}/{version}/v1/... (TorchServe passes the tail as the
`url_path` header; see handlers/api/native.py). An OpenAI body is checked against the
fields this server honours, mapped onto the native fields and validated by the
same `parse_request`, so batching, limits and streaming are the native ones; only
the names in errors (max_tokens, messages) and the wire format are OpenAI's.
Fields clients send with harmless default values are accepted; any other value,
and any unknown field, is rejected naming the field. The fields beyond the native
ones (penalties, logprobs, ignore_eos, ...) live in handlers/api/openai_extensions.py;
the probes clients send before a run (health, ping, version, v1/models) are here.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from handlers.api import tool_calls
from handlers.api.chat_template import encode_chat, render_chat, takes_tools
from handlers.api.native import Api, Immediate, Prepared
from handlers.api.openai_extensions import EXTENSIONS, extensions, logprobs_asked, stream_options
from handlers.api.openai_framing import OpenAIErrorFramer, ResponseMeta, openai_framer
from handlers.api.request import (
    GenerationRequest,
    brief,
    closest_hint,
    decode_body,
    fit_to_context,
    parse_request,
)
from handlers.errors import RequestError

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
    "n": (_number(1), "1 (one choice per request: choices do not share a prefill here)"),
    "logit_bias": (lambda v: v == {}, "{} or null"),
    "user": (lambda v: isinstance(v, str), "a string"),
    "best_of": (_number(1), "1"),
    "suffix": (lambda v: v == "", "\"\" or null"),
    "store": (lambda v: v is False, "false"),
    "metadata": (lambda v: isinstance(v, dict), "an object"),
    "service_tier": (lambda v: v in ("auto", "default"), "'auto' or 'default'"),
    "response_format": (lambda v: v == {"type": "text"}, "{\"type\": \"text\"}"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "true or false"),
}
COMMON = ("model", "stream_options", "n", "logit_bias", "user", *EXTENSIONS,
          *[k for k in MAPPED if k != "max_tokens"])
COMPLETION_FIELDS = ("prompt", "max_tokens", "logprobs", "echo", "best_of", "suffix", *COMMON)
CHAT_FIELDS = ("messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
               "store", "metadata", "service_tier", "response_format", "tools", "tool_choice",
               "parallel_tool_calls", *COMMON)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
MESSAGE_KEYS = ("role", "content", "name")
#: what tool calling adds to a message: an assistant turn's calls, a tool result's call id
TOOL_KEYS = {"assistant": ("tool_calls",), "tool": ("tool_call_id",)}
ENDPOINTS = ("v1/completions", "v1/chat/completions", "v1/models", "v1/models/{model}",
             "health", "ping", "version")


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
            raise RequestError(key, f"{brief(value)} is not supported; this server accepts only "
                               f"{HARMLESS[key][1]}")
    if "model" in body and not isinstance(body["model"], str):
        raise RequestError("model", f"expected a string, got {brief(body['model'])}")
    return body


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
              names: dict[str, str]) -> GenerationRequest:
    try:
        return fit_to_context(request, len(prompt_ids), max_length)
    except RequestError as exc:
        raise RequestError(names.get(exc.field, exc.field), exc.message, exc.status) from exc


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    """One prompt: text, or token ids (lm-evaluation-harness sends [[ids]] by default)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list):
        raise RequestError("prompt", "send one prompt per request: a string, a list of token "
                           "ids, or a list holding one of them (lm-evaluation-harness: "
                           "batch_size=1)")
    if not isinstance(prompt, str):
        raise RequestError("prompt", f"required: a non-empty string, got {brief(prompt)}")
    return prompt


def check_token_ids(ids: list[int], tokenizer: Any) -> None:
    vocab = len(tokenizer)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError("prompt", f"token id {bad} is out of range; this model's vocabulary "
                           f"has ids 0 to {vocab - 1}")
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


def parse_messages(body: dict[str, Any], tools_ok: bool = False) -> list[dict[str, Any]]:
    """The chat's messages as the template reads them. Tool results (`role: "tool"`) and an
    assistant's `tool_calls` need a template with a tool format (`tools_ok`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "required: a non-empty list of {\"role\", \"content\"} "
                           "objects")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(where, f"expected an object, got {brief(message)}")
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role", f"{brief(role)} is not allowed; choose one of "
                               f"{', '.join(repr(r) for r in ROLES)}")
        allowed = MESSAGE_KEYS + TOOL_KEYS.get(role, ())
        extra = [k for k, v in message.items() if k not in allowed and v is not None]
        if extra:
            raise RequestError(f"{where}.{extra[0]}", f"not supported in a {role!r} message; "
                               f"it has {', '.join(allowed)}")
        uses_tools = role == "tool" or message.get("tool_calls") is not None
        if uses_tools and not tools_ok:
            raise RequestError(f"{where}.{'role' if role == 'tool' else 'tool_calls'}",
                               "this model's chat template has no tool format, so it cannot "
                               "read tool calls or results; send plain messages")
        if message.get("tool_calls") is not None:
            out.append(tool_calls.chat_message(message, where))
            continue
        entry: dict[str, Any] = {"role": ROLES[role],
                                 "content": _content(message.get("content"), where)}
        if role == "tool" and message.get("tool_call_id") is not None:
            entry["tool_call_id"] = str(message["tool_call_id"])
        out.append(entry)
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


def model_name(body: dict[str, Any], service: Any) -> str:
    """The served name; a request naming another model is a 404 that says which one is
    served (OpenAI answers an unknown model with 404; vLLM does too)."""
    served = served_name(_checkpoint_dir(service))
    asked = body.get("model")
    if asked not in (None, served):
        raise RequestError("model", f"the model {brief(asked)} does not exist; this endpoint "
                           f"serves {served!r} (GET v1/models lists it)", status=404)
    return served


def _meta(body: dict[str, Any], service: Any, chat: bool, **extra: Any) -> ResponseMeta:
    model = model_name(body, service)
    prefix = "chatcmpl" if chat else "cmpl"
    include, continuous = stream_options(body)
    return ResponseMeta(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, chat,
                        include, continuous, **extra)


def _no_stream_logprobs(body: dict[str, Any], logprobs: int | None) -> None:
    if logprobs is not None and body.get("stream"):
        raise RequestError("logprobs", "not supported with \"stream\": true here; send the "
                           "request without streaming")


class CompletionsApi:
    """POST v1/completions: {"model", "prompt", "max_tokens", ...}."""

    error_framer = OpenAIErrorFramer()
    names = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}

    def prepare(self, payload: Any, content_type: str, service: Any) -> Prepared:
        body = check_fields(decode_json(payload, content_type), COMPLETION_FIELDS)
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise RequestError("echo", f"expected true or false, got {brief(echo)}")
        prompt = completion_prompt(body)
        if isinstance(prompt, list):
            check_token_ids(prompt, service.tokenizer)
            prompt_ids, text = prompt, service.tokenizer.decode(prompt)
        else:
            prompt_ids, text = None, prompt
        # max_tokens 0 with echo scores the prompt alone (lm-evaluation-harness, vLLM): one
        # token is generated and not shown
        score_only = echo and body.get("max_tokens") == 0
        if score_only:
            body["max_tokens"] = 1
        handler = service.config.handler
        request = to_generation_request(body, text if text.strip() else prompt_placeholder(text),
                                        handler, self.names)
        logprobs = logprobs_asked(body, chat=False)
        _no_stream_logprobs(body, logprobs)
        if echo and body.get("stream"):
            raise RequestError("echo", "not supported with \"stream\": true here")
        request = replace(request, sampling=extensions(body, request.sampling,
                                                       service.limits.capabilities,
                                                       logprobs, echo))
        if prompt_ids is None:
            prompt_ids = service.encode(request.prompt)
        token_text = functools.partial(token_string, service.tokenizer)
        meta = _meta(body, service, chat=False, echo=text if echo else None,
                     echo_ids=tuple(prompt_ids), hide_generated=score_only,
                     token_text=token_text)
        request = check_fit(prompt_ids, request, service.limits.max_length, self.names)
        return Prepared(request, prompt_ids,
                        openai_framer(meta, request.stream, len(prompt_ids)))


def prompt_placeholder(text: str) -> str:
    """Token ids that decode to blanks (special tokens) still make a request: the native
    parser wants non-blank text, and the ids, not this text, are what runs."""
    return text + "\u2423"


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
        handler = service.config.handler
        asked = tool_calls.parse_tools(body)
        needs_tools = asked is not None or any(
            isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls"))
            for m in body.get("messages") or ())
        tools_ok = needs_tools and takes_tools(service.tokenizer, handler.chat_template)
        if asked is not None and asked.forced and not tools_ok:
            raise RequestError("tool_choice", f"{asked.choice!r} needs a model that calls "
                               "tools, and this model's chat template has no tool format; "
                               "send \"auto\" or \"none\" (answered as plain chat)")
        messages = parse_messages(body, tools_ok)
        tools = asked.rendered() if asked and tools_ok and asked.choice != "none" else None
        text = render_chat(service.tokenizer, messages, handler.chat_template, tools)
        request = to_generation_request(body, text, handler, names)
        logprobs = logprobs_asked(body, chat=True)  # streamed: with the last chunk
        request = replace(request, sampling=extensions(body, request.sampling,
                                                       service.limits.capabilities,
                                                       logprobs, echo=False))
        token_text = functools.partial(token_string, service.tokenizer)
        reader = tool_calls.call_reader(service.tokenizer, handler.chat_template, tools) \
            if tools is not None else None
        meta = _meta(body, service, chat=True, token_text=token_text, tool_calls=reader)
        prompt_ids = encode_chat(service.tokenizer, text)
        request = check_fit(prompt_ids, request, service.limits.max_length, names)
        return Prepared(request, prompt_ids,
                        openai_framer(meta, request.stream, len(prompt_ids)))


def token_string(tokenizer: Any, token: int) -> str:
    """A token's text as OpenAI lists it in logprobs (its decoded piece)."""
    return tokenizer.decode([token])


def _model_card(service: Any) -> dict[str, Any]:
    checkpoint = _checkpoint_dir(service)
    try:
        created = int(Path(checkpoint).stat().st_mtime)
    except OSError:
        created = 0
    return {"id": served_name(checkpoint), "object": "model", "created": created,
            "owned_by": "inf2serve", "max_model_len": service.limits.max_length}


class ModelsApi:
    """GET (or POST) v1/models: the one model this archive serves."""

    error_framer = OpenAIErrorFramer()

    def prepare(self, payload: Any, content_type: str, service: Any) -> Immediate:
        return Immediate(json.dumps({"object": "list", "data": [_model_card(service)]}))


class ModelApi:
    """GET v1/models/{model}: the model's card, or 404 naming the served one."""

    error_framer = OpenAIErrorFramer()

    def __init__(self, name: str) -> None:
        self.name = name

    def prepare(self, payload: Any, content_type: str, service: Any) -> Immediate:
        model_name({"model": self.name}, service)
        return Immediate(json.dumps(_model_card(service)))


class HealthApi:
    """GET health / ping (vLLM's and TGI's probes; GuideLLM calls `health` before a run):
    200 once the model is loaded -- TorchServe hands a request to this handler only then --
    and 503 while the engine process is being restarted."""

    error_framer = OpenAIErrorFramer()

    def __init__(self, body: str) -> None:
        self.body = body

    def prepare(self, payload: Any, content_type: str, service: Any) -> Immediate:
        down = service.engine.down  # why requests get a 503 now (a restart failed)
        if down is not None:
            raise RequestError("", f"the model process is down ({down}); it is being "
                               "restarted", status=503)
        return Immediate(self.body)


class VersionApi:
    """GET version (vLLM's route): this server's version."""

    error_framer = OpenAIErrorFramer()

    def prepare(self, payload: Any, content_type: str, service: Any) -> Immediate:
        try:
            from importlib.metadata import version

            ours = version("inf2serve")
        except Exception:  # an archive served without the package installed
            ours = "unknown"
        return Immediate(json.dumps({"version": ours}))


class UnknownEndpoint:
    """A path we do not serve: 404 in OpenAI's error shape."""

    error_framer = OpenAIErrorFramer()

    def __init__(self, path: str) -> None:
        self.path = path

    def prepare(self, payload: Any, content_type: str, service: Any) -> Prepared:
        raise RequestError("", f"unknown endpoint {self.path!r}; this model serves "
                           f"{', '.join(ENDPOINTS)} (under /predictions/MODEL/VERSION/)",
                           status=404)


ROUTES: dict[str, Callable[[], Api]] = {
    "v1/completions": CompletionsApi,
    "v1/chat/completions": ChatCompletionsApi,
    "v1/models": ModelsApi,
    "health": functools.partial(HealthApi, ""),
    "ping": functools.partial(HealthApi, json.dumps({"status": "Healthy"})),
    "version": VersionApi,
}


def openai_api(path: str) -> Api:
    """The Api for a url_path (called by handlers.api.routes.select_api for any non-empty path)."""
    path = path.strip("/")
    if path.startswith("v1/models/") and path.count("/") == 2:
        return ModelApi(path.rsplit("/", 1)[1])
    factory = ROUTES.get(path)
    return factory() if factory else UnknownEndpoint(path)
