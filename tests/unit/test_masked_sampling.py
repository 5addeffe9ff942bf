"""The grammar's mask inside the batched sampler (handlers/backends/masked_sampling.py):
every constrained row takes what the naive path gives -- its disallowed logits set to
-inf, then the plain sampler -- greedy token for token, sampled draw for draw in
distribution; free rows of the same call take exactly what they take without masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from handlers.backends import masked_sampling
from handlers.backends.base import SamplingParams
from handlers.backends.sampling import RowSampler, sample_rows
from handlers.backends.sampling import batched as sampling  # the batched path's internals
from handlers.structured.masks import StepMasks, words

CPU = torch.device("cpu")


def _samplers(params, eos=frozenset([0])):
    return [RowSampler(p, eos, CPU) for p in params]


def pack(ok: np.ndarray) -> np.ndarray:
    """[rows, vocab] bool -> [rows, words] int32 bitmask (bit j of word w: token 32 w + j)."""
    rows, vocab = ok.shape
    padded = np.zeros((rows, words(vocab) * 32), dtype=np.uint8)
    padded[:, :vocab] = ok
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


def masked(logits: torch.Tensor, ok: np.ndarray) -> torch.Tensor:
    """The naive path: every disallowed logit -inf."""
    return logits.masked_fill(~torch.from_numpy(ok), float("-inf"))


def random_masks(g: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """[rows, vocab] bool of every density a grammar gives: a handful (between JSON values),
    hundreds (a number), nearly all (inside a string), one, and the top token ruled out."""
    ok = np.zeros((rows, vocab), dtype=bool)
    for i in range(rows):
        kind = i % 5
        if kind == 0:
            ok[i, g.choice(vocab, 5, replace=False)] = True
        elif kind == 1:
            ok[i, g.choice(vocab, min(vocab, 300), replace=False)] = True
        elif kind == 2:
            ok[i] = g.random(vocab) > 0.02
        elif kind == 3:
            ok[i, g.integers(vocab)] = True
        else:
            ok[i] = g.random(vocab) > 0.5
    return ok


VOCABS = (50, 32 * 64 + 37, 8192)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("compact", [masked_sampling.COMPACT, 0])
def test_constrained_greedy_rows_take_the_masked_rows_argmax(vocab, compact,
                                                             monkeypatch) -> None:
    """Against argmax of the row masked whole, ties to the lowest id, for every density;
    with COMPACT 0 every row goes through the candidate check."""
    monkeypatch.setattr(masked_sampling, "COMPACT", compact)
    g = np.random.default_rng(vocab)
    for trial in range(6):
        logits = torch.from_numpy(g.integers(-6, 7, (40, vocab)).astype(np.float32)
                                  * (1 + trial))  # many ties
        ok = random_masks(g, 40, vocab)
        best = logits.argmax(dim=1)
        ok[4::5, best[4::5].numpy()] = False if trial % 2 else ok[4::5, 0]  # top ruled out
        ok[ok.sum(axis=1) == 0, 1] = True
        got = sample_rows(logits, _samplers([SamplingParams()] * 40),
                          masks=StepMasks(np.arange(40), pack(ok)))
        assert got == masked(logits, ok).argmax(dim=1).tolist()


def test_a_row_whose_candidates_are_all_ruled_out_is_masked_whole(monkeypatch) -> None:
    """Its top tokens disallowed, far above the rest: only the full pass finds the token."""
    monkeypatch.setattr(masked_sampling, "COMPACT", 0)
    calls = []
    full = masked_sampling.best_allowed
    monkeypatch.setattr(masked_sampling, "best_allowed",
                        lambda *a: calls.append(1) or full(*a))
    logits = torch.zeros(1, 5000)
    logits[0, :10] = 100.0
    logits[0, 4321] = 3.0
    ok = np.ones((1, 5000), dtype=bool)
    ok[0, :10] = False
    assert sample_rows(logits, _samplers([SamplingParams()]),
                       masks=StepMasks(np.arange(1), pack(ok))) == [4321]
    assert calls == [1]


SAMPLED = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0, top_k=40),
           SamplingParams(temperature=0.5, top_k=10, top_p=0.9),
           SamplingParams(temperature=1.3, top_p=0.5), SamplingParams(temperature=0.7, top_k=3),
           SamplingParams(temperature=2.0), SamplingParams(temperature=0.9, top_k=1),
           SamplingParams(temperature=1.0, top_p=0.999)]


def _reference(logits: torch.Tensor, p: SamplingParams) -> np.ndarray:
    """The per-row warpers' distribution of one (masked) row."""
    return RowSampler(p, frozenset(), CPU).warped(logits.float()[None])[0].double().numpy()


