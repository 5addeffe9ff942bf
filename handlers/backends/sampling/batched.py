"""Every row's next token of a step in one call (`sample_rows`).

Shared by the backends that return logits to the host (torch; Neuron in continuous
mode; NxD Inference without on-device sampling; the synthetic device with
`handler.synthetic.host_sampling_vocab`). `sample_rows` picks every row's token of a
step in one call; `RowSampler` keeps each sequence's state (parameters, RNG, generated
count) and samples the rows that need it on their own.

Why batched: the host samples after the device returns logits and before the next
device call can start, so its time lengthens every step. Row by row (a float copy, the
warpers -- a full-vocabulary sort for top-p --, softmax, `torch.multinomial` over every
token, an `int()`), 32 sampled rows of Llama-3's 128,256 logits took 524 ms per step on
the 2-core bench host, 32 greedy ones 10 ms (bench/results/host_sampling.md). So:

- greedy rows (no penalties, logprobs or pending min_new_tokens) are one argmax over
  the batch, ties to the first index as `torch.argmax`: the same tokens as before;
- unseeded sampled rows (same exclusions) are sampled together from their candidates,
  the tokens within CANDIDATE_NATS of the row's best in the tempered distribution
  (logit / temperature), with per-row temperature, top-k and top-p (`_plan`). The rest
  of the vocabulary has a bounded weight; where the bound could change the outcome its
  exact weight is taken (`_top_p`, `_tail_event`), so a row is distributed exactly as
  transformers' Temperature/TopK/TopP warpers sample it, up to float32 rounding of the
  cumulative sum at the top-p cut. Only a nucleus reaching past the candidates (or
  non-finite logits) leaves a row to its own sampler;
- seeded, penalized, logprob and min_new_tokens-pending rows keep the per-row path, so
  a seeded request gives exactly the tokens it always did.

The full-vocabulary passes run in numpy for CPU logits (one thread: torch's argmax
kernel was ~10x slower than numpy's here, and its intra-op threads stalled ~8 ms when the
other core of the 2-core host was busy) and in torch elsewhere (CUDA). One pass over the
logits remains: 16 MB at 32 x 128,256 float32, ~0.4 ms back to back and ~1.3 ms after a
10 ms device wait on the bench host.
"""


from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from handlers.backends import masked_sampling
from handlers.backends.sampling.row import GREEDY, ROW, RowSampler
from handlers.backends.sampling.scan import NumpyScan as _NumpyScan
from handlers.backends.sampling.scan import TorchScan as _TorchScan
from handlers.backends.sampling.scan import column_major
from handlers.backends.sampling.scan import scan as _scan
from handlers.structured.masks import StepMasks

#: how far below a row's best token (in nats of the tempered distribution, logit /
#: temperature) the batched path looks. Every token below weighs at most e^-15 (3e-7) of
#: the best one, so at 128,256 tokens all of them weigh at most 0.04 of it: plain
#: temperature sampling draws that slot in at most 4% of steps and resolves it exactly
#: with one pass over the row (`_tail_event`), far less often where the rest is not all
#: at the edge. Top-p looks as deep as proves the rest cannot reach its cut. Deeper
#: means wider rows: a broad row (a Llama-like head over an N(0, 2) background, T 0.8)
#: had 88,000 candidates 20 nats deep, 8,000 at 15
CANDIDATE_NATS = 15.0
#: rows with more candidates than this are cut one by one before the vectorized work
NARROW = 256


# -- batched sampling ----------------------------------------------------------------------
_rng_state: tuple[int, np.random.Generator] | None = None


def _default_rng() -> np.random.Generator:
    """The unseeded rows' RNG, from OS entropy once per process: an engine process forked
    after import must not replay its parent's draws."""
    global _rng_state
    if _rng_state is None or _rng_state[0] != os.getpid():
        _rng_state = (os.getpid(), np.random.default_rng())
    return _rng_state[1]


