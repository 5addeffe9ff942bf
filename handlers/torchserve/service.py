"""Everything a worker holds, built once from the typed config; no TorchServe import.

config -> tokenizer + engine (handlers/engine/start.py), the engine in the worker itself
(handler.engine_process: inline) or in a supervised child process (child, the default:
handlers/engine/client.py). Either way the service holds one `EngineHandle` and the
model's `ModelLimits` (handlers/engine/messages.py), so nothing above it asks which
mode runs. `GenerationService.submit` turns a validated request into an `EngineRequest`
whose events arrive on an asyncio queue, which is all the TorchServe adapter needs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from handlers.api.request import GenerationRequest, fit_to_context
from handlers.backends.base import Backend
from handlers.config import ModelConfig
from handlers.engine.core import Observer
from handlers.engine.delivery import QueueSink
from handlers.engine.messages import EngineHandle, EngineRequest, ModelLimits
from handlers.engine.scheduler import Event
from handlers.engine.start import EngineSpec, InlineEngine, load_tokenizer

logger = logging.getLogger(__name__)


#: prompts the Rust tokenizer is checked against at load (special-token text, spaces, bytes)
_PROBES = ("Once upon a time", "", " leading space", "tabs\tand  double  spaces\n\n",
           "<s>[INST] <<SYS>> special text </s>", "émoji 🤖 and ünïcödé")


def prompt_encoder(tokenizer) -> Callable[[str], list[int]]:
    """The prompt's ids as `tokenizer(text)` gives them, from the Rust tokenizer directly
    where it gives the same ids on every probe: ~55 instead of ~185 us per request
    (demo tokenizer under transformers 4.48, 4.57 and 5.23), on the worker's event loop.
    Anything else (a slow tokenizer, a wrapper that adds its own processing) keeps the
    wrapper."""
    def wrapped(text: str) -> list[int]:
        return list(tokenizer(text)["input_ids"])

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return wrapped

    def direct(text: str) -> list[int]:
        return backend.encode(text).ids

    try:
        if all(direct(p) == wrapped(p) for p in _PROBES):
            return direct
    except Exception:  # an unusual tokenizer: the wrapper is always right
        logger.debug("the Rust tokenizer cannot encode prompts alone", exc_info=True)
    return wrapped


@dataclass
class GenerationService:
    config: ModelConfig
    tokenizer: object
    limits: ModelLimits  # what requests are checked against
    engine: EngineHandle  # inline or in the engine process
    #: the OpenAI router's name for each running request (its client id -> request id), so
    #: that it can cancel one when its client leaves (cancel_client)
    clients: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, config: ModelConfig, model_dir: Path, observer: Observer | None = None,
               make_backend: Callable[[], Backend | None] | None = None) -> GenerationService:
        """`make_backend` (None = the configured backend) runs on the engine thread; with
        handler.engine_process child, in the engine process, so it must pickle."""
        if config.handler.engine_process == "inline":
            inline = InlineEngine.start(EngineSpec(config, model_dir, make_backend=make_backend),
                                        observer)
            return cls(config, inline.tokenizer, inline.limits, inline)
        from handlers.engine.client import EngineClient

        client = EngineClient.start(config, model_dir, observer, make_backend)
        tokenizer = client.take_tokenizer()  # the engine process's own
        if tokenizer is None:
            tokenizer = load_tokenizer(model_dir / config.handler.checkpoint)
        return cls(config, tokenizer, client.limits, client)

    def __post_init__(self) -> None:
        self._encode = prompt_encoder(self.tokenizer)

    def encode(self, prompt: str) -> list[int]:
        return self._encode(prompt)

    def cancel_client(self, client_id: str) -> bool:
        """End the request the router named `client_id`: its client left. TorchServe 0.12
        never tells a worker of a disconnect (docs/design.md); the router, which holds the
        client's connection, does. False when no such request runs here (it ended already,
        or runs on another worker: handlers/torchserve/cancel_peers.py, which calls this
        from a thread of its own; the map's one-call operations and the engine's `cancel`
        are thread-safe)."""
        request_id = self.clients.pop(client_id, None)
        if request_id is None:
            return False
        self.engine.cancel(request_id)
        return True

    def submit(self, request_id: str, request: GenerationRequest, prompt_ids: list[int],
               loop: asyncio.AbstractEventLoop, on_text: Callable[[str], None] | None = None
               ) -> asyncio.Queue[Event]:
        """Queue the request; its events arrive on the returned queue (raises on 4xx/503),
        its text, given `on_text`, in calls to that on the loop's thread."""
        request = fit_to_context(request, len(prompt_ids), self.limits.max_length,
                                 self.limits.max_prompt_length)
        sink = QueueSink(loop, asyncio.Queue(), on_text)
        arrived_at = time.monotonic()
        deadline = None if request.timeout_s is None else arrived_at + request.timeout_s
        self.engine.submit(EngineRequest(request_id, prompt_ids, request.max_new_tokens,
                                         request.sampling, request.stop, arrived_at, deadline),
                           sink)
        return sink.queue
