"""Per-request matchers and the batched mask: fill every constrained row's allowed-token
bitmask in one call, then apply them to the logits in one operation, free rows untouched.

The mask for a row's next token depends only on the tokens it has accepted, so a
backend can `fill` the masks for step t+1 as soon as step t's tokens are accepted --
while the device runs step t+1 -- and `apply` them when its logits arrive; only `apply`
lengthens the step. `fill` hands all rows to llguidance's executor at once (its threads
drop the GIL); a bitmask row is one bit per token id, packed into int32 words (bit j of
word w is token 32 w + j), the layout of llguidance, xgrammar and vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

ALL = -1  # an int32 word with every bit set: 32 tokens allowed


class RowGrammar:
    """One request's grammar state: a matcher advanced on each token it accepts.

    `done` once the grammar is complete (only EOS may follow): the engine ends the
    request there with finish_reason "stop". `failed` says why a token was refused (a
    bug or a backend that sampled outside the mask), which ends the request."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.accepted = 0

    def accept(self, tokens: Sequence[int]) -> int:
        """Advance over `tokens`; how many were taken (fewer when the grammar refused one or
        completed before it)."""
        taken = 0
        for token in tokens:
            if self.matcher.is_stopped() or not self.matcher.consume_token(token):
                break
            taken += 1
        self.accepted += taken
        return taken

    @property
    def done(self) -> bool:
        """Complete: nothing but EOS can follow."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def accepting(self) -> bool:
        """What was generated so far is a whole answer (it may still go on)."""
        return self.matcher.is_accepting()

    @property
    def failed(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class MaskBatch:
    """The bitmask buffer of a backend's batch, [rows, words(vocab)] int32, reused every
    step, and llguidance's executor that fills it."""

    def __init__(self, rows: int, vocab_size: int, threads: int = 0) -> None:
        """threads: 0 fills the rows one after another on the calling thread (llguidance
        releases the GIL for each); n > 0 hands them to an llguidance executor of n
        threads in one call."""
        self.vocab_size = vocab_size
        self.bitmask = np.full((rows, words(vocab_size)), ALL, dtype=np.int32)
        self._executor = None
        if threads:
            import llguidance

            self._executor = llguidance.LLExecutor(threads)

    def fill(self, rows: Sequence[tuple[int, RowGrammar]]) -> None:
        """Compute the next-token mask of each (row index, grammar) into its bitmask row."""
        if not rows:
            return
        if self._executor is None:
            size = self.bitmask.shape[1] * 4
            for i, g in rows:
                g.matcher.unsafe_compute_mask_ptr(self.bitmask[i].ctypes.data, size)
            return
        from llguidance.numpy import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self._executor, [(g.matcher, i) for i, g in rows],
                                    self.bitmask)

    def apply(self, logits: Any, rows: Sequence[int], compact_limit: int = 0) -> Applied:
        """Enforce the masks of `rows` on logits [n, vocab] (`apply_bitmask`)."""
        return apply_bitmask(logits, self.bitmask, rows, compact_limit)


