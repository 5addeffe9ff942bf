"""The model side of a worker: tokenizer, backend and scheduler under one engine.

Built the same way in the worker itself (handler.engine_process: inline) and in the
engine process (child: handlers/engine/process.py), from an `EngineSpec` that pickles
across the process boundary. Both turn an `EngineRequest` into the engine's `Sequence`
with `build_sequence`, so a request means the same in either mode; `InlineEngine` is
the inline mode's `EngineHandle`, the child mode's is handlers/engine/client.py. The
worker side (handlers/torchserve/service.py) and the engine process both build on this module; it
imports neither, so neither imports the other.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from handlers.backends import load_backend
from handlers.backends.base import Backend
from handlers.backends.capabilities import check_defaults, sampling_group
from handlers.config import ModelConfig
from handlers.engine.core import Engine, Observer
from handlers.engine.messages import EngineRequest, ModelLimits
from handlers.engine.scheduler import Scheduler, Sequence, Sink

logger = logging.getLogger(__name__)


def load_tokenizer(checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(checkpoint).resolve())


def pickled_tokenizer(tokenizer: object) -> bytes | None:
    """The engine process's tokenizer for its worker, which would otherwise load the same
    one from the checkpoint: AutoTokenizer resolves the class through the model's config,
    importing that model's modules (2.9 s of CPU under transformers 5.23; the whole load
    2.0-2.3 s under 4.48 and 4.57), which the engine process imports anyway to load the
    model and the worker never needs. Unpickled, the worker tokenizes with the very
    tokenizer the engine detokenizes with. None (the worker loads its own) for one that
    does not pickle."""
    try:
        return pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 -- any failure only costs the worker a load
        logger.info("the tokenizer (%s) does not pickle (%s): the worker loads its own",
                    type(tokenizer).__name__, e)
        return None


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


def _sampling_group(seq: Sequence) -> Hashable | None:
    return sampling_group(seq.sampling)


def start_engine(spec: EngineSpec, observer: Observer | None = None,
                 after_step: Callable[[], None] | None = None,
                 engine_class: type[Engine] = Engine) -> tuple[Engine, object]:
    """Tokenizer, backend (built, warmed up and run on the engine thread) and scheduler:
    the model side, in the worker (inline) or in the engine process (child, whose engine
    class also puts its step's start on the shared board)."""
    h = spec.config.handler
    start = time.monotonic()
    tokenizer = (spec.make_tokenizer or partial(load_tokenizer, spec.model_dir / h.checkpoint))()

    def build() -> tuple[Backend, Scheduler]:
        backend = ((spec.make_backend and spec.make_backend())
                   or load_backend(h, spec.model_dir, spec.cores, tokenizer))
        check_defaults(h, backend.capabilities)  # before warming up: it may refuse them all
        if h.warmup:
            backend.warmup()
        group = _sampling_group if backend.capabilities.shared_sampling else None
        return backend, Scheduler(backend.batch_size, h.batching, h.effective_micro_batch_size,
                                  h.max_queue, h.batch_delay_ms / 1000, group)

    engine = engine_class.launch(build, observer, after_step)
    grammar_compiler(engine, tokenizer)
    logger.info("model ready in %.1fs: backend=%s batching=%s slots=%d", time.monotonic() -
                start, h.backend, h.batching, engine.backend.batch_size)
    return engine, tokenizer


def grammar_compiler(engine: Engine, tokenizer) -> None:
    """Structured outputs, where the backend applies masks: a compiler over its logits'
    width whose tokenizer conversion (a walk of the whole vocabulary, seconds at 128k
    entries) starts now, on the compiler's thread, so the first such request does not wait
    for it and no step ever does."""
    vocab = engine.backend.grammar_vocab()
    if not vocab:
        return
    from handlers.structured.compiler import GrammarCompiler, grammar_tokenizer

    compiler = GrammarCompiler(partial(grammar_tokenizer, tokenizer, vocab,
                                       sorted(engine.backend.eos_token_ids)))
    compiler.start()
    engine.use_grammars(compiler)


def model_limits(backend: Backend) -> ModelLimits:
    """What the worker checks requests against, read once from the loaded backend."""
    return ModelLimits(backend.batch_size, backend.max_length,
                       getattr(backend, "max_prompt_length", None), backend.capabilities)


def build_sequence(request: EngineRequest, sink: Sink, tokenizer) -> Sequence:
    """The engine's state for `request` (detokenizer, stop matcher), where the model runs:
    the inline engine and the engine process build it the same way."""
    return Sequence(request_id=request.request_id, prompt_ids=request.prompt_ids,
                    max_new_tokens=request.max_new_tokens, sampling=request.sampling,
                    stop=request.stop, sink=sink, tokenizer=tokenizer,
                    arrived_at=request.arrived_at, deadline=request.deadline)


class InlineEngine:
    """The `EngineHandle` of handler.engine_process inline: the engine runs in the worker.

    It owns the `Engine` and the tokenizer its sequences detokenize with. Nothing here can
    die apart from the worker, so `down` is always None: a dead engine thread is the
    worker's death, which TorchServe handles."""

    down: str | None = None

    def __init__(self, engine: Engine, tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = model_limits(engine.backend)

    @classmethod
    def start(cls, spec: EngineSpec, observer: Observer | None = None) -> InlineEngine:
        return cls(*start_engine(spec, observer))

    def submit(self, request: EngineRequest, sink: Sink) -> None:
        self.engine.submit(build_sequence(request, sink, self.tokenizer))

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    def stop(self, timeout_s: float = 10) -> None:
        self.engine.stop(timeout_s)