def sample_rows(logits: torch.Tensor, samplers: Sequence[RowSampler],
                rng: np.random.Generator | None = None,
                masks: StepMasks | None = None) -> list[int]:
    """The next token of every row: logits [n, vocab] (any float dtype, any device), one
    RowSampler per row, in row order. Each sampler's generated count advances by one, as
    a call of it would; `rng` draws for the unseeded sampled rows (default: one from OS
    entropy). `masks`: the rows a grammar constrains and their bitmasks; each such row
    takes its token as if its disallowed logits were -inf (handlers/backends/
    masked_sampling.py), and every other row exactly as without them. A constrained row
    that allows nothing (a broken grammar) gets the first EOS id, which ends it."""
    n = len(samplers)
    if logits.dim() != 2 or logits.shape[0] != n:
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {n} samplers; "
                         "expected [rows, vocab]")
    vocab = logits.shape[1]
    index = np.full(n, -1, dtype=np.int64)  # each row's bitmask row; -1: free
    if masks is not None and len(masks):
        index[masks.rows] = np.arange(len(masks))
        limits = masked_sampling.RowLimits(masks.bitmask, index, vocab)
        stuck = np.flatnonzero(limits.constrained & (limits.counts == 0))
        if len(stuck):
            return _with_stuck_rows(logits, samplers, rng, masks, stuck)
    tokens = [0] * n
    batched, greedy, sampled = [], [], []
    for i, s in enumerate(samplers):
        route = s.route()
        if route == ROW:
            tokens[i] = s(logits[i], None if index[i] < 0 else limits.row(i))
            continue
        (greedy if route == GREEDY else sampled).append(len(batched))
        batched.append(i)
    if not batched:
        return tokens
    # the batched rows' own logits, and where each batched row lies in them; a transposed
    # view (transformers-neuronx's) is scanned whole: copying rows out of it would cost a
    # strided pass over every row
    if len(batched) == n or column_major(logits):
        sub, at = logits, batched
    else:
        sub, at = logits[batched], list(range(len(batched)))
    scan = _scan(sub)
    if greedy:
        free = [j for j in greedy if index[batched[j]] < 0]
        if free:
            for j, token in zip(free, scan.argmax([at[j] for j in free]).tolist(), strict=True):
                tokens[batched[j]] = token
        held = [j for j in greedy if index[batched[j]] >= 0]
        if held:
            chosen = masked_sampling.greedy(scan, [at[j] for j in held], limits.subset(
                [batched[j] for j in held]))
            for j, token in zip(held, chosen.tolist(), strict=True):
                tokens[batched[j]] = token
        for j in greedy:
            samplers[batched[j]].generated += 1
    if sampled:
        rows = [batched[j] for j in sampled]
        held = (index[rows] >= 0).any()
        drawn = _sample(sub, scan, [at[j] for j in sampled], [samplers[i] for i in rows],
                        rng if rng is not None else _default_rng(),
                        limits.subset(rows) if held else None)
        for i, token in zip(rows, drawn, strict=True):
            tokens[i] = token
    return tokens


def _with_stuck_rows(logits: torch.Tensor, samplers: Sequence[RowSampler],
                     rng: np.random.Generator | None, masks: StepMasks,
                     stuck: np.ndarray) -> list[int]:
    """A step where some constrained rows allow nothing: the others as usual, those EOS."""
    eos = [min(s._eos) if s._eos else 0 for s in samplers]
    keep = np.ones(len(samplers), dtype=bool)
    keep[stuck] = False
    rest = np.flatnonzero(keep)
    at = {int(r): k for k, r in enumerate(rest)}
    held = [k for k, r in enumerate(masks.rows.tolist()) if r in at]
    sub = StepMasks(np.asarray([at[int(masks.rows[k])] for k in held], dtype=np.int64),
                    masks.bitmask[held])
    tokens = [0] * len(samplers)
    if len(rest):
        got = sample_rows(logits[rest.tolist()], [samplers[i] for i in rest], rng, sub)
        for i, token in zip(rest.tolist(), got, strict=True):
            tokens[i] = token
    for i in stuck.tolist():
        tokens[i] = eos[i]
        samplers[i].generated += 1
    return tokens