@pytest.mark.parametrize("nats", [sampling.CANDIDATE_NATS, 2.0])
@pytest.mark.parametrize("compact", [masked_sampling.COMPACT, 0])
def test_constrained_sampled_rows_plan_the_masked_rows_distribution(nats, compact,
                                                                    monkeypatch) -> None:
    """The plan of each constrained row (its candidates, top-k, top-p, tail) is the warpers'
    distribution of the row masked whole: the same support and odds where the candidates
    decide, a bound of them where a tail is left to draw."""
    monkeypatch.setattr(sampling, "CANDIDATE_NATS", nats)
    monkeypatch.setattr(masked_sampling, "COMPACT", compact)
    vocab = 32 * 64 + 37
    g = np.random.default_rng(7)
    decided = total = 0
    for trial in range(10):
        logits = torch.from_numpy((g.standard_normal((len(SAMPLED), vocab)) * (1 + trial))
                                  .astype(np.float32))
        ok = random_masks(g, len(SAMPLED), vocab)
        ok[:, int(logits[0].argmax())] = trial % 2 == 0  # the best token in or out
        scan = sampling._scan(logits)
        limits = masked_sampling.RowLimits(pack(ok), np.arange(len(SAMPLED)), vocab)
        plan = sampling._plan(scan, list(range(len(SAMPLED))),
                              np.array([p.temperature for p in SAMPLED], dtype=np.float32),
                              np.array([p.top_k for p in SAMPLED], dtype=np.int64),
                              np.array([p.top_p for p in SAMPLED], dtype=np.float64), vocab,
                              limits)
        for i, p in enumerate(SAMPLED):
            total += 1
            if not plan.exact[i]:
                continue
            decided += 1
            q = _reference(masked(logits[i], ok[i]), p)
            at = slice(plan.start[i], plan.start[i + 1])
            weights = np.zeros(vocab)
            weights[plan.cols[at]] = np.where(plan.keep[at], plan.weights[at], 0.0)
            assert not (weights > 0)[~ok[i]].any(), "a disallowed token is a candidate"
            if plan.tail[i] == 0:
                assert set(np.flatnonzero(weights)) == set(np.flatnonzero(q))
                assert weights / weights.sum() == pytest.approx(q, abs=1e-6)
            else:
                assert p.top_p == 1.0 and not set(np.flatnonzero(weights)) - set(
                    np.flatnonzero(q))
                assert (weights / (weights.sum() + plan.tail[i]) <= q + 1e-6).all()
    assert decided >= total * (0.7 if compact else 0.3)


def _chi_square(counts: np.ndarray, q: np.ndarray) -> tuple[float, int]:
    assert counts[q == 0].sum() == 0, "a token the masked warpers rule out was drawn"
    n = counts.sum()
    expected = q * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (q > 0)].sum())
    exp = np.append(expected[big], expected[~big & (q > 0)].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


TOP_P, HOT = SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.5)
TOP_K, BOTH = (SamplingParams(temperature=0.6, top_k=4),
               SamplingParams(temperature=1.2, top_k=5, top_p=0.8))


