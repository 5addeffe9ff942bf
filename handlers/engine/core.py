"""The generation loop: scheduler + backend on one thread, output on another. Pure Python.

Each step admits newcomers (prefill), then decodes every running sequence once,
so new requests join at the next step (continuous) or at the next micro-batch
(micro); a backend that can does both in one call (`Backend.mixes_prefill`).
A backend failure fails the sequences of that call only -- the newcomers of a
prefill, or the batch of a decode -- and the loop keeps serving.

The engine thread does only what the next device call needs: token ids, and the
finishes they decide (EOS, max_new_tokens, max_length), which free slots at once.
The rest of step N -- detokenizing, stop strings, metrics, events to the sinks
(grouped: one wake-up per event loop per step) -- runs on the output thread while
step N+1 is on the device (vLLM's engine core overlaps its output processing the
same way); newcomers' first tokens go over right after their prefill (queued behind
the last step's output if that still runs), so time to first token does not include
the step's decode. Step N+1's output is handed over once step N's is done, so a
sequence that hits a stop string leaves at the next step boundary, like a cancel: one
wasted row-step, and no change to what it answers (the output side counts the tokens
it rendered). Nothing here waits on a request: a sink must not block.

A step whose batch is the last one's -- nothing finished, failed, arrived, was
cancelled or came due -- only decodes it again, without the scheduler, because the
bookkeeping between two device calls is host time the device waits for; while such a
decode can finish nobody, even adding its tokens to their sequences is left to the
output side (`Unrecorded`). docs/design.md has the measurements.

A request with a grammar (structured outputs) waits for it outside the scheduler, in
the `GrammarGate`, which compiles it on the compiler's threads and then submits it; the
backend fills and applies its masks around its device calls (handlers/backends/base.py).

A sequence past its deadline (`Sequence.deadline`) leaves at the start of the next
step, before admission, so a newcomer takes its slot in that same step: a waiting
one ends with a 504 error, a running one with finish_reason "timeout" and the text
it has. TorchServe 0.12 never tells the worker that a client went away (docs/design.md,
"Abandoned requests"), so a deadline is what frees an abandoned request's slot.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

from handlers.backends.base import Backend, Rows
from handlers.engine.delivery import QueueSink as QueueSink  # where callers found it
from handlers.engine.delivery import deliver, deliver_one
from handlers.engine.grammar_gate import GrammarGate
from handlers.engine.scheduler import ErrorEvent, Event, Scheduler, Sequence, TextEvent
from handlers.telemetry.catalog import Finished, SpecDecode

logger = logging.getLogger(__name__)

#: observer(name, value, unit) for metrics such as time to first token; the value is a
#: number, but for "InterTokenLatency" (a step's intervals: (seconds, how many) pairs),
#: "RequestFinished" (a `Finished`) and "SpecDecode" (a `SpecDecode`): tuples, which cross
#: the process boundary as they are (handlers/telemetry/recorder.py reads them)
Observer = Callable[[str, object, str], None]
#: one entry of a step's output, in order: (sequence, tokens, finish reason or None) for
#: a step's generated tokens (those `Sequence.extend` kept); (sequence, None, event) for an
#: end the engine decided (cancel, failure); (sequence, None, "timeout") for a deadline
Item = tuple[Sequence, "list[int] | None", "str | Event | None"]


class Unrecorded(NamedTuple):
    """A decode whose tokens the output side adds to their sequences (`Engine.emit`): one
    that the engine knew could finish none of them (`Engine._hand_over`)."""

    seqs: list[Sequence]
    rows: Rows


class Engine:
    def __init__(self, backend: Backend, scheduler: Scheduler,
                 observer: Observer | None = None,
                 after_step: Callable[[], None] | None = None) -> None:
        if backend.max_tokens_per_step > 1 and "logprobs" not in backend.capabilities.unsupported:
            # a backend's logprobs are its last token's (`Backend.token_logprobs`)
            raise ValueError(f"{type(backend).__name__} yields up to "
                             f"{backend.max_tokens_per_step} tokens a step, so it must refuse "
                             "logprobs (Capabilities.unsupported)")
        self.backend = backend
        self.scheduler = scheduler
        #: several tokens a step: the tokens the device produced are counted (DeviceTokens),
        #: so that those a request's end dropped show beside GeneratedTokens
        self._speculative = backend.max_tokens_per_step > 1
        self._observe = observer or (lambda name, value, unit: None)
        #: called on the output side after each step's events went to their sinks (the
        #: engine process sends them to the TorchServe worker as one message here)
        self._after_step = after_step or (lambda: None)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._output: OutputThread | None = None
        self._stopping = False
        self._load: tuple[int, int] | None = None  # (waiting, busy) last reported
        # Engine thread only: the step's output, and what the fast path knows of the batch.
        self._items: list[Item] | Unrecorded = []
        #: the last decode's batch and slots, while decoding them again is the whole step;
        #: None after anything the engine did that changes it (a finish, a failure)
        self._batch: tuple[list[Sequence], list[int]] | None = None
        self._next_deadline = float("inf")  # the running batch's earliest deadline
        #: decodes of the last batch again that cannot finish a sequence by length
        self._quiet = 0
        #: a step went to the output side `Unrecorded`: settle before adding tokens here
        self._behind = False
        #: the other threads' one signal to the engine, set under `_cond`: something that
        #: may change the batch happened there (a cancel; an end on the output side, a stop
        #: string). The engine clears it, under `_cond`, as a full step begins
        self._poked = False
        #: when the current step began (time.monotonic()), None between steps: read by the
        #: engine process's heartbeat thread, so a stuck device call is seen from outside
        self.busy_since: float | None = None
        #: requests waiting for their grammar (None: the backend applies none)
        self.grammars: GrammarGate | None = None

    def use_grammars(self, compiler) -> None:
        """Serve requests with a grammar, compiled by `compiler` (handlers/structured/
        compiler.GrammarCompiler over the backend's logits)."""
        self.grammars = GrammarGate(compiler, self._queue, self._end_early)

    # -- called from request threads -------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queue a sequence; raises CapacityError when the queue is full. One with a
        grammar waits for it to compile first (`GrammarGate`)."""
        if seq.sampling.grammar is not None and seq.grammar is None:
            if self.grammars is None:
                self._end_early(seq, ErrorEvent(400, "this backend applies no grammar",
                                                field=seq.sampling.grammar.field))
                return
            self.grammars.submit(seq)
            return
        self._queue(seq)

    def _queue(self, seq: Sequence) -> None:
        with self._cond:
            self.scheduler.submit(seq)
            self._cond.notify()

    def _end_early(self, seq: Sequence, event: ErrorEvent) -> None:
        """A request that never reached the scheduler ends (from any thread)."""
        deliver_one(seq, event)
        self._after_step()

    def cancel(self, request_id: str) -> None:
        if self.grammars is not None and self.grammars.cancel(request_id):
            return
        with self._cond:
            seq = self.scheduler.cancel(request_id)
            self._poked = True
            self._cond.notify()
        if seq is not None and seq.slot is None:  # it waited: no step ever saw it
            self._observe_end(seq, "abort", time.monotonic())
            deliver_one(seq, ErrorEvent(499, "cancelled"))

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
        thread (the output thread never calls the backend). Exceptions from `build` are
        raised here, in the caller.
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
        self._output = OutputThread(self.emit)
        try:
            while True:
                with self._cond:
                    while not self._stopping:
                        wait = self.scheduler.wait_time()
                        if wait == 0.0:
                            break
                        self._cond.wait(wait)
                    if self._stopping:
                        return
                self.busy_since = time.monotonic()
                self._output.put(self.collect())
                while (batch := self._unchanged_batch()) is not None:
                    self.busy_since = time.monotonic()
                    self._output.put(self.collect(batch))
                self.busy_since = None
        finally:
            self._output.stop()
            self._output = None

    def _unchanged_batch(self) -> tuple[list[Sequence], list[int]] | None:
        """The last decode's batch, if the next step is only its decode again."""
        if (self._batch is None or self._poked or self._stopping or self.scheduler.waiting
                or time.monotonic() >= self._next_deadline):
            return None
        return self._batch

    def step(self) -> None:
        """One iteration and its output, on the calling thread (the loop overlaps them)."""
        self.emit(self.collect())

    def collect(self, batch: tuple[list[Sequence], list[int]] | None = None
                ) -> list[Item] | Unrecorded:
        """One iteration on the engine thread: release overdue, cancelled and stopped
        sequences, prefill newcomers, decode the running batch; then the load gauges, if
        they changed. With `batch` (`_unchanged_batch`), only its decode. Returns the
        step's output for `emit`."""
        self._items = []
        try:
            if batch is None:
                self._step()
            else:
                self._decode_again(*batch)
        except Exception:  # the loop must survive anything a step can throw
            logger.exception("engine step failed")
            self._settle()
            self._fail(list(self.scheduler.running.values()), 500, "internal error")
        finally:
            if batch is None or self._batch is None:  # a full step, or a finish in this one
                self._report_load()
        items, self._items = self._items, []
        return items

    def _report_load(self) -> None:
        """Waiting requests and busy slots, for autoscalers: observed when they change."""
        with self._cond:
            load = (len(self.scheduler.waiting), len(self.scheduler.running))
        if load != self._load:
            self._load = load
            self._observe("WaitingRequests", load[0], "count")
            self._observe("BusySlots", load[1], "count")

    def _step(self) -> None:
        self._batch = None
        with self._cond:
            self._poked = False  # before the scan: a later cancel or end sets it again
            waited, overdue = self.scheduler.take_expired()
            cancelled = self.scheduler.take_cancelled()  # and those a stop string ended
            newcomers = self.scheduler.admit()  # into the slots freed just now, too
        if cancelled or overdue:
            self.backend.release([slot for slot, _ in cancelled + overdue])
            self._items += [(seq, None, ErrorEvent(499, "cancelled"))
                            for _, seq in cancelled if not seq.done]
        for seq in waited:
            timeout = (seq.deadline or seq.arrived_at) - seq.arrived_at
            self._items.append((seq, None, ErrorEvent(
                504, f"timeout: the request's deadline ({timeout:g} s) passed while it "
                "waited for a slot; nothing was generated")))
        self._items += [(seq, None, "timeout") for _, seq in overdue]
        if newcomers:
            now = time.monotonic()
            for seq in newcomers:
                self._observe("EngineQueueTime", (now - seq.arrived_at) * 1000, "ms")
            if self._packed(newcomers):
                return
            self._prefill(newcomers)
            # their first tokens go out now, not after the decode below (a step later):
            # right behind the last step's output, without waiting for it
            if self._items and self._output is not None:
                self._output.put_nowait(self._items)
                self._items = []
        with self._cond:
            # every row the backend holds, even one cancelled since `take_cancelled` (it
            # leaves at the next step): a decode of fewer rows fails the whole batch
            batch = list(self.scheduler.running.values())
        if batch:
            self._next_deadline = min((s.deadline for s in batch if s.deadline is not None),
                                      default=float("inf"))
            self._decode(batch, [s.slot for s in batch])
            self._quiet = self._quiet_decodes(batch)

    def _decode(self, batch: list[Sequence], slots: list[int]) -> None:
        self._batch = (batch, slots)
        self._call(batch, lambda: self.backend.decode(slots), "decode", self._deliver)

    def _decode_again(self, batch: list[Sequence], slots: list[int]) -> None:
        """The last batch's decode again (`_unchanged_batch`); its tokens are recorded by
        the output side while it can finish nobody."""
        if self._quiet <= 0:
            self._decode(batch, slots)
            return
        self._quiet -= 1
        self._call(batch, lambda: self.backend.decode(slots), "decode", self._hand_over)

    def _hand_over(self, seqs: list[Sequence], rows: Rows, what: str) -> None:
        eos = self.backend.eos_token_ids
        if len(rows) == len(seqs) and all(row and eos.isdisjoint(row) for row in rows):
            self._items = Unrecorded(seqs, rows)
            self._behind = True
            if self._speculative:
                self._observe_speculation(rows)
        else:
            self._deliver(seqs, rows, what)

    def _quiet_decodes(self, batch: list[Sequence]) -> int:
        """How many more decodes of `batch` finish no sequence by length (max_new_tokens,
        max_length): with up to m tokens a decode (`Backend.max_tokens_per_step`), the
        j-th can finish one with `left` tokens to go once j * m >= left, so the first
        (left - 1) // m cannot. 0 for a batch with a request that asked for logprobs: the
        backend's are read right after each decode."""
        if any(s.sampling.logprobs is not None for s in batch):
            return 0
        limit = self.backend.max_length
        left = min(min(s.max_new_tokens, limit - len(s.prompt_ids)) - len(s.generated)
                   for s in batch)
        return (left - 1) // self.backend.max_tokens_per_step

    def _settle(self) -> None:
        """Wait until the output side recorded every `Unrecorded` decode handed over: a
        sequence's tokens are added in order, here or there."""
        if self._behind:
            self._behind = False
            if self._output is not None:
                self._output.wait_idle()

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
                [s.sampling for s in newcomers], [s.slot for s in running],
                *_grammars(newcomers))
        except Exception:
            logger.warning("packed step of %d newcomers and %d running sequences failed; "
                           "running them apart", len(newcomers), len(running), exc_info=True)
            return False
        self._deliver(newcomers, [[t] for t in first], "prefill")
        self._deliver(running, following, "decode")
        return True

    def _prefill(self, seqs: list[Sequence]) -> None:
        """Micro: the micro-batch lives or dies together (as the reference does). Continuous:
        newcomers share one call, and if it fails each is retried alone so only the culprit
        fails."""
        def run(group: list[Sequence]) -> Rows:
            return [[t] for t in self.backend.prefill(
                [s.slot for s in group], [s.prompt_ids for s in group],
                [s.sampling for s in group], *_grammars(group))]

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

    def _call(self, seqs: list[Sequence], fn: Callable[[], Rows], what: str,
              deliver: Callable[[list[Sequence], Rows, str], None] | None = None) -> None:
        try:
            rows = fn()
        except Exception:
            ids = ", ".join(s.request_id for s in seqs)
            logger.exception("%s failed for request(s) %s", what, ids)
            self._fail(seqs, 500, f"generation failed ({what}); the worker log has the details")
            return
        (deliver or self._deliver)(seqs, rows, what)

    def _deliver(self, seqs: list[Sequence], rows: Rows, what: str) -> None:
        self._settle()
        if len(rows) != len(seqs) or not all(rows):
            logger.error("%s returned %d rows (%d empty) for %d sequences", what, len(rows),
                         sum(not r for r in rows), len(seqs))
            self._fail(seqs, 500, f"generation failed ({what}); the worker log has the details")
            return
        eos, max_length = self.backend.eos_token_ids, self.backend.max_length
        if self._speculative:
            if what == "decode":
                self._observe_speculation(rows)
            else:
                self._observe("DeviceTokens", sum(map(len, rows)), "count")
        finished = []
        for seq, row in zip(seqs, rows, strict=True):
            kept, reason = seq.extend(row, eos, max_length)
            if seq.sampling.logprobs is not None:  # only requests that ask pay for this
                self._record_logprobs(seq)
            self._items.append((seq, kept, reason))
            if reason is not None:
                finished.append(seq)
        if finished:  # their slots are free for the next step's newcomers
            self._release(finished)

    def _observe_speculation(self, rows: Rows) -> None:
        """A speculative decode's tokens (DeviceTokens), and vLLM's counts: a draft of
        `max_tokens_per_step - 1` tokens per sequence, of which all but the target's own
        last token were accepted."""
        emitted = sum(map(len, rows))
        self._observe("DeviceTokens", emitted, "count")
        k = self.backend.max_tokens_per_step - 1
        self._observe("SpecDecode", SpecDecode(len(rows), k * len(rows), emitted - len(rows),
                                               emitted), "count")

    def _record_logprobs(self, seq: Sequence) -> None:
        """The backend's logprob of the token just added (and, after prefill, the prompt's)."""
        if seq.logprobs is None:
            seq.logprobs = []
            if seq.sampling.prompt_logprobs is not None:
                seq.prompt_logprobs = self.backend.prompt_logprobs(seq.slot)
        seq.logprobs.append(self.backend.token_logprobs(seq.slot))

    def _release(self, seqs: list[Sequence]) -> None:
        self._batch = None  # the next step is a full one
        with self._cond:
            slots = [slot for slot in (self.scheduler.finish(s) for s in seqs) if slot is not None]
        if slots:
            try:
                self.backend.release(slots)
            except Exception:
                logger.exception("release of slots %s failed", slots)

    def _fail(self, seqs: list[Sequence], status: int, message: str) -> None:
        self._release(seqs)
        self._items += [(seq, None, ErrorEvent(status, message)) for seq in seqs]

    # -- the output side ----------------------------------------------------------------
    def emit(self, items: list[Item] | Unrecorded) -> None:
        """A step's output: text, stop strings, metrics, then every event to its sink -- a
        sequence's ends after its text, each event loop woken once. A sequence that ended
        (`done`) gets nothing more: a stop string may end it before the engine knows."""
        if type(items) is Unrecorded:
            items = self._record(items)
        out: list[tuple[Sequence, Event]] = []
        now = time.monotonic()
        gaps: list[float] = []  # inter-token latency of each sequence given tokens
        for seq, tokens, what in items:
            if seq.done:
                continue
            if tokens is not None:
                if seq.shown == 0:
                    self._observe("TimeToFirstToken",
                                  (seq.first_token_at - seq.arrived_at) * 1000, "ms")
                elif tokens:
                    gaps.append(now - seq.last_token_at)
                if tokens:
                    seq.last_token_at = now
                text, reason = seq.render(tokens, what)
                if text:
                    out.append((seq, TextEvent(text, seq.shown)))
                if reason is not None:
                    out.append((seq, self._finish(seq, reason)))
            elif what == "timeout":
                if text := seq.cut():
                    out.append((seq, TextEvent(text)))
                out.append((seq, self._finish(seq, "timeout")))
            else:
                seq.done = True
                self._observe_end(seq, "abort" if what.status == 499 else "error", now)
                out.append((seq, what))
        if gaps:  # most rows of a step share their gap (the last step's output time)
            self._observe("InterTokenLatency", tuple(Counter(gaps).items()), "s")
        deliver(out)
        self._after_step()

    def _record(self, step: Unrecorded) -> list[Item]:
        """An `Unrecorded` decode's tokens added to their sequences. A finish found here
        (none is expected) ends the sequence on this side, like a stop string: it leaves
        at the next step."""
        eos, max_length = self.backend.eos_token_ids, self.backend.max_length
        return [(seq, *seq.extend(row, eos, max_length))
                for seq, row in zip(step.seqs, step.rows, strict=True)]

    def _finish(self, seq: Sequence, reason: str) -> Event:
        seq.done = True
        with self._cond:  # the output thread's one write of engine state
            self._poked = True  # after `done`: a stop string's end leaves at the next step
        self._observe("GeneratedTokens", seq.shown, "count")
        self._observe_end(seq, reason, time.monotonic())
        return seq.finish_event(reason)

    def _observe_end(self, seq: Sequence, reason: str, now: float) -> None:
        """vLLM's per-request intervals (Finished): queue (arrival to a slot), prefill (slot
        to first token), decode (first token to the end); those it never reached are None."""
        admitted, first = seq.admitted_at, seq.first_token_at
        self._observe("RequestFinished", Finished(
            reason, len(seq.prompt_ids) if first is not None else None, seq.shown,
            now - seq.arrived_at,
            None if admitted is None else admitted - seq.arrived_at,
            None if admitted is None or first is None else first - admitted,
            None if first is None else now - first), "")


