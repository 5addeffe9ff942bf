"""HTTP APIs a request can speak, chosen by the path after /predictions/{model}/{version}/.

TorchServe 0.12 forwards extra path segments as the `url_path` request header.
An API turns a request body into a validated GenerationRequest plus the framer
that writes its answer (or an immediate answer, e.g. a model listing). Every API
shares the same engine, batching, streaming and validation: there is no second
code path for generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from handlers.framing import Framer, TextFramer, native_framer
from handlers.request import GenerationRequest, decode_body, parse_request


@dataclass(frozen=True)
class Prepared:
    request: GenerationRequest
    prompt_ids: list[int]
    framer: Framer


@dataclass(frozen=True)
class Immediate:
    """An answer that needs no generation."""

    body: str
    content_type: str = "application/json"


class Api(Protocol):
    #: frames errors raised before a request is parsed (right shape for the API)
    error_framer: Framer

    def prepare(self, payload: Any, content_type: str, service: Any) -> Prepared | Immediate:
        """Raise RequestError (4xx) for bad input."""


class NativeApi:
    """`POST /predictions/{model}`: {"prompt", "max_new_tokens", ...} or plain text."""

    error_framer: Framer = TextFramer()

    def prepare(self, payload: Any, content_type: str, service: Any) -> Prepared:
        request = parse_request(decode_body(payload, content_type), service.config.handler)
        framer = native_framer(request.stream, request.stream_format, request.details)
        return Prepared(request, service.encode(request.prompt), framer)


def select_api(url_path: str | None) -> Api:
    path = (url_path or "").strip("/")
    if not path:
        return NativeApi()
    from handlers.openai_api import openai_api  # here: it imports this module

    # v1/... and the probes OpenAI-ecosystem clients send (health, ping, version); anything
    # else is theirs too (the native API has no path), so its 404 is in OpenAI's shape
    return openai_api(path)