def _thresholds(best: np.ndarray, temperature: np.ndarray, nats: np.ndarray) -> np.ndarray:
    """Per row, a float32 logit threshold tau about `nats` of the tempered distribution
    under the maximum `best`, with fl(tau / T) < fl(best / T): the best token is then a
    candidate strictly above anything below tau (a huge logit's spacing can swallow the
    gap; it is widened until it shows)."""
    with np.errstate(invalid="ignore", over="ignore"):
        tau = (best.astype(np.float64) - nats * temperature).astype(np.float32)
        tau = np.minimum(tau, np.nextafter(best, np.float32(-np.inf)))
        top = best / temperature
        for _ in range(64):
            low = (tau / temperature >= top) & np.isfinite(best)
            if not low.any():
                break
            gap = best.astype(np.float64) - tau
            tau = np.where(low, (best - 2 * gap).astype(np.float32), tau)
    return tau


@dataclass
class _Candidates:
    """The unseeded sampled rows' candidates, flat, ordered by row then column.

    A row's candidates are the tokens whose tempered score s = logit / T (float32, as
    TemperatureLogitsWarper computes it) is above sigma, about CANDIDATE_NATS under its
    best score `top`; each other token weighs at most e^(sigma - top), so `tail` bounds
    what they weigh together. Weights are e^(s - top): the best token weighs 1."""

    start: np.ndarray  # [m + 1]: row i owns [start[i], start[i + 1])
    cols: np.ndarray  # [N] token ids
    scores: np.ndarray  # [N] float32
    weights: np.ndarray  # [N] float64
    keep: np.ndarray  # [N] bool: still allowed by the row's top-k / top-p
    top: np.ndarray  # [m] float32
    tail: np.ndarray  # [m] float64: bound of the allowed mass outside the candidates
    exact: np.ndarray  # [m] bool: False = only the full row can decide (the row's own call)

    def kept_mass(self) -> np.ndarray:
        """[m] float64: each row's allowed candidates' weight."""
        cum = np.concatenate([[0.0], np.cumsum(np.where(self.keep, self.weights, 0.0))])
        return cum[self.start[1:]] - cum[self.start[:-1]]


def _candidates(scan: _NumpyScan | _TorchScan, rows: list[int], temperature: np.ndarray,
                top_p: np.ndarray, vocab: int,
                limits: masked_sampling.RowLimits | None = None) -> _Candidates:
    """Candidates of each row: CANDIDATE_NATS deep, or for top-p as deep as proves that the
    rest cannot reach the cut (tail <= (1 - p) / p, a quarter of it). With `limits`, a
    constrained row's candidates are its allowed tokens that deep below its best allowed
    one (masked_sampling.candidates), and its tail bounds only the allowed rest."""
    m = len(rows)
    best = scan.max[rows].astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        need = np.log(vocab * top_p / np.maximum(1.0 - top_p, 1e-300)) + math.log(4)
    nats = np.where(top_p < 1.0, np.clip(need, CANDIDATE_NATS, 3 * CANDIDATE_NATS),
                    CANDIDATE_NATS)
    size = vocab
    if limits is None:
        tau = _thresholds(best, temperature, nats)
        r, c, v = scan.candidates(rows, tau)
    else:
        r, c, v, best, tau = masked_sampling.candidates(scan, rows, best, temperature, nats,
                                                        limits, _thresholds)
        size = limits.counts
    with np.errstate(invalid="ignore", over="ignore"):
        s = v / temperature[r]
        sigma = tau / temperature
        top = best / temperature
        inside = s > sigma[r]
        r, c, s = r[inside], c[inside], s[inside]
        weights = np.exp((s - top[r]).astype(np.float64))
        counts = np.bincount(r, minlength=m)
        exact = (counts > 0) & np.isfinite(best) & (sigma < top)
        tail = (size - counts) * np.exp(sigma.astype(np.float64) - top) * (1 + 1e-6)
    start = np.concatenate([[0], np.cumsum(counts)])
    return _Candidates(start, c, s, weights, np.ones(len(c), dtype=bool), top,
                       np.where(exact, tail, 0.0), exact)


