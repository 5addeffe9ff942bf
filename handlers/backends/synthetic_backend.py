"""A device that only takes time: no model, no weights, real tokens.

For measuring the serving path's host efficiency (served tokens/s against what a device
of a given step time allows) and for developing without Inferentia2: the engine,
scheduler, engine process and TorchServe path are the real ones; only the model call is
replaced by a sleep of the configured device time (handlers/presets/synthetic_timing.py).
Never a hardware result.

- A call ends at a deadline taken at its start, never before, so the backend's own host
  work (picking tokens) hides inside it; the wait releases the GIL, as a Neuron device
  call does. `StepTimer` keeps the end on the deadline: a plain sleep wakes ~0.1 ms late
  on a VM, which would lengthen every step by that much and count as host loss.
- Tokens are real ids from the checkpoint's tokenizer (only config.json and the
  tokenizer are read) that begin a word and decode to plain text; special tokens and
  EOS are never emitted, so every request runs to its max_new_tokens. Greedy rows are
  a pure function of (prompt, position); sampling rows of (seed, prompt, position), or
  random without a seed -- so tests can assert outputs.
- The slot contract is every backend's, checked by the base class: prefill into a busy
  slot raises, and a decode must name exactly the running slots.
- With `handler.synthetic.host_sampling_vocab` (`HostSampling`), every call also
  "returns" logits [rows, vocab] and the host picks each row's token from them with the
  batched sampler the Neuron backends use (handlers/backends/sampling/), after the deadline:
  on Neuron the host samples once the device has returned its logits, before the next
  device call can start, so that time lengthens the step. The synthetic token's logit
  is raised far above the rest first, so greedy and sampled rows both pick it and the
  outputs stay those without the option.
- With host sampling, requests with a grammar (structured outputs) run too: their masks
  are filled while the device step runs (SlotGrammars, as on Neuron), the synthetic model
  picks an allowed token for such a row (handlers/backends/synthetic_grammar.py), and the
  host's sampler has to find it through the mask.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import select
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handlers.backends.base import Backend, Capabilities, Rows, SamplingParams, read_eos_ids
from handlers.backends.synthetic_logits import HostSampling
from handlers.config import HandlerConfig
from handlers.errors import ConfigError, RequestError
from handlers.presets.synthetic_timing import DeviceTiming, resolve_timing

logger = logging.getLogger(__name__)
_MASK = (1 << 64) - 1
_SPECULATION = 0x5DEECE66D  # salts the acceptance draws apart from the token draws
#: a token that starts a word: sentencepiece "▁" or byte-level BPE "Ġ", then letters
_WORD = re.compile(r"^[\u2581\u0120][A-Za-z]{2,}$")
MIN_WORDS = 16


def tighten_timer_slack() -> bool:
    """Linux wakes a sleeping thread up to its timer slack (50 us by default) late, on top
    of scheduling delay; 1 us for the calling thread, so a device step ends when it should.
    Measured on the 2-core bench host, time.sleep(5 ms) came back a median 136 us late
    with the default slack and 83 us with 1 us. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    pr_set_timerslack = 29  # linux/prctl.h
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(pr_set_timerslack, 1000, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _mix(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash of an int."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def word_token_ids(tokenizer, vocab_size: int, excluded: frozenset[int]) -> tuple[int, ...]:
    """Ids that start a word and decode to letters, sorted; the synthetic model's vocabulary."""
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(excluded)
    ids = range(min(vocab_size, len(tokenizer)))
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    words = tuple(i for i, p in zip(ids, pieces, strict=True)
                  if i not in special and isinstance(p, str) and _WORD.match(p))
    if len(words) < MIN_WORDS:  # an unusual tokenizer: any id whose text is a plain word
        words = tuple(i for i in ids if i not in special
                      and re.fullmatch(r" ?[A-Za-z]{2,}", tokenizer.decode([i]) or ""))
    if len(words) < MIN_WORDS:
        raise ConfigError(f"handler.backend synthetic: the tokenizer has only {len(words)} "
                          "plain-word tokens; use a checkpoint with a word-level vocabulary")
    return words


def read_checkpoint_ids(checkpoint: Path) -> tuple[int, frozenset[int]]:
    """vocab_size and EOS ids from config.json / generation_config.json (what generate uses)."""
    cfg_path = checkpoint / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"handler.checkpoint: {checkpoint} has no config.json")
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    if not isinstance(vocab, int):
        raise ConfigError(f"handler.checkpoint: {cfg_path} has no integer vocab_size")
    return vocab, read_eos_ids(checkpoint, cfg)


def _poll() -> None:
    """Releases the GIL for a moment and keeps the CPU: select() with nothing to wait on
    and a zero timeout returns at once (~1.7 us on the bench host)."""
    select.select((), (), (), 0)


class StepTimer:
    """Ends a device call at its deadline, never before, on the calling thread.

    It sleeps until `lead` before the deadline, then polls the clock until the deadline
    passes, releasing the GIL at each poll (`_poll`) but not the CPU. `lead` is learned:
    the LEAD_QUANTILE of how late the last LEAD_WINDOW sleeps woke (capped at
    LEAD_MAX_S), so the polling stays short and a late wake-up (the tail) is not made
    later. Measured on the 2-core bench host, 5 ms steps: time.sleep ended a median
    100-150 us late, this a median ~5 us, for ~80 us more CPU per step.

    It used to yield the CPU instead (os.sched_yield). When another task is runnable,
    that hands it the rest of a time slice -- up to a 4 ms tick there (HZ=250) -- and
    at 32 served streams the yielding made half of the steps' lateness: mean 242-281
    -> 128-147 us, p90 490-800 -> 125-134 us (3 paired rounds, 1,500 steps each). What
    remains is the tail of the sleep itself (a busy or descheduled vCPU at wake-up).
    Polling is held to a quarter of the wait (POLL_SHARE_MAX): a stretch that keeps the
    CPU takes it from the host work the benchmark measures."""

    LEAD_WINDOW = 32
    LEAD_QUANTILE = 0.75
    LEAD_MAX_S = 0.001
    #: the most of a wait spent polling: a 2 ms step (tests) on a busy host, where the lead
    #: grows to its cap, polls 0.5 ms, not half the step, and a 1 ms step still sleeps
    POLL_SHARE_MAX = 0.25

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep,
                 poll: Callable[[], None] = _poll) -> None:
        self._clock, self._sleep, self._poll = clock, sleep, poll
        self.lead = 0.0
        self._late: list[float] = []
        self._thread: int | None = None  # the thread whose timer slack was tightened

    def wait_until(self, deadline: float) -> None:
        if self._sleep is time.sleep and self._thread != threading.get_ident():
            self._thread = threading.get_ident()  # the engine thread, once
            tighten_timer_slack()
        now = self._clock()
        wake = deadline - min(self.lead, self.POLL_SHARE_MAX * (deadline - now))
        left = wake - now
        if left > 0:
            self._sleep(left)
            self._learn(self._clock() - wake)
        while self._clock() < deadline:
            self._poll()

    def _learn(self, late: float) -> None:
        self._late.append(late)
        if len(self._late) == self.LEAD_WINDOW:
            typical = sorted(self._late)[int(self.LEAD_WINDOW * self.LEAD_QUANTILE)]
            self.lead = min(max(typical, 0.0), self.LEAD_MAX_S)
            self._late.clear()


