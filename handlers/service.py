"""Everything a worker holds, built once from the typed config; no TorchServe import.

config -> tokenizer + backend -> scheduler -> engine. `GenerationService.submit`
turns a validated request into a running sequence whose events arrive on an
asyncio queue, which is all the TorchServe adapter needs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from handlers.backends import load_backend
from handlers.backends.base import Backend
from handlers.config import ModelConfig
from handlers.engine import Engine, Observer
from handlers.request import GenerationRequest, check_length
from handlers.scheduler import Event, Scheduler, Sequence

logger = logging.getLogger(__name__)


def load_tokenizer(checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


@dataclass
class GenerationService:
    config: ModelConfig
    tokenizer: object
    backend: Backend
    engine: Engine

    @classmethod
    def create(cls, config: ModelConfig, model_dir: Path, observer: Observer | None = None,
               make_backend: Callable[[], Backend | None] | None = None) -> GenerationService:
        """`make_backend` (None = the configured backend) runs on the engine thread."""
        h = config.handler
        start = time.monotonic()
        tokenizer = load_tokenizer((model_dir / h.checkpoint).resolve())

        def build() -> tuple[Backend, Scheduler]:
            backend = (make_backend and make_backend()) or load_backend(h, model_dir)
            if h.warmup:
                backend.warmup()
            return backend, Scheduler(backend.batch_size, h.batching,
                                      h.effective_micro_batch_size, h.max_queue,
                                      h.batch_delay_ms / 1000)

        engine = Engine.launch(build, observer)
        logger.info("model ready in %.1fs: backend=%s batching=%s slots=%d", time.monotonic() -
                    start, h.backend, h.batching, engine.backend.batch_size)
        return cls(config, tokenizer, engine.backend, engine)

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def submit(self, request_id: str, request: GenerationRequest, prompt_ids: list[int],
               loop: asyncio.AbstractEventLoop) -> asyncio.Queue[Event]:
        """Queue the request; its events arrive on the returned queue (raises on 4xx/503)."""
        check_length(len(prompt_ids), request.max_new_tokens, self.backend.max_length,
                     getattr(self.backend, "max_prompt_length", None))
        events: asyncio.Queue[Event] = asyncio.Queue()
        seq = Sequence(request_id=request_id, prompt_ids=prompt_ids,
                       max_new_tokens=request.max_new_tokens, sampling=request.sampling,
                       stop=request.stop, tokenizer=self.tokenizer,
                       sink=lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        if request.timeout_s is not None:
            seq.deadline = seq.arrived_at + request.timeout_s
        self.engine.submit(seq)
        return events
