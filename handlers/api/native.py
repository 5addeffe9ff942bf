"""The API contract, and the native API: what a request becomes before it runs.

An API parses a request body once into a typed request, and prepares from it the
GenerationRequest as it will run (fitted to the model's context) plus the framer that
writes its answer (or an immediate answer, e.g. a model listing). Every API shares the
same engine, batching, streaming and validation: there is no second code path for
generation. Which API a request speaks is chosen by its path (handlers/api/routes.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from handlers.api.framing import Framer, TextFramer, native_framer
from handlers.api.request import GenerationRequest, fit_to_context, parse_native
from handlers.backends.capabilities import check_sampling


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
    """`POST /predictions/{model}`: {"prompt", "max_new_tokens", ...}, plain text, or a JSON
    string (the prompt). The dialect of TorchServe's LLM examples ({"prompt", "max_tokens"},
    every streamed chunk read as one JSON object) is understood too: without a
    `stream_format` it streams NDJSON (request.default_stream_format)."""

    error_framer: Framer = TextFramer()

    def prepare(self, payload: Any, content_type: str, service: Any) -> Prepared:
        request = parse_native(payload, content_type, service.config.handler)
        check_sampling(request.sampling, service.limits.capabilities)
        prompt_ids = service.encode(request.prompt)
        limits = service.limits
        request = fit_to_context(request, len(prompt_ids), limits.max_length,
                                 limits.max_prompt_length)
        framer = native_framer(request.stream, request.stream_format, request.details)
        return Prepared(request, prompt_ids, framer)
