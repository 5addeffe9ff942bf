"""The generation loop: scheduler + backend, on one thread. Pure Python.

Each step admits newcomers (prefill), then decodes every running sequence once,
so new requests join at the next step (continuous) or at the next micro-batch
(micro); a backend that can does both in one call (`Backend.mixes_prefill`).
Results go to each request's sink as events. A backend failure fails the
sequences of that call only -- the newcomers of a prefill, or the batch of a
decode -- and the loop keeps serving. Nothing here waits on a request: a sink
must not block.

A sequence past its deadline (`Sequence.deadline`) leaves at the start of the next
step, before admission, so a newcomer takes its slot in that same step: a waiting
one ends with a 504 error, a running one with finish_reason "timeout" and the text
it has. TorchServe 0.12 never tells the worker that a client went away (README,
"Abandoned requests"), so a deadline is what frees an abandoned request's slot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from handlers.backends.base import Backend
from handlers.scheduler import ErrorEvent, Event, Scheduler, Sequence, TextEvent

logger = logging.getLogger(__name__)

#: observer(name, value, unit) for metrics such as time to first token
Observer = Callable[[str, float, str], None]


class Engine:
    def __init__(self, backend: Backend, scheduler: Scheduler,
                 observer: Observer | None = None,
                 after_step: Callable[[], None] | None = None) -> None:
        self.backend = backend
        self.scheduler = scheduler
        self._observe = observer or (lambda name, value, unit: None)
        #: called on the engine thread after every step, failed or not (the engine
        #: process sends the step's events to the TorchServe worker as one message here)
        self._after_step = after_step or (lambda: None)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._load: tuple[int, int] | None = None  # (waiting, busy) last reported

    # -- called from request threads -------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queue a sequence; raises CapacityError when the queue is full."""
        with self._cond:
            self.scheduler.submit(seq)
            self._cond.notify()

    def cancel(self, request_id: str) -> None:
        with self._cond:
            seq = self.scheduler.cancel(request_id)
            self._cond.notify()
        if seq is not None and seq.slot is None:
            _emit(seq, ErrorEvent(499, "cancelled"))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="inf2serve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def launch(cls, build: Callable[[], tuple[Backend, Scheduler]],
               observer: Observer | None = None,
               after_step: Callable[[], None] | None = None) -> Engine:
        """Build the backend on the engine's own thread, then run the loop on it.

        torch's OpenMP pool belongs to the thread that runs an op: a model loaded and
        warmed up on one thread and stepped on another has two pools, more threads
        than cores, and libgomp then stops spinning between ops -- decode steps of the
        bench model measured ~40% slower. So load, warm-up and every step share one
        thread. Exceptions from `build` are raised here, in the caller.
        """
        ready: Future[Engine] = Future()

        def main() -> None:
            try:
                engine = cls(*build(), observer, after_step)
            except BaseException as exc:  # handed to the caller, which re-raises it
                ready.set_exception(exc)
                return
            engine._thread = threading.current_thread()
            ready.set_result(engine)
            engine._run()

        threading.Thread(target=main, name="inf2serve-engine", daemon=True).start()
        return ready.result()

    def stop(self, timeout_s: float = 10) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # -- the loop ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    wait = self.scheduler.wait_time()
                    if wait == 0.0:
                        break
                    self._cond.wait(wait)
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # the loop must survive anything a step can throw
                logger.exception("engine step failed")
                self._fail(list(self.scheduler.running.values()), 500, "internal error")
                self._report_load()
            self._after_step()

    def step(self) -> None:
        """One iteration: release overdue and cancelled sequences, prefill newcomers, decode
        the running batch; then the load gauges, if they changed."""
        try:
            self._step()
        finally:
            self._report_load()

    def _report_load(self) -> None:
        """Waiting requests and busy slots, for autoscalers: observed when they change."""
        with self._cond:
            load = (len(self.scheduler.waiting), len(self.scheduler.running))
        if load != self._load:
            self._load = load
            self._observe("WaitingRequests", load[0], "count")
            self._observe("BusySlots", load[1], "count")

    def _step(self) -> None:
        with self._cond:
            waited, overdue = self.scheduler.take_expired()
            cancelled = self.scheduler.take_cancelled()
            newcomers = self.scheduler.admit()  # into the slots freed just now, too
        if cancelled or overdue:
            self.backend.release([slot for slot, _ in cancelled + overdue])
            for _, seq in cancelled:
                _emit(seq, ErrorEvent(499, "cancelled"))
        for seq in waited:
            timeout = (seq.deadline or seq.arrived_at) - seq.arrived_at
            _emit(seq, ErrorEvent(504, f"timeout: the request's deadline ({timeout:g} s) passed "
                                  "while it waited for a slot; nothing was generated"))
        for _, seq in overdue:
            if text := seq.cut():
                _emit(seq, TextEvent(text))
            self._observe("GeneratedTokens", len(seq.generated), "count")
            _emit(seq, seq.finish_event("timeout"))
        if newcomers:
            now = time.monotonic()
            for seq in newcomers:
                self._observe("EngineQueueTime", (now - seq.arrived_at) * 1000, "ms")
            if self._packed(newcomers):
                return
            self._prefill(newcomers)
        with self._cond:
            # every row the backend holds, even one cancelled since `take_cancelled` (it
            # leaves at the next step): a decode of fewer rows fails the whole batch
            batch = list(self.scheduler.running.values())
        if batch:
            self._call(batch, lambda: self.backend.decode([s.slot for s in batch]), "decode")

    def _packed(self, newcomers: list[Sequence]) -> bool:
        """Continuous mode, on a backend that can: newcomers' prefill and the running
        batch's decode as one call. False: nothing ran (or it failed and the backend
        kept its batch), so the caller prefills and decodes them apart -- which also keeps
        a bad newcomer from failing the running batch."""
        if self.scheduler.policy != "continuous" or not self.backend.mixes_prefill:
            return False
        new = {id(s) for s in newcomers}
        with self._cond:
            running = [s for s in self.scheduler.running.values() if id(s) not in new]
        if not running:
            return False
        try:
            first, following = self.backend.step(
                [s.slot for s in newcomers], [s.prompt_ids for s in newcomers],
                [s.sampling for s in newcomers], [s.slot for s in running])
        except Exception:
            logger.warning("packed step of %d newcomers and %d running sequences failed; "
                           "running them apart", len(newcomers), len(running), exc_info=True)
            return False
        self._deliver(newcomers, first, "prefill")
        self._deliver(running, following, "decode")
        return True

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Micro: the micro-batch lives or dies together (as the reference does). Continuous:
        newcomers share one call, and if it fails each is retried alone so only the culprit
        fails."""
        def run(group: list[Sequence]) -> list[int]:
            return self.backend.prefill([s.slot for s in group], [s.prompt_ids for s in group],
                                        [s.sampling for s in group])

        if self.scheduler.policy == "micro" or len(seqs) == 1:
            self._call(seqs, lambda: run(seqs), "prefill")
            return
        try:
            tokens = run(seqs)
        except Exception:
            logger.warning("prefill of %d newcomers failed; retrying one by one", len(seqs))
            for seq in seqs:
                self._call([seq], lambda s=seq: run([s]), "prefill")
            return
        self._deliver(seqs, tokens, "prefill")

    def _call(self, seqs: list[Sequence], fn: Callable[[], list[int]], what: str) -> None:
        try:
            tokens = fn()
        except Exception:
            ids = ", ".join(s.request_id for s in seqs)
            logger.exception("%s failed for request(s) %s", what, ids)
            self._fail(seqs, 500, f"generation failed ({what}); the worker log has the details")
            return
        self._deliver(seqs, tokens, what)

    def _deliver(self, seqs: list[Sequence], tokens: list[int], what: str) -> None:
        if len(tokens) != len(seqs):
            logger.error("%s returned %d tokens for %d sequences", what, len(tokens), len(seqs))
            self._fail(seqs, 500, f"generation failed ({what}); the worker log has the details")
            return
        for seq, token in zip(seqs, tokens, strict=True):
            self._advance(seq, token)

    def _advance(self, seq: Sequence, token: int) -> None:
        first = seq.first_token_at is None
        text, reason = seq.append(token, self.backend.eos_token_ids, self.backend.max_length)
        if first:
            self._observe("TimeToFirstToken", (seq.first_token_at - seq.arrived_at) * 1000, "ms")
        if text:
            _emit(seq, TextEvent(text))
        if reason is not None:
            self._release([seq])
            self._observe("GeneratedTokens", len(seq.generated), "count")
            _emit(seq, seq.finish_event(reason))

    def _release(self, seqs: list[Sequence]) -> None:
        with self._cond:
            slots = [slot for slot in (self.scheduler.finish(s) for s in seqs) if slot is not None]
        if slots:
            try:
                self.backend.release(slots)
            except Exception:
                logger.exception("release of slots %s failed", slots)

    def _fail(self, seqs: list[Sequence], status: int, message: str) -> None:
        self._release(seqs)
        for seq in seqs:
            _emit(seq, ErrorEvent(status, message))


def _emit(seq: Sequence, event: Event) -> None:
    try:
        seq.sink(event)
    except Exception:  # a broken sink must not stop other requests
        logger.exception("sink of request %s failed", seq.request_id)