# each warper with and without gathering, each at the default depth or at 1 nat
@pytest.mark.parametrize("p, nats, compact", [
    (TOP_P, sampling.CANDIDATE_NATS, masked_sampling.COMPACT), (TOP_P, 1.0, 0),
    (HOT, sampling.CANDIDATE_NATS, 0), (HOT, 1.0, masked_sampling.COMPACT),
    (TOP_K, 1.0, 0), (BOTH, sampling.CANDIDATE_NATS, masked_sampling.COMPACT)])
def test_constrained_draws_follow_the_masked_rows_distribution(p, nats, compact,
                                                               monkeypatch) -> None:
    """40,000 draws of one masked row (its best token ruled out) against the warpers'
    probabilities of the row masked whole (Pearson chi-square; fixed RNG). At 1 nat most
    of the allowed mass is below the candidates: tail events and own-sampler calls must
    keep to the mask too."""
    monkeypatch.setattr(sampling, "CANDIDATE_NATS", nats)
    monkeypatch.setattr(masked_sampling, "COMPACT", compact)
    logits = torch.tensor([2.0, 1.5, 1.5, 0.3, -0.2, -1.0, 0.9, 2.2, -3.0, 0.0, 1.1, -0.5])
    ok = np.array([[1, 1, 1, 0, 1, 1, 1, 0, 1, 0, 1, 1]], dtype=bool)  # 2.2 ruled out
    q = _reference(masked(logits, ok[0]), p)
    rows = 2000
    samplers = _samplers([p] * rows)
    for i, s in enumerate(samplers):
        s._gen.manual_seed(i)
    bits = pack(np.repeat(ok, rows, axis=0))
    rng = np.random.default_rng(0)
    counts = np.zeros(len(logits), dtype=np.int64)
    for _ in range(20):
        drawn = sample_rows(logits.expand(rows, -1), samplers, rng,
                            StepMasks(np.arange(rows), bits))
        counts += np.bincount(drawn, minlength=len(logits))
    stat, dof = _chi_square(counts, q)
    assert stat < dof + 6 * math.sqrt(2 * dof) + 10, (stat, dof, counts, q)


def test_free_rows_take_exactly_what_they_take_without_masks() -> None:
    """A mixed call -- constrained and free, greedy, seeded and unseeded sampled,
    penalized -- gives every free greedy and seeded row the tokens of a call without the
    constrained rows, and every constrained row only allowed tokens."""
    vocab = 3000
    g = torch.Generator().manual_seed(5)
    free = [SamplingParams(), SamplingParams(temperature=0.9, seed=3),
            SamplingParams(temperature=0.7, top_k=20, seed=4), SamplingParams(),
            SamplingParams(repetition_penalty=1.3)]
    held = [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9),
            SamplingParams(temperature=0.8, seed=9), SamplingParams(logprobs=2)]
    order = [0, 5, 1, 6, 2, 7, 3, 8, 4]  # free and constrained interleaved
    params = [(free + held)[k] for k in order]
    mixed = _samplers(params)
    alone = _samplers(free)
    ok = random_masks(np.random.default_rng(2), len(held), vocab)
    constrained = np.array([i for i, k in enumerate(order) if k >= len(free)])
    free_rows = [i for i, k in enumerate(order) if k < len(free)]
    for _ in range(30):
        logits = torch.randn(len(order), vocab, generator=g) * 3
        got = sample_rows(logits, mixed, masks=StepMasks(constrained, pack(ok)))
        want = sample_rows(logits[free_rows], alone)
        assert [got[i] for i in free_rows] == want
        assert all(ok[j, got[i]] for j, i in enumerate(constrained))


def test_a_constrained_row_that_allows_nothing_ends_with_eos_and_the_rest_go_on() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    ok = np.zeros((2, 100), dtype=bool)
    ok[1, 42] = True
    samplers = _samplers([SamplingParams()] * 3, eos=frozenset([7]))
    got = sample_rows(logits, samplers, masks=StepMasks(np.array([0, 2]), pack(ok)))
    assert got == [7, int(logits[1].argmax()), 42]
    assert [s.generated for s in samplers] == [1, 1, 1]