def allowed(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """[vocab_size] bool from one bitmask row."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


_POP8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.int32)


def popcount(packed: np.ndarray) -> np.ndarray:
    """[rows] allowed tokens per bitmask row ([rows, words] int32)."""
    if hasattr(np, "bitwise_count"):  # numpy 2
        return np.bitwise_count(packed.view(np.uint32)).sum(axis=1, dtype=np.int64)
    return _POP8[packed.view(np.uint8)].sum(axis=1, dtype=np.int64)


def _bits(packed: np.ndarray, rows: np.ndarray, cols: np.ndarray, value: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """(row position, token id) of every bit equal to `value` in the words packed[rows,
    cols], ordered by row, then id: only those words are unpacked."""
    chosen = np.ascontiguousarray(packed[rows, cols])
    bits = np.unpackbits(chosen.view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    j, b = np.nonzero(bits == value)
    return rows[j], cols[j].astype(np.int64) * 32 + b


@dataclass
class Applied:
    """The result of `apply_bitmask`: every constrained row is either masked in place or,
    where it allows few tokens, handed back compact -- its allowed ids (ascending, -1
    padded) and their logits (-inf padded) as [m, width] arrays -- and its row of the
    logits left as it was. A sampler draws a compact row's token from `values` (the same
    distribution as the masked row: the dropped tokens weigh nothing, and ties still go
    to the lowest id) and maps it back through `ids`."""

    masked: list[int] = field(default_factory=list)  # batch rows masked in place
    compact: list[int] = field(default_factory=list)  # batch rows handed back compact
    ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), dtype=np.int64))
    values: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), dtype=np.float32))


def apply_bitmask(logits: Any, bitmask: np.ndarray, rows: Sequence[int],
                  compact_limit: int = 0) -> Applied:
    """Enforce the bitmask rows `rows` (bitmask row i for logits row i) on logits [n,
    vocab], numpy float32 or a torch tensor on any device; the other rows are not touched.

    A row allowing at most `compact_limit` tokens (0: none) is gathered compact
    (`Applied`), which costs what it allows (only its nonzero words are unpacked), not its
    width: where a JSON grammar stands between values only a handful of tokens are
    allowed. Any other row is unpacked whole and -inf written where its bits are clear:
    a pass over the row, like the sampler's own (bench/results/grammar_engines.md has
    both costs)."""
    rows = np.asarray(list(rows), dtype=np.int64)
    out = Applied()
    if not len(rows):
        return out
    vocab = logits.shape[1]
    if rows.max() >= bitmask.shape[0] or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask {bitmask.shape} does not cover rows {rows.tolist()} of "
                         f"logits {tuple(logits.shape)}")
    packed = bitmask[rows]  # [k, words]
    if packed.shape[1] * 32 > vocab:  # ids past the logits: never allowed
        packed = packed.copy()
        _clear_tail(packed, vocab)
    x = _numpy_view(logits)
    if x is None:  # a device tensor: one masked_fill over the rows
        import torch

        keep = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        index = torch.from_numpy(rows).to(logits.device)
        drop = torch.from_numpy(keep == 0).to(logits.device)
        logits[index] = logits[index].masked_fill(drop, float("-inf"))
        out.masked = rows.tolist()
        return out
    counts = popcount(packed)
    small = counts <= compact_limit
    if small.any():
        pos = np.flatnonzero(small)
        r, c = np.nonzero(packed[pos] != 0)
        owner, ids = _bits(packed[pos], r, c, 1)
        width = max(int(counts[pos].max()), 1)
        slot = np.arange(len(ids)) - np.concatenate([[0], np.cumsum(counts[pos])[:-1]])[owner]
        out.ids = np.full((len(pos), width), -1, dtype=np.int64)
        out.values = np.full((len(pos), width), -np.inf, dtype=np.float32)
        out.ids[owner, slot] = ids
        out.values[owner, slot] = x[rows[pos][owner], ids]
        out.compact = rows[pos].tolist()
    if (~small).any():
        pos = np.flatnonzero(~small)
        keep = np.unpackbits(packed[pos].view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        target = rows[pos]
        if len(target) == x.shape[0] and (target == np.arange(len(target))).all():
            np.copyto(x, -np.inf, where=keep == 0)  # every row, in order: no copy
        else:
            sub = x[target]
            np.copyto(sub, -np.inf, where=keep == 0)
            x[target] = sub
        out.masked = target.tolist()
    return out


def _clear_tail(packed: np.ndarray, vocab: int) -> None:
    """Zero the bits of ids >= vocab (the last words of each row)."""
    first = vocab // 32
    if vocab % 32:
        keep = np.int64((1 << (vocab % 32)) - 1)
        packed[:, first] = (packed[:, first].astype(np.int64) & keep).astype(np.int32)
        first += 1
    packed[:, first:] = 0


def _numpy_view(logits: Any) -> np.ndarray | None:
    """A writable float32 numpy view of CPU logits, or None for any other tensor."""
    if isinstance(logits, np.ndarray):
        return logits
    import torch

    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy()
    return None


def bits_at(bitmask: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """[n] bool: whether bitmask row rows[i] allows token cols[i] (vectorized bit tests:
    what checking a sampler's candidates against the grammar costs)."""
    words = bitmask.view(np.uint32)[rows, cols >> 5]
    return ((words >> (cols & 31).astype(np.uint32)) & 1).astype(bool)


def allowed_ids(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row position, token id) of every allowed token of bitmask rows [k, words], ordered
    by row, then id; only the nonzero words are unpacked, so a row allowing few tokens
    costs what it allows plus one pass over its words."""
    r, c = np.nonzero(packed)
    return _bits(packed, r, c, 1)


@dataclass
class StepMasks:
    """A step's constrained rows: their positions in the step's logits (ascending) and
    their bitmask rows, [k, words] int32, bit j of word w allowing token 32 w + j."""

    rows: np.ndarray
    bitmask: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


class SlotGrammars:
    """The grammars of a backend's slots, and each step's masks filled while the device runs.

    A backend that samples on the host holds one. `assign` gives a slot its request's
    `RowGrammar` at prefill and `drop` forgets it at release. Around each device call the
    backend calls `start(slots)` just before it (a helper thread advances every constrained
    slot's matcher over the token the last step gave it, then fills the slot's bitmask row:
    llguidance releases the GIL, so this runs while the device does), `masks()` once the
    logits are back (it waits for the fill, which by then has usually finished, and hands
    the sampler the step's `StepMasks`), then `took(slots, tokens)` with the step's tokens,
    which the next `start` feeds to the matchers -- so advancing the matchers is off the
    step's critical path too. Free slots cost nothing: a step without constrained rows
    starts no work and hands back None.

    A matcher that refuses a token (a sampler that drew outside the mask, which the tests
    rule out) is logged and its row allows nothing; the sampler then ends that row with
    EOS, so one request's broken grammar never fails the batch.
    """

    def __init__(self, batch_size: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.bitmask = np.zeros((batch_size, words(vocab_size)), dtype=np.int32)
        self._rows: dict[int, RowGrammar] = {}
        self._fed: dict[int, list[int]] = {}  # tokens a slot's matcher has yet to take
        self._pool: ThreadPoolExecutor | None = None
        self._job: tuple[list[int], list[int], Future] | None = None

    def assign(self, slots: Sequence[int], grammars: Sequence[RowGrammar | None]) -> None:
        self.settle()
        for slot, grammar in zip(slots, grammars, strict=True):
            if grammar is not None:
                self._rows[slot] = grammar
                self._fed[slot] = []

    def drop(self, slots: Sequence[int]) -> None:
        self.settle()
        for slot in slots:
            self._rows.pop(slot, None)
            self._fed.pop(slot, None)

    def __contains__(self, slot: int) -> bool:
        return slot in self._rows

    def any(self, slots: Sequence[int]) -> bool:
        return bool(self._rows) and any(s in self._rows for s in slots)

    def start(self, slots: Sequence[int]) -> None:
        """Begin filling the masks of the constrained ones of `slots` (the order of the
        step's logits rows) on the helper thread."""
        self.settle()
        if not self._rows:
            return
        positions = [i for i, s in enumerate(slots) if s in self._rows]
        if not positions:
            return
        chosen = [slots[i] for i in positions]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="inf2serve-masks")
        work = [(s, self._rows[s], self._fed[s]) for s in chosen]
        for s in chosen:
            self._fed[s] = []
        self._job = (positions, chosen, self._pool.submit(self._fill, work))

    def _fill(self, work: list[tuple[int, RowGrammar, list[int]]]) -> None:
        size = self.bitmask.shape[1] * 4
        for slot, grammar, tokens in work:
            if tokens and grammar.accept(tokens) != len(tokens) and not grammar.done:
                logger.warning("slot %d: the grammar refused token(s) %s: %s", slot, tokens,
                               grammar.failed or "not allowed")
            row = self.bitmask[slot]
            if grammar.matcher.is_error():
                row[:] = 0
                continue
            grammar.matcher.unsafe_compute_mask_ptr(row.ctypes.data, size)

    def masks(self) -> StepMasks | None:
        """The masks `start` began (None when no row of the step is constrained)."""
        job, self._job = self._job, None
        if job is None:
            return None
        positions, chosen, future = job
        future.result()
        return StepMasks(np.asarray(positions, dtype=np.int64), self.bitmask[chosen])

    def took(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        """The step's token of each of `slots`, fed to their matchers by the next `start`."""
        if not self._rows:
            return
        for slot, token in zip(slots, tokens, strict=True):
            fed = self._fed.get(slot)
            if fed is not None:
                fed.append(token)

    def settle(self) -> None:
        """Wait for a fill still running (a device call that failed after `start`)."""
        job, self._job = self._job, None
        if job is not None:
            try:
                job[2].result()
            except Exception:
                logger.exception("filling the grammar masks failed")

    def close(self) -> None:
        self.settle()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