def _padded(cand: _Candidates, rows: np.ndarray, flat: np.ndarray | None = None
            ) -> np.ndarray:
    """[len(rows), width] flat indices of `rows`' candidates (all, or those in `flat`, a
    sorted index array), padded with -1: the vectorized form for per-row work."""
    if flat is None:
        counts = np.diff(cand.start)[rows]
        width = max(int(counts.max()), 1) if len(rows) else 1
        j = np.arange(width)
        return np.where(j < counts[:, None], cand.start[rows][:, None] + j, -1)
    where = np.full(len(cand.top), -1)
    where[rows] = np.arange(len(rows))
    owner = where[np.searchsorted(cand.start, flat, side="right") - 1]
    flat = flat[owner >= 0]
    owner = owner[owner >= 0]
    counts = np.bincount(owner, minlength=len(rows))
    out = np.full((len(rows), max(int(counts.max()), 1) if len(rows) else 1), -1)
    out[owner, np.arange(len(flat)) - (np.cumsum(counts) - counts)[owner]] = flat
    return out


def _top_k(cand: _Candidates, top_k: np.ndarray) -> None:
    """TopKLogitsWarper: drop scores below the k-th largest, keeping ties. Where a row has
    k candidates, that score and every tie are among them and the tail is cut; with fewer,
    top-k keeps every candidate and the tail stays bounded."""
    counts = np.diff(cand.start)
    rows = np.flatnonzero(cand.exact & (top_k > 0) & (counts >= top_k))
    if not len(rows):
        return
    kth = np.empty(len(rows), dtype=np.float32)
    narrow = counts[rows] <= NARROW
    if narrow.any():
        idx = _padded(cand, rows[narrow])
        ranked = -np.sort(-np.where(idx >= 0, cand.scores[idx], -np.inf), axis=1)
        kth[narrow] = ranked[np.arange(len(idx)), top_k[rows[narrow]] - 1]
    for j in np.flatnonzero(~narrow):
        seg = cand.scores[cand.start[rows[j]]:cand.start[rows[j] + 1]]
        kth[j] = np.partition(seg, len(seg) - top_k[rows[j]])[len(seg) - top_k[rows[j]]]
    at = np.full(len(cand.top), -np.inf, dtype=np.float32)
    at[rows] = kth
    cand.keep &= ~(cand.scores < np.repeat(at, np.diff(cand.start)))
    cand.tail[rows] = 0.0


