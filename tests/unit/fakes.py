"""Pure-Python stand-ins for the model side, recording what was asked of them."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from handlers.backends.base import Backend, Capabilities, SamplingParams


class CountingBackend(Backend):
    """Next token = previous + 1 (first = last prompt token + 1); EOS when it hits `eos`.

    Deterministic per sequence and independent of batching, so a sequence must
    produce the same tokens whoever it shares the batch with. With `tokens_per_step` k, a
    decode yields the next k counts of each row at once (a speculative step that accepts
    everything), running past any end the engine must cut at.
    """

    def __init__(self, batch_size: int = 4, max_length: int = 64, eos: int = 10_000,
                 fail_prefill_on: int | None = None, fail_decode_at: int | None = None,
                 tokens_per_step: int = 1):
        self.max_tokens_per_step = tokens_per_step
        if tokens_per_step > 1:  # a backend's logprobs are of one token a step
            self.capabilities = Capabilities.lacking(("logprobs", "prompt_logprobs"),
                                                     "several tokens a step")
        self.batch_size = batch_size
        self.max_length = max_length
        self.max_prompt_length = max_length - 1
        self.eos_token_ids = frozenset([eos])
        self.last: dict[int, int] = {}
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.fail_prefill_on = fail_prefill_on
        self.fail_decode_at = fail_decode_at
        self.decodes = 0
        self.threads = {threading.get_ident()}  # every thread that touched the "model"

    def warmup(self) -> None:
        self.threads.add(threading.get_ident())

    def _prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                 params: Sequence[SamplingParams]) -> list[int]:
        self.calls.append(("prefill", tuple(slots)))
        self.threads.add(threading.get_ident())
        if self.fail_prefill_on is not None and any(self.fail_prefill_on in p for p in prompts):
            raise RuntimeError("injected prefill failure")
        for slot, prompt in zip(slots, prompts, strict=True):
            self.last[slot] = prompt[-1] + 1
        return [self.last[s] for s in slots]

    def _decode(self, slots: Sequence[int]) -> list[list[int]]:
        self.calls.append(("decode", tuple(slots)))
        self.threads.add(threading.get_ident())
        self.decodes += 1
        if self.fail_decode_at is not None and self.decodes == self.fail_decode_at:
            raise RuntimeError("injected decode failure")
        k, rows = self.max_tokens_per_step, []
        for slot in slots:
            rows.append(list(range(self.last[slot] + 1, self.last[slot] + 1 + k)))
            self.last[slot] += k
        return rows

    def _release(self, slots: Sequence[int]) -> None:
        self.calls.append(("release", tuple(slots)))
        for slot in slots:
            self.last.pop(slot, None)


class PackingBackend(CountingBackend):
    """A CountingBackend whose `step` runs prefill and decode as one call (all or nothing)."""

    mixes_prefill = True

    def _step(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
              params: Sequence[SamplingParams], running: Sequence[int]
              ) -> tuple[list[int], list[list[int]]]:
        self.calls.append(("step", tuple(slots), tuple(running)))
        self.threads.add(threading.get_ident())
        if self.fail_prefill_on is not None and any(self.fail_prefill_on in p for p in prompts):
            raise RuntimeError("injected step failure")
        following = [self.last[s] + 1 for s in running]
        self.last.update(zip(running, following, strict=True))
        first = [p[-1] + 1 for p in prompts]
        self.last.update(zip(slots, first, strict=True))
        return first, [[t] for t in following]


class CharTokenizer:
    """Token id = a character code point; decode joins them."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i < 0x110000)


def one_each(rows: list[list[int]]) -> list[int]:
    """A decode's rows of one token each, as plain tokens (fails on any other row)."""
    assert all(len(row) == 1 for row in rows), rows
    return [row[0] for row in rows]
