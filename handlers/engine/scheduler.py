"""Who runs next: slots, admission, finishing, cancellation. Pure Python.

The scheduler holds no model and no threads; the engine calls it under a lock.
Two policies share it:
- continuous: a waiting request takes any free slot at the next step;
- micro: static micro-batches (the reference Inf2 design) -- up to
  micro_batch_size requests start together and no one joins until all of them
  have finished; each still leaves (and its stream closes) as soon as it is done.
  A micro-batch starts when it is full or its oldest request has waited
  batch_delay_s, as TorchServe's batchSize/maxBatchDelay would. Where one device
  call samples every row alike (`group`), a micro-batch takes only the waiting
  requests of its oldest one's group, and a request of no group runs alone.
Admission is first-come, first-served in both: the oldest waiting request goes first.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from handlers.backends.base import SamplingParams, TokenLogprob
from handlers.engine.detokenize import IncrementalDetokenizer, StopMatcher, Tokenizer
from handlers.errors import CapacityError


@dataclass(frozen=True)
class TextEvent:
    text: str
    tokens: int = 0  # tokens rendered so far (OpenAI's continuous usage stats)


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # stop | length | timeout (its deadline passed while it ran)
    prompt_tokens: int
    completion_tokens: int
    text: str  # the whole generated text, for non-streaming answers
    token_ids: tuple[int, ...] = ()
    #: per generated token, when the request asked (SamplingParams.logprobs)
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: per prompt token (the first: None), when it asked (SamplingParams.prompt_logprobs)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True)
class ErrorEvent:
    status: int
    message: str
    retry_after_s: int = 0  # > 0: a Retry-After header goes with it (503)
    field: str = ""  # the request field a 4xx names (a grammar that failed to compile)


Event = TextEvent | FinishEvent | ErrorEvent
Sink = Callable[[Event], None]


@dataclass(eq=False)
class Sequence:
    """One request's generation state. Never calls the model.

    Split between two threads: the engine thread records token ids and the finish they
    decide (`extend`); the output side turns them into text and finds stop strings
    (`render`, `cut`), one step behind (handlers/engine/core.py)."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    sink: Sink
    tokenizer: Tokenizer
    arrived_at: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() after which it stops; None = never
    slot: int | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None  # output side: when its last tokens went out
    generated: list[int] = field(default_factory=list)  # `extend`: every token kept
    shown: int = 0  # output side: tokens turned into text (a prefix of `generated`)
    cancelled: bool = False
    done: bool = False  # output side: its last event went out (it leaves at the next step)
    #: engine thread, only for a request that asked (SamplingParams.logprobs): per token
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    #: structured outputs: the request's RowGrammar (handlers.structured.masks), made from
    #: its compiled grammar before admission (`sampling.grammar`); None for a free request
    grammar: Any = None

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer)
        self._stopper = StopMatcher(self.stop)
        self._text: list[str] = []

    def extend(self, tokens: list[int], eos_ids: frozenset[int],
               max_length: int) -> tuple[list[int], str | None]:
        """Record a step's generated tokens up to the first that ends the sequence (EOS:
        "stop"; max_new_tokens or max_length: "length"); return the tokens kept and that
        finish reason, else None. A step may yield several tokens (speculation) and run
        past the end: what follows the end is dropped, so the answer is the one a step
        of one token at a time would give."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        done = len(self.generated)
        room = min(self.max_new_tokens, max_length - len(self.prompt_ids)) - done
        reason = None
        if not self.sampling.ignore_eos and not eos_ids.isdisjoint(tokens):
            end = next(i for i, t in enumerate(tokens) if t in eos_ids) + 1
            if end <= room:
                reason = "stop"
                tokens = tokens[:end] if end < len(tokens) else tokens
        if reason is None and len(tokens) >= room:
            reason = "length"
            tokens = tokens[:room] if room < len(tokens) else tokens
        self.generated += tokens
        return tokens, reason

    def add(self, token: int, eos_ids: frozenset[int], max_length: int) -> str | None:
        """`extend` by one token; return the finish reason."""
        return self.extend([token], eos_ids, max_length)[1]

    def render(self, tokens: list[int], reason: str | None) -> tuple[str, str | None]:
        """Output side: the text `tokens` (the next ones `extend` kept, ending with the one
        that decided `reason`) complete, cut at the first stop string; return it and the
        finish reason (`extend`'s, or "stop" on a stop string). Tokens after a stop string
        are not shown: `shown` counts up to the one that completed it."""
        if len(tokens) == 1:
            return self._render(tokens[0], reason)
        out = []
        last = len(tokens) - 1
        for i, token in enumerate(tokens):
            text, end = self._render(token, reason if i == last else None)
            out.append(text)
            if end is not None:
                return "".join(out), end
        return "".join(out), None

    def _render(self, token: int, reason: str | None) -> tuple[str, str | None]:
        self.shown += 1
        delta = "" if reason == "stop" else self._detok.push(token)  # "stop" here: EOS
        if reason is not None:
            delta += self._detok.flush()
        text, hit = self._stopper.feed(delta)
        if hit:
            reason = "stop"
        elif reason is not None:
            text += self._stopper.flush()
        self._text.append(text)
        return text, reason

    def append(self, token: int, eos_ids: frozenset[int],
               max_length: int) -> tuple[str, str | None]:
        """Add a generated token; return (new text, finish reason or None)."""
        return self._render(token, self.add(token, eos_ids, max_length))

    def cut(self) -> str:
        """End early (deadline): the text held back so far -- an incomplete character, a
        partial stop-string match -- which now will never complete."""
        text, _ = self._stopper.feed(self._detok.flush())
        text += self._stopper.flush()
        self._text.append(text)
        return text

    def finish_event(self, reason: str) -> FinishEvent:
        """The last event, counting the tokens rendered: a sequence that hit a stop string
        may have generated one more, which the engine had started before it knew."""
        n = self.shown
        logprobs = None if self.logprobs is None else tuple(self.logprobs[:n])
        prompt = None if self.prompt_logprobs is None else tuple(self.prompt_logprobs)
        return FinishEvent(reason, len(self.prompt_ids), n, "".join(self._text),
                           tuple(self.generated[:n]), logprobs, prompt)


class Scheduler:
    def __init__(self, slots: int, policy: str = "continuous", micro_batch_size: int = 0,
                 max_queue: int = 64, batch_delay_s: float = 0.0,
                 group: Callable[[Sequence], Hashable | None] | None = None) -> None:
        """`group` (micro only): the key of the requests that may share a micro-batch, None
        for one that must run alone; None = any requests may."""
        if policy not in ("continuous", "micro"):
            raise ValueError(f"policy {policy!r}: choose 'continuous' or 'micro'")
        self.group = group
        self.slots = slots
        self.policy = policy
        self.micro_batch_size = min(micro_batch_size or slots, slots)
        self.max_queue = max_queue
        self.batch_delay_s = batch_delay_s
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first

    def submit(self, seq: Sequence) -> None:
        """Queue `seq`. max_queue bounds the requests waiting for a slot: those that free
        slots will take at the next step are not counted, so this bound and the worker's
        (batch_size + max_queue in flight) agree however fast the engine admits."""
        queued = len(self.waiting) - len(self._free)
        if queued >= self.max_queue:
            raise CapacityError(f"{queued} requests are waiting (handler.max_queue="
                                f"{self.max_queue}); retry later or add workers")
        self.waiting.append(seq)

    def _micro_batch(self, now: float) -> list[Sequence]:
        """The next micro-batch if it may start now (full, or its oldest request is due)."""
        if self.running or not self.waiting:
            return []
        head = self.waiting[0]
        if self.group is None:
            batch = list(itertools.islice(self.waiting, self.micro_batch_size))
        elif (key := self.group(head)) is None:
            return [head]  # runs alone: nothing can join it, so nothing to wait for
        else:
            batch = [s for s in self.waiting if self.group(s) == key][:self.micro_batch_size]
        full = len(batch) >= self.micro_batch_size
        due = now - head.arrived_at >= self.batch_delay_s
        return batch if full or due else []

    def wait_time(self, now: float | None = None) -> float | None:
        """Seconds until admission could happen without a new arrival; None = no such time."""
        now = time.monotonic() if now is None else now
        if self.running:
            return 0.0
        if self.policy == "continuous":
            return 0.0 if self.waiting and self._free else None
        if not self.waiting:
            return None
        if self._micro_batch(now):
            return 0.0
        return max(0.0, self.waiting[0].arrived_at + self.batch_delay_s - now)

    def admit(self, now: float | None = None) -> list[Sequence]:
        """Give free slots to waiting requests, as the policy allows."""
        now = time.monotonic() if now is None else now
        if self.policy == "continuous":
            batch = [self.waiting.popleft()
                     for _ in range(min(len(self._free), len(self.waiting)))]
        else:
            batch = self._micro_batch(now)
            taken = set(map(id, batch))  # a group's requests need not be adjacent
            self.waiting = deque(s for s in self.waiting if id(s) not in taken)
        for seq in batch:
            seq.slot = self._free.pop()
            seq.admitted_at = now
            self.running[seq.slot] = seq
        return batch

    def finish(self, seq: Sequence) -> int | None:
        """Free the sequence's slot (continuous: reusable at the next step); return it."""
        slot = seq.slot
        if slot is not None and self.running.get(slot) is seq:
            del self.running[slot]
            self._free.append(slot)
            seq.slot = None
            return slot
        return None

    def cancel(self, request_id: str) -> Sequence | None:
        """Drop a waiting request, or mark a running one for release at the next step."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.cancelled = True
                return seq
        for seq in self.running.values():
            if seq.request_id == request_id:
                seq.cancelled = True
                return seq
        return None

    def take_cancelled(self) -> list[tuple[int, Sequence]]:
        """Finish running sequences marked cancelled, or done (ended by a stop string on the
        output side); return (slot, sequence) for the backend."""
        gone = [s for s in self.running.values() if s.cancelled or s.done]
        return [(slot, s) for s in gone if (slot := self.finish(s)) is not None]

    def take_expired(self, now: float | None = None
                     ) -> tuple[list[Sequence], list[tuple[int, Sequence]]]:
        """Drop waiting sequences past their deadline and finish running ones; return
        (the waiting ones, (slot, sequence) of the running ones for the backend)."""
        now = time.monotonic() if now is None else now

        def due(s: Sequence) -> bool:
            return s.deadline is not None and now >= s.deadline

        waited = [s for s in self.waiting if due(s)]
        for seq in waited:
            self.waiting.remove(seq)
        ran = [s for s in self.running.values() if due(s) and not s.cancelled]
        return waited, [(slot, s) for s in ran if (slot := self.finish(s)) is not None]

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)
