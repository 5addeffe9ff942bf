"""OpenAI-compatible completions, chat completions and model listing.

Reached as /predictions/{model}/{version}/v1/... (TorchServe passes the tail as the
`url_path` header; see handlers/api/native.py). A body is parsed once into a typed
request (handlers/api/openai_request.py) whose generation settings are the native ones,
so batching, limits and streaming are the native ones; only the names in errors
(max_tokens, messages) and the wire format are OpenAI's. Here the typed request meets
the served model: its name, what its backend can honour, its chat template and
tokenizer, and the room its context leaves. The probes clients send before a run
(health, ping, version, v1/models) are here too.
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
from handlers.api.body import brief
from handlers.api.chat_template import chat_prompt
from handlers.api.native import Api, Immediate, Prepared
from handlers.api.openai_framing import OpenAIErrorFramer, ResponseMeta, openai_framer
from handlers.api.openai_request import ChatRequest, OpenAIRequest, parse_chat, parse_completion
from handlers.backends.capabilities import check_sampling
from handlers.errors import RequestError
from handlers.structured.spec import forced_tool_call

#: SamplingParams features under the names OpenAI clients send (backends/capabilities.py)
OPENAI_NAMES = {"min_new_tokens": "min_tokens", "prompt_logprobs": "echo"}
ENDPOINTS = ("v1/completions", "v1/chat/completions", "v1/models", "v1/models/{model}",
             "health", "ping", "version")


def check_token_ids(ids: tuple[int, ...], tokenizer: Any) -> None:
    vocab = len(tokenizer)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError("prompt", f"token id {bad} is out of range; this model's vocabulary "
                           f"has ids 0 to {vocab - 1}")


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


def model_name(asked: str | None, service: Any) -> str:
    """The served name; a request naming another model is a 404 that says which one is
    served (OpenAI answers an unknown model with 404; vLLM does too)."""
    served = served_name(_checkpoint_dir(service))
    if asked not in (None, served):
        raise RequestError("model", f"the model {brief(asked)} does not exist; this endpoint "
                           f"serves {served!r} (GET v1/models lists it)", status=404)
    return served


def _served(request: OpenAIRequest, service: Any) -> str:
    """The typed request against the served model: its name, and what its backend can
    honour (refused by OpenAI's field names, saying which setting decides)."""
    model = model_name(request.model, service)
    check_sampling(request.params.sampling, service.limits.capabilities, OPENAI_NAMES)
    return model


def _meta(request: OpenAIRequest, model: str, chat: bool, tokenizer: Any,
          **extra: Any) -> ResponseMeta:
    options = request.stream_options
    return ResponseMeta(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()),
                        model, chat, options.include_usage, options.continuous_usage_stats,
                        token_text=functools.partial(token_string, tokenizer), **extra)


def _prepared(request: OpenAIRequest, text: str, prompt_ids: list[int], meta: ResponseMeta,
              service: Any) -> Prepared:
    limits = service.limits
    generation = request.params.fitted(text, len(prompt_ids), stream=request.stream,
                                       max_length=limits.max_length,
                                       max_prompt_length=limits.max_prompt_length)
    return Prepared(generation, prompt_ids, openai_framer(meta, request.stream, len(prompt_ids)))


class CompletionsApi:
    """POST v1/completions: {"model", "prompt", "max_tokens", ...}."""

    error_framer = OpenAIErrorFramer()

    def prepare(self, payload: Any, content_type: str, service: Any) -> Prepared:
        request = parse_completion(payload, content_type, service.config.handler)
        model = _served(request, service)
        tokenizer = service.tokenizer
        if isinstance(request.prompt, tuple):  # token ids run as sent
            check_token_ids(request.prompt, tokenizer)
            prompt_ids = list(request.prompt)
            text = tokenizer.decode(prompt_ids)
        else:
            text = request.prompt
            prompt_ids = service.encode(text)
        meta = _meta(request, model, False, tokenizer, echo=text if request.echo else None,
                     echo_ids=tuple(prompt_ids), hide_generated=request.score_only)
        return _prepared(request, text, prompt_ids, meta, service)


class ChatCompletionsApi:
    """POST v1/chat/completions: {"model", "messages", "max_tokens", ...}."""

    error_framer = OpenAIErrorFramer()

    def prepare(self, payload: Any, content_type: str, service: Any) -> Prepared:
        request = parse_chat(payload, content_type, service.config.handler)
        model = _served(request, service)
        setting = service.config.handler.chat_template
        tools, reader = tool_calls.for_template(request.tools, request.tool_turn,
                                                service.tokenizer, setting)
        prompt = chat_prompt(service.tokenizer, request.messages, setting, tools,
                             request.template_kwargs)
        meta = _meta(request, model, True, service.tokenizer, tool_calls=reader,
                     reasoning=prompt.reasoning)
        if reader is not None and request.tools.forced:
            request = forced_calls(request, tools, reader, service, prompt.reasoning)
        return _prepared(request, prompt.text, prompt.ids, meta, service)


def forced_calls(request: ChatRequest, tools: list[dict[str, Any]], reader: Any,
                 service: Any, reasoning: str | None = None) -> ChatRequest:
    """`tool_choice` "required" or a named function, enforced: the answer's grammar is one
    or more calls of the offered functions (one call of the named one), each call's
    arguments valid for its `parameters`, in the format the template teaches (Llama's JSON,
    Qwen's tags, Mistral's list or name[ARGS]) -- so the reader takes the answer as calls,
    and the finish reason is "tool_calls". A thinking template's answer may think first
    (`reasoning`: where its answer starts), as the reasoning reader expects."""
    asked = request.tools
    fmt = reader.parser.grammar
    if fmt is None:
        raise RequestError("tool_choice", f"the chat template's tool-call format "
                           f"({reader.parser.name}, {type(reader.parser).__name__}) cannot be "
                           "forced by a grammar; send tool_choice \"auto\"")
    fmt = replace(fmt, reasoning=reasoning if reasoning in ("inside", "auto") else None)
    if asked.named:
        fmt = replace(fmt, separator=None)
    grammar = forced_tool_call(tools, asked.choice if asked.named else None, fmt)
    sampling = replace(request.params.sampling, grammar=grammar)
    check_sampling(sampling, service.limits.capabilities, OPENAI_NAMES)
    return replace(request, params=replace(request.params, sampling=sampling))


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
        model_name(self.name, service)
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
