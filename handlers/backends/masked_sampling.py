"""The grammar's mask inside the batched sampler: candidates checked against a bitmask.

A constrained row (structured outputs: handlers/structured) may take only the tokens its
bitmask allows. Masking the row whole -- unpacking 128,256 bits and writing -inf where
they are clear -- is a pass over the row, and inside a JSON string a row allows nearly
every token, so it cannot be skipped: 24 ms for 32 rows of 128,256 on the bench host,
over a 10 ms device step (bench/results/grammar_engines.md). The batched sampler already
looks only at each row's candidates (the tokens near its best, handlers/backends/
sampling.py), so here it checks just those against the bitmask (`bits_at`, a few
operations per candidate) and touches the rest of the row only where the check cannot
decide. Every path is exact -- the same token (greedy) or the same distribution (sampled)
as the row masked whole and handed to the plain sampler:

- every row is searched first, whatever its density: a model that follows the format puts
  its best logit on an allowed token, and then the row's allowed candidates decide it as
  a free row's decide it (the bitmask's bit tests are all the mask costs);
- greedy: the best allowed token among the candidates within GREEDY_DEPTH of the row's
  maximum is the masked row's argmax (everything below weighs less); a row none of whose
  candidates is allowed is gathered when it allows few tokens (at most COMPACT: between
  JSON values, a key, an enum, a number: its allowed ids and their logits, from its
  nonzero words only) and otherwise masked whole, all such rows in one pass
  (`best_allowed`);
- sampled: candidates are filtered by the mask; where a row's best is ruled out, a row
  allowing few tokens is gathered (its allowed tokens are its whole support, no tail),
  a wider one searched again CANDIDATE_NATS below its best allowed token (found by
  `best_allowed` where no candidate is allowed), so the tail bound (over the allowed
  tokens outside the candidates) is as tight as for a free row; the row's exact tail,
  when the sampler needs it, is computed over the allowed tokens only. Only a row whose
  every allowed logit is -inf (or NaN) goes to its own sampler with the mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from handlers.structured.masks import allowed, allowed_ids, bits_at, popcount

#: a row allowing at most this many tokens is gathered rather than searched: its ids come
#: out of the nonzero words only, and at 4,096 tokens that is still a small fraction of a
#: 128,256-token row
COMPACT = 4096
#: how far below a constrained greedy row's maximum (in logits) its candidates reach: any
#: depth is exact; this one keeps a peaked row to a few blocks of the scan
GREEDY_DEPTH = 15.0


class RowLimits:
    """Which tokens each row of one sampler call may take: `index[j]` is row j's bitmask row
    (-1: a free row), `counts` how many tokens each row allows (the vocabulary for a free
    row), `compact` the rows gathered whole."""

    def __init__(self, bitmask: np.ndarray, index: np.ndarray, vocab: int,
                 counts: np.ndarray | None = None) -> None:
        short = (vocab + 31) // 32 - bitmask.shape[1]
        if short > 0:  # logits wider than the grammar's vocabulary: those ids never allowed
            bitmask = np.pad(bitmask, ((0, 0), (0, short)))
        self.bitmask = bitmask
        self.index = np.asarray(index, dtype=np.int64)
        self.vocab = vocab
        self.constrained = self.index >= 0
        if counts is not None:  # a subset's, already counted
            self.counts = counts
        else:
            self.counts = np.full(len(self.index), vocab, dtype=np.int64)
        if counts is None and self.constrained.any():
            self.counts[self.constrained] = popcount(bitmask[self.index[self.constrained]])
        self.compact = self.constrained & (self.counts <= COMPACT)

    def subset(self, js: list[int] | np.ndarray) -> RowLimits:
        js = np.asarray(js, dtype=np.int64)
        return RowLimits(self.bitmask, self.index[js], self.vocab, self.counts[js])

    def keep(self, r: np.ndarray, c: np.ndarray) -> np.ndarray:
        """[n] bool: whether row r[i] may take token c[i] (free rows take anything)."""
        ok = ~self.constrained[r]
        sel = np.flatnonzero(~ok)
        if len(sel):
            ok[sel] = bits_at(self.bitmask, self.index[r[sel]], c[sel])
        return ok

    def row(self, j: int) -> np.ndarray | None:
        """[vocab] bool of row j's allowed tokens; None for a free row."""
        if not self.constrained[j]:
            return None
        return allowed(self.bitmask[self.index[j]], self.vocab)

    def gather(self, scan: Any, rows: np.ndarray, js: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row j, token id, logit) of every token rows `js` allow, ordered by row, then id;
        `rows` maps j to the row of the scanned logits."""
        owner, ids = allowed_ids(self.bitmask[self.index[js]])
        inside = ids < self.vocab  # never past the logits (the tokenizer's ids are less)
        r, ids = js[owner[inside]], ids[inside]
        return r, ids, values(scan, rows[r], ids)


def values(scan: Any, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """float32 logits at (rows[i], cols[i]) of a scan's logits (numpy, or torch elsewhere)."""
    x = scan.x
    if isinstance(x, np.ndarray):
        return x[rows, cols]
    import torch

    index = torch.from_numpy(rows).to(x.device), torch.from_numpy(cols).to(x.device)
    return x[index].float().cpu().numpy()