@dataclass
class _Row:
    key: int  # hash of (prompt, seed): what this row's tokens are a function of
    position: int  # absolute position of the next token
    rng: random.Random | None  # sampling without a seed
    sampler: Any = None  # handlers.backends.sampling.RowSampler, with host sampling


NO_LOGITS = Capabilities.lacking(
    ("repetition_penalty", "frequency_penalty", "presence_penalty", "logprobs",
     "prompt_logprobs"), "handler.backend synthetic runs no model, so it has no logits")


def capabilities(config: HandlerConfig) -> Capabilities:
    """What the synthetic device honours: no penalties or logprobs (no model), and a grammar
    only where the host samples its logits, one token a step."""
    why = ""
    if not config.synthetic.host_sampling_vocab:
        why = ("handler.synthetic.host_sampling_vocab is 0: the synthetic device returns no "
               "logits to mask; set it to the model's vocab_size")
    if config.synthetic.speculation_length:
        why = ("handler.synthetic.speculation_length: drafts are accepted on the device, "
               "where no grammar is checked; set it to 0")
    return Capabilities({**NO_LOGITS.unsupported, "grammar": why}) if why else NO_LOGITS


class SyntheticBackend(Backend):
    capabilities = NO_LOGITS

    def __init__(self, checkpoint: Path, config: HandlerConfig, *, tokenizer=None,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.timing: DeviceTiming = resolve_timing(config.synthetic, config.max_length)
        #: a prefill is one context call under micro batching, one per prompt otherwise
        self._one_call = config.batching == "micro"
        self.batch_size = config.batch_size
        self.max_length = config.max_length
        self.max_prompt_length = min(self.timing.buckets[-1], config.max_length - 1)
        vocab, self.eos_token_ids = read_checkpoint_ids(checkpoint)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.words = word_token_ids(tokenizer, vocab, self.eos_token_ids)
        self._clock = clock
        self._timer = StepTimer(clock, sleep)
        self._rows: dict[int, _Row] = {}
        self._decode_s = self.timing.decode_s(self.batch_size)
        self._host: HostSampling | None = None
        self._steer = None
        host_vocab = config.synthetic.host_sampling_vocab
        if host_vocab:
            if host_vocab <= max(self.words):
                raise ConfigError(f"handler.synthetic.host_sampling_vocab: {host_vocab} cannot "
                                  f"hold the checkpoint's word tokens (ids up to "
                                  f"{max(self.words)}); set it above that (e.g. the model's "
                                  f"vocab_size, {vocab}) or to 0")
            if self.timing.speculation_length:
                raise ConfigError("handler.synthetic.host_sampling_vocab: host sampling with "
                                  "speculation_length is not modelled; set one of them to 0")
            self._host = HostSampling(self.batch_size, host_vocab, self.eos_token_ids,
                                      layout=config.synthetic.host_sampling_logits,
                                      read_once=config.synthetic.host_sampling_floor)
            from handlers.backends.synthetic_grammar import GrammarSteer, json_ids
            from handlers.structured.masks import SlotGrammars

            self.grammars = SlotGrammars(self.batch_size, host_vocab)
            pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab, len(tokenizer)))))
            self._steer = GrammarSteer(json_ids(pieces, host_vocab), self.words,
                                       min(self.eos_token_ids, default=0))
        self.capabilities = capabilities(config)
        self.max_tokens_per_step = self.timing.speculation_length + 1
        logger.info("synthetic device: decode %.2f ms at batch %d, prefill %s ms for buckets "
                    "%s, %d word tokens", self._decode_s * 1000, self.batch_size,
                    list(self.timing.prefill_ms), list(self.timing.buckets), len(self.words))

    # -- Backend interface ------------------------------------------------------------
    def _prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                 params: Sequence[SamplingParams]) -> list[int]:
        start = self._clock()
        for prompt in prompts:
            if not 0 < len(prompt) <= self.max_prompt_length:
                raise RequestError("prompt", f"{len(prompt)} tokens; expected 1 to "
                                   f"{self.max_prompt_length}")
        rows = [self._new_row(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        masks = self._start_masks(slots)
        tokens = [self._next(row) for row in rows]
        if self._host is not None:
            for row, prompt, p in zip(rows, prompts, params, strict=True):
                row.sampler = self._host.sampler(p, prompt)
        masks = self._steered(masks, rows, tokens)
        self._rows.update(zip(slots, rows, strict=True))
        if self._host is not None:  # the device's logits, within its time
            self._host.emit(tokens, slots)
        self._wait(start, self.timing.prefill_s([len(p) for p in prompts], self._one_call))
        if self._host is not None:  # after the device call, as on Neuron
            tokens = self._host.pick([row.sampler for row in rows], tokens, masks, slots)
            self.grammars.took(slots, tokens)
        return tokens

    def _decode(self, slots: Sequence[int]) -> Rows:
        start = self._clock()
        if self.timing.speculation_length:
            rows = [self._speculate(self._rows[s]) for s in slots]
            self._wait(start, self._decode_s)
            return rows
        masks = self._start_masks(slots)
        rows = [self._rows[s] for s in slots]
        tokens = [self._next(row) for row in rows]
        masks = self._steered(masks, rows, tokens)
        if self._host is not None:  # the device's logits, within its time
            self._host.emit(tokens, slots)
        self._wait(start, self._decode_s)
        if self._host is not None:  # after the device call, as on Neuron
            tokens = self._host.pick([row.sampler for row in rows], tokens, masks, slots)
            self.grammars.took(slots, tokens)
        return [[token] for token in tokens]

    def _start_masks(self, slots: Sequence[int]) -> bool:
        """Begin filling the constrained rows' masks (they fill while the device runs)."""
        if self.grammars is None or not self.grammars.any(slots):
            return False
        self.grammars.start(list(slots))
        return True

    def _steered(self, started: bool, rows: list[_Row], tokens: list[int]) -> Any:
        """The step's masks, once filled, and the constrained rows' synthetic tokens changed
        to ones their masks allow (within the device's time, as the model's own work)."""
        if not started:
            return None
        masks = self.grammars.masks()
        keys = [_mix(rows[i].key ^ _mix(rows[i].position)) for i in masks.rows.tolist()]
        for i, token in zip(masks.rows.tolist(), self._steer.tokens(masks, keys), strict=True):
            tokens[i] = token
        return masks

    def _speculate(self, row: _Row) -> list[int]:
        """The accepted draft tokens and the target's: the same tokens a step of one would
        give (lossless), 1 to k + 1 of them. Whether draft i is accepted is a draw keyed on
        the row and its position (a seeded or greedy row's pattern repeats; an unseeded
        sampled row's comes from its own random generator)."""
        k, rate = self.timing.speculation_length, self.timing.acceptance_rate
        accepted = 0
        while accepted < k:
            u = (row.rng.random() if row.rng is not None
                 else _mix(row.key ^ _mix(row.position + accepted) ^ _SPECULATION) / 2.0**64)
            if u >= rate:
                break
            accepted += 1
        return [self._next(row) for _ in range(accepted + 1)]

    def _release(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self._rows.pop(slot, None)

    # -- the synthetic model ----------------------------------------------------------
    def _new_row(self, prompt: Sequence[int], p: SamplingParams) -> _Row:
        digest = hashlib.blake2b(",".join(map(str, prompt)).encode(), digest_size=8).digest()
        key = int.from_bytes(digest, "little")
        rng = None
        if not p.greedy:
            if p.seed is None:
                rng = random.Random()
            else:
                key = _mix(key ^ _mix(p.seed & _MASK))
        return _Row(key, len(prompt), rng)

    def _next(self, row: _Row) -> int:
        if row.rng is not None:
            token = self.words[row.rng.randrange(len(self.words))]
        else:
            token = self.words[_mix(row.key + row.position) % len(self.words)]
        row.position += 1
        return token

    def _wait(self, start: float, seconds: float) -> None:
        self._timer.wait_until(start + seconds)