def _top_p(cand: _Candidates, top_p: np.ndarray, exact_tail: Callable[[int], float]) -> None:
    """TopPLogitsWarper over the candidates: ascending cumulative softmax, drop <= 1 - p,
    keep the best. The tail (mass t in [0, tail], below every candidate) adds t to every
    candidate's cumulative value: (t + S_j) / (t + A), increasing in t. A row is decided
    when t = tail still drops the whole tail and every candidate's drop is the same at both
    ends; otherwise `exact_tail(row)` gives t and the row is decided at it (or, where even
    that leaves some of the tail in the nucleus, by the row's own call).

    A row with more than NARROW candidates is cut first: once the tokens scoring above
    some v weigh p * (A + tail), every token at or below v is dropped whatever the order
    of ties (what sorts after it weighs at least that), so only those above v are sorted."""
    rows = np.flatnonzero(cand.exact & (top_p < 1.0))
    if not len(rows):
        return
    mass = cand.kept_mass()
    kept = np.concatenate([[0], np.cumsum(cand.keep)])
    alone = (kept[cand.start[1:]] - kept[cand.start[:-1]])[rows] == 1
    if alone.any():  # the best token alone (a confident row): only the tail is in question
        one = rows[alone]
        cut = 1.0 - top_p[one]
        unsure = one[cand.tail[one] / (cand.tail[one] + mass[one]) > cut]
        for i in unsure:
            t = exact_tail(i)
            if t / (t + mass[i]) > 1.0 - top_p[i]:  # the nucleus reaches below it
                cand.exact[i] = False
        cand.tail[one] = 0.0
        rows = rows[~alone]
        if not len(rows):
            return
    below = np.zeros(len(cand.top))
    for i in rows[np.diff(cand.start)[rows] > NARROW]:
        seg = np.arange(cand.start[i], cand.start[i + 1])
        seg = seg[cand.keep[seg]]
        scores, need, k = cand.scores[seg], top_p[i] * (mass[i] + cand.tail[i]), 64
        while k < len(seg):
            v = np.partition(scores, len(seg) - k)[len(seg) - k]
            above = scores > v
            heavy = cand.weights[seg[above]].sum()
            if heavy >= need:
                cand.keep[seg[~above]] = False
                below[i] = mass[i] - heavy
                break
            k *= 4
    idx = _padded(cand, rows, np.flatnonzero(cand.keep))
    order = np.argsort(np.where(idx >= 0, cand.scores[idx], -np.inf), axis=1, kind="stable")
    idx = np.take_along_axis(idx, order, axis=1)  # ascending; padding first
    valid = idx >= 0
    total = mass[rows]
    probs = (np.where(valid, cand.weights[idx], 0.0) / total[:, None]).astype(np.float32)
    cum = np.cumsum(probs, axis=1, dtype=np.float32) + (below[rows] / total).astype(
        np.float32)[:, None]
    cut = (1.0 - top_p[rows]).astype(np.float32)

    def drops(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each candidate's drop, and whether the whole tail is dropped, at tail mass t."""
        rel = (t / total)[:, None]
        at = ((rel + cum) / (1 + rel)).astype(np.float32) if t.any() else cum
        drop = at <= cut[:, None]
        drop[:, -1] = False  # the best token (sorted last) is always kept
        return drop, t / (t + total) <= 1.0 - top_p[rows]

    low, _ = drops(np.zeros(len(rows)))
    high, tail_gone = drops(cand.tail[rows])
    for j in np.flatnonzero(~tail_gone | (valid & (low != high)).any(axis=1)):
        t = np.zeros(len(rows))
        t[j] = exact_tail(rows[j])
        drop, gone = drops(t)
        low[j] = drop[j]
        if not gone[j]:  # the nucleus reaches below the candidates
            cand.exact[rows[j]] = False
    cand.keep[idx[valid & low]] = False
    cand.tail[rows] = 0.0


def _plan(scan: _NumpyScan | _TorchScan, rows: list[int], temperature: np.ndarray,
          top_k: np.ndarray, top_p: np.ndarray, vocab: int,
          limits: masked_sampling.RowLimits | None = None) -> _Candidates:
    """Temperature, top-k and top-p of each row, over its candidates (and its mask)."""
    cand = _candidates(scan, rows, temperature, top_p, vocab, limits)
    _top_k(cand, top_k)

    def exact_tail(i: int) -> float:
        weights = _row_weights(scan.row(rows[i]), temperature[i], cand.top[i], top_k[i],
                               None if limits is None else limits.row(i))
        inside = weights[cand.cols[cand.start[i]:cand.start[i + 1]]]
        # the same float32 values leave again: exact up to float64 summation
        return float(weights.sum(dtype=np.float64) - inside.sum(dtype=np.float64))

    _top_p(cand, top_p, exact_tail)
    return cand


def _row_weights(logits: np.ndarray, temperature: float, top: float, top_k: int,
                 allowed: np.ndarray | None = None) -> np.ndarray:
    """One row over the whole vocabulary: each token's weight e^(s - top) (float32), 0 where
    top-k drops it (below the k-th largest score, ties kept) or `allowed` is False."""
    scores = logits / np.float32(temperature)
    if allowed is not None:
        scores[~allowed] = -np.inf
    low = None
    if 0 < top_k < len(scores):
        low = scores < np.partition(scores, len(scores) - top_k)[len(scores) - top_k]
    np.subtract(scores, np.float32(top), out=scores)
    np.exp(scores, out=scores)
    if low is not None:
        scores[low] = 0.0
    return scores


def _sample(logits: torch.Tensor, scan: _NumpyScan | _TorchScan, rows: list[int],
            samplers: list[RowSampler], rng: np.random.Generator,
            limits: masked_sampling.RowLimits | None = None) -> list[int]:
    """Tokens of the unseeded sampled rows `rows` (positions in `logits`), one draw each:
    every row's allowed candidates and its tail's bound are laid end to end, and one
    uniform per row picks a place along its own stretch."""
    ps = [s.params for s in samplers]
    temperature = np.array([p.temperature for p in ps], dtype=np.float32)
    top_k = np.array([p.top_k for p in ps], dtype=np.int64)
    cand = _plan(scan, rows, temperature, top_k,
                 np.array([p.top_p for p in ps], dtype=np.float64), logits.shape[1], limits)
    cum = np.concatenate([[0.0], np.cumsum(np.where(cand.keep, cand.weights, 0.0))])
    base = cum[cand.start[:-1]]
    mass = cum[cand.start[1:]] - base
    u = rng.random(len(rows)) * (mass + cand.tail)
    tokens = [0] * len(rows)
    kept = np.flatnonzero(cand.keep)
    if len(kept):
        at = np.searchsorted(cum, base + u, side="right") - 1
        # float rounding may step past a row's last allowed token: never onto a dropped one
        last = kept[np.maximum(np.searchsorted(kept, cand.start[1:]) - 1, 0)]
        tokens = cand.cols[np.minimum(at, last)].tolist()
    exact = cand.exact.tolist()
    for j in np.flatnonzero(~cand.exact | (u >= mass)).tolist():
        ok = None if limits is None else limits.row(j)
        if exact[j]:  # the tail's slot: `_tail_event`
            tokens[j] = _tail_event(scan.row(rows[j]), cand, j, temperature[j], top_k[j], rng,
                                    ok)
        else:  # the row's own call counts its token
            tokens[j] = samplers[j](logits[rows[j]], ok)
    for s, counted in zip(samplers, exact, strict=True):
        if counted:
            s.generated += 1
    return tokens


def _tail_event(logits: np.ndarray, cand: _Candidates, j: int, temperature: float,
                top_k: int, rng: np.random.Generator, allowed: np.ndarray | None = None
                ) -> int:
    """Row j (no top-p) drew its tail's slot, whose weight `tail` only bounds the tail's
    true mass B (every token that is not a candidate).

    With q the row's exact distribution (weights over the full row), output a tail token
    drawn from q restricted to the tail with probability B / tail, else a token drawn
    from q. Then every token x has P(x) = w_x / (A + B), A the candidates' mass: a
    candidate gets w / (A + tail) from the first draw plus (tail - B) / (A + tail) *
    w / (A + B) here, a tail token tail / (A + tail) * B / tail * w / B plus the same.
    """
    weights = _row_weights(logits, temperature, cand.top[j], top_k, allowed)
    outside = weights.copy()
    outside[cand.cols[cand.start[j]:cand.start[j + 1]]] = 0.0
    pool = outside if rng.random() * cand.tail[j] < outside.sum(dtype=np.float64) else weights
    cum = np.cumsum(pool, dtype=np.float64)
    return int(min(np.searchsorted(cum, rng.random() * cum[-1], side="right"), len(cum) - 1))