def _first_best(r: np.ndarray, c: np.ndarray, v: np.ndarray, m: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Per row j < m: the lowest id among its highest values (argmax's tie rule; NaN ranks
    below every number, and a row of NaN only takes its lowest id), and whether it had
    any entry. Entries come ordered by row, then id (what `gather` and a scan's
    candidates hand over): one segmented max and one pass, no sort."""
    out = np.full(m, -1, dtype=np.int64)
    if not len(r):
        return out, out >= 0
    key = r * (int(c.max()) + 1) + c
    if (np.diff(key) <= 0).any():  # not in order after all: sort them
        order = np.lexsort((c, -v, r))
        r, c = r[order], c[order]
        first = np.concatenate([[True], r[1:] != r[:-1]])
        out[r[first]] = c[first]
        return out, out >= 0
    starts = np.flatnonzero(np.concatenate([[True], r[1:] != r[:-1]]))
    top = np.fmax.reduceat(v, starts)  # each row's highest number (NaN: only NaN)
    lengths = np.diff(np.append(starts, len(r)))
    at = np.repeat(top, lengths)
    with np.errstate(invalid="ignore"):
        hit = (v == at) | np.isnan(at)
    rr, cc = r[hit], c[hit]
    first = np.concatenate([[True], rr[1:] != rr[:-1]])
    out[rr[first]] = cc[first]
    return out, out >= 0


def masked_argmax(row: np.ndarray, ok: np.ndarray) -> int:
    """The argmax of a row masked whole: its first highest allowed logit (the full pass)."""
    token = int(np.where(ok, row, -np.inf).argmax())
    if not ok[token]:  # every allowed logit is -inf (or NaN): the first allowed token
        token = int(np.flatnonzero(ok)[0])
    return token


def best_allowed(scan: Any, rows: np.ndarray, limits: RowLimits, js: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(token, logit) of `masked_argmax` for the rows `js` (rows[j] in the scanned logits),
    all in one pass over those rows: their bits unpacked together, the logits masked and
    reduced as one array -- where none of a row's candidates is allowed (its best token
    ruled out), its best allowed one must come from the whole row."""
    x = scan.x
    keep = np.unpackbits(limits.bitmask[limits.index[js]].view(np.uint8), axis=1,
                         bitorder="little")[:, :limits.vocab].view(bool)  # 0/1 bytes
    if isinstance(x, np.ndarray):
        sub = np.where(keep, x[rows[js]], np.float32(-np.inf))
    else:
        sub = np.stack([np.where(keep[k], scan.row(int(rows[j])), np.float32(-np.inf))
                        for k, j in enumerate(js.tolist())])
    k = np.arange(len(js))
    token = sub.argmax(axis=1)
    bad = ~keep[k, token]  # every allowed logit -inf: the first allowed token
    token[bad] = keep[bad].argmax(axis=1)
    return token, sub[k, token]


def greedy(scan: Any, rows: list[int], limits: RowLimits) -> np.ndarray:
    """Each constrained greedy row's token: the masked row's argmax, ties to the lowest
    id; -1 for a row that allows nothing. Every row is checked at its candidates first (a
    model that follows the format puts its best logit on an allowed token, whatever the
    mask's density); only a row none of whose candidates is allowed is gathered (few
    allowed) or masked whole."""
    rows_ = np.asarray(rows, dtype=np.int64)
    m = len(rows_)
    out = np.full(m, -1, dtype=np.int64)
    held = np.flatnonzero(limits.counts > 0)
    if not len(held):
        return out
    # the row's argmax (its first highest logit), where allowed, is the masked row's
    first = scan.argmax(rows_[held].tolist())
    hit = limits.keep(held, first)
    out[held[hit]] = first[hit]
    held = held[~hit]
    if not len(held):
        return out
    top = scan.max[rows_[held]].astype(np.float64)
    with np.errstate(invalid="ignore"):
        tau = np.where(np.isfinite(top), top - GREEDY_DEPTH, -np.inf).astype(np.float32)
    r, c, v = scan.candidates(rows_[held].tolist(), tau)
    r = held[r]
    ok = limits.keep(r, c)
    best, found = _first_best(r[ok], c[ok], v[ok], m)
    out[found] = best[found]
    lost = held[~found[held]]
    few = lost[limits.compact[lost]]
    if len(few):  # no candidate allowed, few tokens allowed: those tokens' logits
        r, c, v = limits.gather(scan, rows_, few)
        best, found = _first_best(r, c, v, m)
        out[few[found[few]]] = best[few[found[few]]]
    many = lost[~limits.compact[lost]]
    if len(many):  # no candidate allowed: the rows masked whole, together
        out[many] = best_allowed(scan, rows_, limits, many)[0]
    return out


def candidates(scan: Any, rows: list[int], best: np.ndarray, temperature: np.ndarray,
               nats: np.ndarray, limits: RowLimits,
               thresholds: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The sampled rows' candidates where some rows are constrained: (r, c, v) ordered by
    row then id, each row's best (its best allowed logit where constrained) and its
    threshold tau (-inf for a gathered row: all it allows is a candidate).

    Every row is searched first: where a constrained row's best token is allowed (a model
    that follows the format), its allowed candidates and the bound of its allowed tail
    decide it as they decide a free row, whatever the mask's density. A row allowing few
    tokens whose best is ruled out is gathered instead; a wider one is searched again
    below its best allowed token."""
    rows_ = np.asarray(rows, dtype=np.int64)
    m = len(rows_)
    best = best.astype(np.float32).copy()
    tau = thresholds(best, temperature, nats)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    r, c, v = scan.candidates(rows_.tolist(), tau)
    ok = limits.keep(r, c)
    r, c, v = r[ok], c[ok], v[ok]
    top = _row_max(r, v, m)  # each row's best allowed candidate
    with np.errstate(invalid="ignore"):
        below = ~np.isfinite(top) | (top < best)
    compact = np.flatnonzero(limits.compact & below)
    wide = limits.constrained & ~limits.compact
    if len(compact):  # their best ruled out: the few tokens they allow
        drop = np.zeros(m, dtype=bool)
        drop[compact] = True
        drop = drop[r]
        r, c, v = r[~drop], c[~drop], v[~drop]
        r3, c3, v3 = limits.gather(scan, rows_, compact)
        gathered = _row_max(r3, v3, m)
        best[compact] = np.where(np.isfinite(gathered[compact]), gathered[compact], np.nan)
        tau[compact] = -np.inf
        parts.append((r3, c3, v3))
    if wide.any():
        # where a wide row's best allowed candidate sits below the row's best, look
        # CANDIDATE_NATS below it instead (a deeper, second search of that row)
        none = np.flatnonzero(wide & ~np.isfinite(top))
        if len(none):  # no candidate allowed (the best ruled out): the masked rows' best
            top[none] = best_allowed(scan, rows_, limits, none)[1]
        lower = np.flatnonzero(wide & np.isfinite(top) & (top < best))
        if len(lower):
            best[lower] = top[lower]
            deeper = thresholds(best[lower], temperature[lower], nats[lower])
            tau[lower] = np.minimum(tau[lower], deeper)
            drop = np.zeros(m, dtype=bool)
            drop[lower] = True
            drop = drop[r]
            r, c, v = r[~drop], c[~drop], v[~drop]
            r2, c2, v2 = scan.candidates(rows_[lower].tolist(), tau[lower])
            r2 = lower[r2]
            ok = limits.keep(r2, c2)
            parts.append((r2[ok], c2[ok], v2[ok]))
        # every allowed logit -inf (or NaN): the row's own call
        best[np.flatnonzero(wide & ~np.isfinite(top))] = np.nan
    parts.append((r, c, v))
    r = np.concatenate([p[0] for p in parts])
    c = np.concatenate([p[1] for p in parts])
    v = np.concatenate([p[2] for p in parts])
    if len(parts) > 1:  # each part sorted, no row in two parts: a stable sort by row
        order = np.argsort(r, kind="stable")
        r, c, v = r[order], c[order], v[order]
    return r, c, v, best, tau


def _row_max(r: np.ndarray, v: np.ndarray, m: int) -> np.ndarray:
    """[m] float32: each row's highest value (NaN propagates), -inf for a row without
    entries; `r` ordered (a segmented max, not a scatter)."""
    top = np.full(m, -np.inf, dtype=np.float32)
    if len(r):
        starts = np.flatnonzero(np.concatenate([[True], r[1:] != r[:-1]]))
        top[r[starts]] = np.maximum.reduceat(v, starts)
    return top
