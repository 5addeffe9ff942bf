"""Everything a worker holds, built once from the typed config; no TorchServe import.

config -> tokenizer + backend -> scheduler -> engine, the engine in the worker itself
(handler.engine_process: inline) or in a supervised child process (child, the default:
handlers/engine_client.py). `GenerationService.submit` turns a validated request into
a running sequence whose events arrive on an asyncio queue, which is all the
TorchServe adapter needs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from handlers.backends import load_backend
from handlers.backends.base import Backend
from handlers.config import ModelConfig
from handlers.engine import Engine, Observer, QueueSink
from handlers.request import GenerationRequest, check_length
from handlers.scheduler import Event, Scheduler, Sequence

if TYPE_CHECKING:
    from handlers.engine_client import EngineClient
    from handlers.engine_process import ModelLimits

logger = logging.getLogger(__name__)


def load_tokenizer(checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(checkpoint).resolve())


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


@dataclass(frozen=True)
class EngineSpec:
    """What the model side is built from; pickled to the engine process, so every field
    must pickle (callables: module-level functions, classes or partials of them)."""

    config: ModelConfig
    model_dir: Path
    #: NeuronCores the worker claimed and holds (None: the neuron backend claims its own)
    cores: tuple[int, ...] | None = None
    #: runs on the engine thread; None (or it returns None) = the configured backend
    make_backend: Callable[[], Backend | None] | None = None
    #: None = the checkpoint's tokenizer
    make_tokenizer: Callable[[], object] | None = None
    log_level: int = logging.INFO


def start_engine(spec: EngineSpec, observer: Observer | None = None,
                 after_step: Callable[[], None] | None = None) -> tuple[Engine, object]:
    """Tokenizer, backend (built, warmed up and run on the engine thread) and scheduler:
    the model side, in the worker (inline) or in the engine process (child)."""
    h = spec.config.handler
    start = time.monotonic()
    tokenizer = (spec.make_tokenizer or partial(load_tokenizer, spec.model_dir / h.checkpoint))()

    def build() -> tuple[Backend, Scheduler]:
        backend = ((spec.make_backend and spec.make_backend())
                   or load_backend(h, spec.model_dir, spec.cores))
        if h.warmup:
            backend.warmup()
        return backend, Scheduler(backend.batch_size, h.batching, h.effective_micro_batch_size,
                                  h.max_queue, h.batch_delay_ms / 1000)

    engine = Engine.launch(build, observer, after_step)
    logger.info("model ready in %.1fs: backend=%s batching=%s slots=%d", time.monotonic() -
                start, h.backend, h.batching, engine.backend.batch_size)
    return engine, tokenizer


@dataclass
class GenerationService:
    config: ModelConfig
    tokenizer: object
    backend: Backend | ModelLimits  # what requests are checked against
    engine: Engine | EngineClient  # submit(seq), cancel(request_id), stop()

    @classmethod
    def create(cls, config: ModelConfig, model_dir: Path, observer: Observer | None = None,
               make_backend: Callable[[], Backend | None] | None = None) -> GenerationService:
        """`make_backend` (None = the configured backend) runs on the engine thread; with
        handler.engine_process child, in the engine process, so it must pickle."""
        if config.handler.engine_process == "inline":
            engine, tokenizer = start_engine(EngineSpec(config, model_dir,
                                                        make_backend=make_backend), observer)
            return cls(config, tokenizer, engine.backend, engine)
        from handlers.engine_client import EngineClient

        client = EngineClient.start(config, model_dir, observer, make_backend)
        tokenizer = load_tokenizer(model_dir / config.handler.checkpoint)
        return cls(config, tokenizer, client.limits, client)

    def __post_init__(self) -> None:
        self._encode = prompt_encoder(self.tokenizer)

    def encode(self, prompt: str) -> list[int]:
        return self._encode(prompt)

    def submit(self, request_id: str, request: GenerationRequest, prompt_ids: list[int],
               loop: asyncio.AbstractEventLoop, on_text: Callable[[str], None] | None = None
               ) -> asyncio.Queue[Event]:
        """Queue the request; its events arrive on the returned queue (raises on 4xx/503),
        its text, given `on_text`, in calls to that on the loop's thread."""
        check_length(len(prompt_ids), request.max_new_tokens, self.backend.max_length,
                     getattr(self.backend, "max_prompt_length", None))
        sink = QueueSink(loop, asyncio.Queue(), on_text)
        seq = Sequence(request_id=request_id, prompt_ids=prompt_ids,
                       max_new_tokens=request.max_new_tokens, sampling=request.sampling,
                       stop=request.stop, tokenizer=self.tokenizer, sink=sink)
        if request.timeout_s is not None:
            seq.deadline = seq.arrived_at + request.timeout_s
        self.engine.submit(seq)
        return sink.queue
