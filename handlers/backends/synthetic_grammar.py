"""The synthetic device's model for constrained rows: a token the grammar allows.

The synthetic device's tokens are a function of (prompt, position) drawn from plain words,
and a grammar would refuse nearly all of them. For a row with a grammar (structured
outputs, `handler.synthetic.host_sampling_vocab` set) the device instead "predicts" a
token its mask allows, as a model trained to follow the format would put its best logit
on one: while the device step runs, once the row's mask is filled (SlotGrammars), it
picks one -- where few are allowed, one of those; else the first allowed of a few
candidates drawn from the tokens that hold JSON punctuation and from the words, so
strings stay short and objects and arrays close -- and the host's sampler then has to
find that token through the mask, as it would a real model's. Everything is keyed on
(prompt, position), so a greedy row's answer is reproducible. Never a hardware result.
"""

from __future__ import annotations

import numpy as np

from handlers.structured.masks import StepMasks, allowed_ids, bits_at, popcount

#: characters a JSON answer's structure is made of
PUNCTUATION = set('"{}[],:0123456789')
#: how many candidates a row that allows many tokens checks before listing its mask
TRIES = 8
#: a row allowing at most this many tokens picks among all of them
FEW = 64


def json_ids(pieces: list, vocab: int) -> np.ndarray:
    """Ids of short tokens holding JSON punctuation (their pieces as the tokenizer lists
    them: byte-level and sentencepiece pieces keep ASCII punctuation as it is)."""
    return np.array([i for i, p in enumerate(pieces[:vocab]) if isinstance(p, str)
                     and len(p) <= 3 and PUNCTUATION & set(p)], dtype=np.int64)


class GrammarSteer:
    """Picks the constrained rows' synthetic tokens from their masks."""

    def __init__(self, punctuation: np.ndarray, words: tuple[int, ...], eos: int) -> None:
        self.eos = eos  # a row whose grammar allows nothing ends (as the sampler ends it)
        # half the candidates close or join (punctuation), half go on (words)
        self.pool = np.concatenate([punctuation, np.asarray(words, dtype=np.int64)[
            :max(1, len(punctuation))]])
        self.half = len(punctuation)

    def tokens(self, masks: StepMasks, keys: list[int]) -> list[int]:
        """One allowed token per constrained row (`keys`: a hash of each row's prompt and
        position, in the order of masks.rows). All rows at once: this runs in the device's
        time, which a device spends idle, so it keeps to a few array operations."""
        k = len(keys)
        out = np.full(k, self.eos, dtype=np.int64)
        if not k:
            return []
        counts = popcount(masks.bitmask)
        key = np.array(keys, dtype=np.uint64)
        todo = np.ones(k, dtype=bool)
        wide = np.flatnonzero(counts > FEW) if len(self.pool) else np.zeros(0, dtype=np.int64)
        if len(wide):
            h = key[wide, None] >> (np.uint64(8) * np.arange(TRIES, dtype=np.uint64))
            picks = np.where(np.arange(TRIES) % 2 == 0,
                             (h % np.uint64(max(self.half, 1))).astype(np.int64),
                             self.half + (h % np.uint64(max(len(self.pool) - self.half, 1))
                                          ).astype(np.int64))
            cand = self.pool[np.minimum(picks, len(self.pool) - 1)]  # [wide, TRIES]
            ok = bits_at(masks.bitmask, np.repeat(wide, TRIES), cand.ravel()).reshape(cand.shape)
            hit = ok.any(axis=1)
            out[wide[hit]] = cand[hit, ok[hit].argmax(axis=1)]
            todo[wide[hit]] = False
        rest = np.flatnonzero(todo & (counts > 0))
        if len(rest):  # one of the allowed ids, by the key
            owner, ids = allowed_ids(masks.bitmask[rest])
            n = np.bincount(owner, minlength=len(rest))
            start = np.concatenate([[0], np.cumsum(n)[:-1]])
            out[rest] = ids[start + (key[rest] % n.astype(np.uint64)).astype(np.int64)]
        return out.tolist()