class OutputThread:
    """Runs each step's output (`emit`) on its own thread, one step behind the engine.

    `put` hands step N+1's output over once step N's is done: what step N's output
    decided (a stop string) is known before step N+2, and a slow output side slows
    the engine instead of queueing without bound. Two C-level queues, not a Condition:
    the hand-over sits between two device calls, where threading.Condition's Python
    code measured ~20 us more (the wake-up itself, a futex, is the same).

    `put_nowait` is for a prefill's first tokens, which should not wait a whole decode
    for the output side: right after a decode the output side is nearly always busy with
    it, so they go in the queue behind that step (`_Behind`: emitted before anything put
    later, and not waited for by the next `put`), at most one such item per step. At 32
    closed-loop streams on a 10 ms device step they reached the worker ~12 ms after the
    prefill while they waited for the next decode's hand-over."""

    _STOP = object()

    def __init__(self, emit: Callable[[list[Item] | Unrecorded], None]) -> None:
        self._emit = emit
        self._todo: queue.SimpleQueue = queue.SimpleQueue()  # steps' outputs, then _STOP
        self._free: queue.SimpleQueue = queue.SimpleQueue()  # one token while not busy
        self._free.put(None)
        #: one token per `_Behind` item emitted; `_behind` (engine thread only): how many
        #: were queued and not yet counted back
        self._behind_done: queue.SimpleQueue = queue.SimpleQueue()
        self._behind = 0
        self._thread = threading.Thread(target=self._run, name="inf2serve-output", daemon=True)
        self._thread.start()

    def put(self, items: list[Item] | Unrecorded) -> None:
        if self._behind:
            self._count_behind(block=False)
        self._free.get()  # waits while the previous step's output runs
        self._todo.put(items)

    def wait_idle(self) -> None:
        """Until everything handed over is done."""
        self._count_behind(block=True)
        self._free.put(self._free.get())

    def put_nowait(self, items: list[Item]) -> None:
        """Hand `items` over now: at once if the output side is idle, else behind the step
        it is on (before anything `put` after)."""
        try:
            self._free.get_nowait()
        except queue.Empty:
            self._behind += 1
            self._todo.put(_Behind(items))
            return
        self._todo.put(items)

    def _count_behind(self, block: bool) -> None:
        while self._behind:
            try:
                self._behind_done.get(block)
            except queue.Empty:
                return
            self._behind -= 1

    def stop(self, timeout_s: float = 10) -> None:
        """After the output handed over so far is done."""
        self._todo.put(self._STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (items := self._todo.get()) is not self._STOP:
            behind = type(items) is _Behind
            try:
                self._emit(items.items if behind else items)
            except Exception:  # this thread must outlive anything a step's output can do
                logger.exception("engine output failed")
            (self._behind_done if behind else self._free).put(None)


class _Behind(NamedTuple):
    """A prefill's first tokens queued behind the step the output side is on."""

    items: list[Item]


def _grammars(seqs: list[Sequence]) -> tuple[list, ...]:
    """The newcomers' grammars as the backend's last argument; none at all when none has
    one (the common case: the call is what it always was)."""
    if all(s.grammar is None for s in seqs):
        return ()
    return ([s.grammar for s in seqs],)
