"""Where a request with a grammar waits for it: compiled off the step loop, then admitted.

A structured-outputs request (`SamplingParams.grammar`) cannot take a slot before its
grammar is compiled for the model's tokenizer, and compiling must never run on the engine
thread, whose every moment is a device step's. So the engine hands such a request here:
the compiler (handlers/structured/compiler.py: its own threads, a bounded cache, parser
fuel limits) compiles it -- at once when the grammar is cached -- and when it is ready the
request gets its own matcher (`Sequence.grammar`) and joins the scheduler like any other.
A grammar the engine cannot compile, or one that takes longer than the compiler's bound,
ends the request with a 400 naming the field; a cancel meanwhile ends it with a 499; the
request never waits longer than that bound here. Free requests never pass through.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from handlers.engine.scheduler import ErrorEvent, Sequence
from handlers.errors import CapacityError, RequestError

logger = logging.getLogger(__name__)


class GrammarGate:
    """Compiles each waiting request's grammar, then `admit`s it; `fail` ends one."""

    def __init__(self, compiler: Any, admit: Callable[[Sequence], None],
                 fail: Callable[[Sequence, ErrorEvent], None]) -> None:
        self.compiler = compiler
        self._admit = admit
        self._fail = fail
        self._lock = threading.Lock()
        self._waiting: dict[str, Sequence] = {}

    def submit(self, seq: Sequence) -> None:
        with self._lock:
            self._waiting[seq.request_id] = seq
        ready = self.compiler.ready()  # the tokenizer, converted once per model at load
        if ready.done():
            self._compile(seq)
        else:
            ready.add_done_callback(lambda f: self._compile(seq))

    def _compile(self, seq: Sequence) -> None:
        with self._lock:
            if seq.request_id not in self._waiting:  # cancelled meanwhile
                return
        future = self.compiler.submit(seq.sampling.grammar)
        if not future.done():
            timer = threading.Timer(self.compiler.timeout_s, self._expire, (seq,))
            timer.daemon = True
            timer.start()
            future.add_done_callback(lambda f: timer.cancel())
        future.add_done_callback(lambda f: self._compiled(seq, f))

    def cancel(self, request_id: str) -> bool:
        """Whether the request was waiting here (it then ends with a 499)."""
        with self._lock:
            seq = self._waiting.pop(request_id, None)
        if seq is None:
            return False
        self._fail(seq, ErrorEvent(499, "cancelled"))
        return True

    def __len__(self) -> int:
        return len(self._waiting)

    def _take(self, seq: Sequence) -> bool:
        with self._lock:
            return self._waiting.pop(seq.request_id, None) is seq

    def _expire(self, seq: Sequence) -> None:
        if self._take(seq):
            spec = seq.sampling.grammar
            self._fail(seq, ErrorEvent(
                400, f"the grammar took longer than {self.compiler.timeout_s:g} s to compile; "
                "simplify the schema", field=spec.field))

    def _compiled(self, seq: Sequence, future: Future) -> None:
        if not self._take(seq):  # cancelled, or past its bound
            return
        try:
            compiled = future.result()
        except RequestError as exc:
            self._fail(seq, ErrorEvent(exc.status, exc.message, field=exc.field))
            return
        except Exception:
            logger.exception("compiling the grammar of request %s failed", seq.request_id)
            self._fail(seq, ErrorEvent(500, "compiling the request's grammar failed; the "
                                       "worker log has the details"))
            return
        from handlers.structured.masks import RowGrammar

        seq.grammar = RowGrammar(compiled.matcher())
        try:
            self._admit(seq)
        except CapacityError as exc:
            self._fail(seq, ErrorEvent(503, str(exc), exc.retry_after_s))
