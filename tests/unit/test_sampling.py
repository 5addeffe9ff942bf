"""Host sampling (handlers/backends/sampling/): penalties and logprobs by vLLM's formulas, and
nothing changes for a request that asks for neither; the batched path (`sample_rows`)
gives greedy rows the per-row argmax, seeded rows their own sampler's tokens, and
unseeded rows the per-row warpers' distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from handlers.backends.base import SamplingParams
from handlers.backends.sampling import RowSampler, prompt_logprobs, sample_rows, token_logprob
from handlers.backends.sampling import batched as sampling  # the batched path's internals
from handlers.backends.sampling import scan as scan_module

CPU = torch.device("cpu")


def sampler(**params) -> RowSampler:
    return RowSampler(SamplingParams(**params), frozenset([0]), CPU, prompt=(3,))


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    # token 3 is in the prompt; token 1 is not: greedy picks 1 only once 3 is penalized
    logits = torch.tensor([-1.0, 2.0, -4.0, 3.0])
    assert sampler()(logits.clone()) == 3
    s = sampler(repetition_penalty=2.0)
    assert s(logits.clone()) == 1  # 3 -> 1.5 < 2
    assert s(torch.tensor([-1.0, 2.0, -4.0, 3.0])) == 3  # 1 was generated: 2 -> 1.0 < 1.5


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    s = sampler(frequency_penalty=1.0, presence_penalty=0.5)
    logits = torch.tensor([-9.0, 5.0, 4.0, 4.9])  # prompt token 3 is not penalized by these
    assert [s(logits.clone()) for _ in range(3)] == [1, 3, 2]
    # after 1 once: 5 - 1 - 0.5 = 3.5; 3 once: 4.9 - 1.5 = 3.4; 2 untouched: 4.0


def test_min_tokens_still_blocks_eos_under_penalties() -> None:
    s = sampler(repetition_penalty=1.5, min_new_tokens=1)
    assert s(torch.tensor([9.0, 1.0, 0.0, 0.0])) == 1


def test_logprobs_are_of_the_raw_distribution_and_leave_the_choice_alone() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 0.5])
    plain, asking = sampler(), sampler(logprobs=2, repetition_penalty=1.3)
    token = asking(logits.clone())
    assert token == plain(logits.clone()) == 1
    want = torch.log_softmax(logits, dim=-1)
    chosen, top = asking.last
    assert chosen == pytest.approx(float(want[1]))
    assert [t for t, _ in top] == [1, 3] and top[1][1] == pytest.approx(float(want[3]))
    assert plain.last is None  # nothing computed for a request that did not ask


def test_token_logprob_with_no_alternatives() -> None:
    value, top = token_logprob(torch.log_softmax(torch.tensor([1.0, 1.0]), -1), 0, 0)
    assert value == pytest.approx(math.log(0.5)) and top == ()


def test_prompt_logprobs_score_each_token_from_the_position_before() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = prompt_logprobs(logits, [2, 1, 0], k=1)
    lp = torch.log_softmax(logits, dim=-1)
    assert out[0] is None
    assert out[1][0] == pytest.approx(float(lp[0, 1])) and out[1][1][0][0] == 2
    assert out[2][0] == pytest.approx(float(lp[1, 0]))


# -- the batched path (sample_rows) --------------------------------------------------------
def _samplers(params: list[SamplingParams], eos: frozenset[int] = frozenset([0])
              ) -> list[RowSampler]:
    return [RowSampler(p, eos, CPU) for p in params]


def _reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The per-row warpers' distribution of one row ([vocab], float64)."""
    return RowSampler(p, frozenset(), CPU).warped(logits.float()[None])[0].double()


# vocabularies: one block per row; 32 blocks and a remainder past the last full block
VOCABS = (17, 32 * 64 + 37)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sampled", [False, True])
def test_batched_greedy_is_the_per_row_argmax_ties_to_the_first_index(vocab, dtype,
                                                                     with_sampled) -> None:
    """Greedy rows take torch.argmax's token, whether every row is greedy (one argmax pass)
    or a sampled row makes the step take its block maxima first."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-3, 4, (64, vocab), generator=g).to(dtype)  # many ties
    logits[1] = 5  # all tied
    logits[2, -3:] = 9  # a tie past the last full block
    logits[3, [5, vocab - 1]] = 9  # one in a block, one after it
    logits[4, 7] = float("inf")
    logits[5, 3] = float("nan")  # argmax: the NaN, as torch
    samplers = _samplers([SamplingParams()] * 63 + [SamplingParams(temperature=0.9)
                                                     if with_sampled else SamplingParams()])
    got = sample_rows(logits, samplers)
    assert got[:63] == [int(row.float().argmax()) for row in logits[:63]]
    assert got[1] == 0 and got[2] == vocab - 3 and got[3] == 5
    assert all(s.generated == 1 for s in samplers)


def test_seeded_rows_give_the_tokens_of_their_own_call() -> None:
    g = torch.Generator().manual_seed(1)
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=5),
              SamplingParams(temperature=1.3, top_k=20, seed=6),
              SamplingParams(temperature=0.5, seed=7)]
    batch = _samplers([SamplingParams(temperature=1.0), *seeded, SamplingParams()])
    alone = _samplers(seeded)
    for _ in range(20):
        logits = torch.randn(5, 300, generator=g) * 3
        got = sample_rows(logits, batch)
        assert got[1:4] == [s(logits[i + 1]) for i, s in enumerate(alone)]


def test_seeded_row_matches_transformers_warpers_and_multinomial() -> None:
    """What a seeded request gave before batching: the warpers, softmax, multinomial."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    p = SamplingParams(temperature=0.7, top_k=30, top_p=0.8, seed=11)
    gen = torch.Generator().manual_seed(11)
    s = _samplers([p])
    for step in range(10):
        logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(step)) * 4
        scores = logits.clone()
        for w in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(30), TopPLogitsWarper(0.8)):
            scores = w(None, scores)
        want = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=gen))
        assert sample_rows(logits, s) == [want]


SAMPLED = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0, top_k=40),
           SamplingParams(temperature=0.5, top_k=10, top_p=0.9),
           SamplingParams(temperature=1.3, top_p=0.5), SamplingParams(temperature=0.7, top_k=3),
           SamplingParams(temperature=2.0), SamplingParams(temperature=0.9, top_k=1),
           SamplingParams(temperature=1.0, top_p=0.999)]


def _plan_of(logits: torch.Tensor, params: list[SamplingParams]) -> sampling._Candidates:
    scan = sampling._scan(logits)
    return sampling._plan(scan, list(range(len(params))),
                          np.array([p.temperature for p in params], dtype=np.float32),
                          np.array([p.top_k for p in params], dtype=np.int64),
                          np.array([p.top_p for p in params], dtype=np.float64),
                          logits.shape[1])


def _allowed(plan: sampling._Candidates, i: int, vocab: int) -> tuple[np.ndarray, float]:
    """Row i's weight per token (0: not allowed) and its tail's bound."""
    at = slice(plan.start[i], plan.start[i + 1])
    weights = np.zeros(vocab)
    weights[plan.cols[at]] = np.where(plan.keep[at], plan.weights[at], 0.0)
    return weights, float(plan.tail[i])


@pytest.mark.parametrize("nats", [sampling.CANDIDATE_NATS, 2.0])
@pytest.mark.parametrize("vocab", VOCABS)
def test_batched_rows_allow_the_warpers_tokens_with_their_probabilities(vocab, nats,
                                                                        monkeypatch) -> None:
    """The plan's tokens and weights are the warpers' nonzero probabilities (top-k ties
    kept, top-p keeps at least the best). With 2 nats most rows leave a tail: top-p rows
    then need its exact mass (`_row_weights`), temperature-only rows carry its bound."""
    monkeypatch.setattr(sampling, "CANDIDATE_NATS", nats)
    monkeypatch.setattr(sampling, "NARROW", 64)  # the wide rows' cut, at this vocabulary
    calls = []
    row_weights = sampling._row_weights
    monkeypatch.setattr(sampling, "_row_weights", lambda *a: calls.append(a) or row_weights(*a))
    g = torch.Generator().manual_seed(vocab)
    decided = 0
    for trial in range(12):
        logits = torch.randn(len(SAMPLED), vocab, generator=g) * (1 + trial)
        logits[:, 4] = logits[:, 9]  # a tie the size of anything
        logits[6, :3] = logits[6].max() + 1  # top_k=1 with a three-way tie at the top
        plan = _plan_of(logits, SAMPLED)
        for i, p in enumerate(SAMPLED):
            if not plan.exact[i]:
                continue
            decided += 1
            q = _reference(logits[i], p).numpy()
            weights, tail = _allowed(plan, i, vocab)
            if tail == 0:  # decided by the candidates: the same tokens, the same odds
                assert set(np.flatnonzero(weights)) == set(np.flatnonzero(q))
                assert weights / weights.sum() == pytest.approx(q, abs=1e-6)
            else:  # only rows without top-p keep a tail; what they hold is the warpers'
                assert p.top_p == 1.0 and not set(np.flatnonzero(weights)) - set(
                    np.flatnonzero(q))
                assert (weights / (weights.sum() + tail) <= q + 1e-6).all()
    # 2 nats deep (6 for top-p), a top-p 0.999 nucleus often reaches past the candidates
    assert decided >= len(SAMPLED) * 12 * (0.95 if nats > 2 else 0.8)
    assert calls or nats > 2


def test_rows_whose_nucleus_reaches_past_the_candidates_use_their_own_sampler(
        monkeypatch) -> None:
    """top_p 0.99 over a flat row, candidates 0.3 nats deep: even the tail's exact mass
    leaves most of it in the nucleus, so the row goes to its own sampler."""
    monkeypatch.setattr(sampling, "CANDIDATE_NATS", 0.1)
    logits = torch.zeros(1, 1000)
    logits[0, 0] = 1.0
    p = SamplingParams(temperature=1.0, top_p=0.99)
    assert not _plan_of(logits, [p]).exact[0]
    assert sample_rows(logits, _samplers([p]))[0] in range(1000)


def test_wide_rows_are_cut_to_their_nucleus_before_sorting(monkeypatch) -> None:
    """A row with thousands of candidates: the tokens above some score weigh p of it, so
    everything at or below that score is dropped before the sort, as the warpers would."""
    monkeypatch.setattr(sampling, "NARROW", 16)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 3000, generator=g) * 0.5
    logits[:, :40] += 6 + torch.randn(2, 40, generator=g)  # a head over a flat background
    params = [SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=500, top_p=0.95)]
    plan = _plan_of(logits, params)
    assert (np.diff(plan.start) > 2000).all() and plan.exact.all()
    for i, p in enumerate(params):
        weights, tail = _allowed(plan, i, 3000)
        q = _reference(logits[i], p).numpy()
        assert tail == 0 and set(np.flatnonzero(weights)) == set(np.flatnonzero(q))
        assert weights / weights.sum() == pytest.approx(q, abs=1e-6)


def _chi_square(counts: np.ndarray, q: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the tokens the reference allows (pooled below 5 expected),
    and its degrees of freedom; a draw outside them is a failure by itself."""
    assert counts[q == 0].sum() == 0, "a token the warpers rule out was drawn"
    n = counts.sum()
    expected = q * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (q > 0)].sum())
    exp = np.append(expected[big], expected[~big & (q > 0)].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("nats", [sampling.CANDIDATE_NATS, 1.0])
@pytest.mark.parametrize("p", [SamplingParams(temperature=0.8, top_p=0.95),
                               SamplingParams(temperature=1.5),
                               SamplingParams(temperature=0.6, top_k=6),
                               SamplingParams(temperature=1.2, top_k=5, top_p=0.8)])
def test_unseeded_batched_draws_follow_the_warpers_distribution(p, nats, monkeypatch) -> None:
    """40,000 draws of one row over a 12-token vocabulary against the warpers' own
    probabilities (Pearson chi-square; fixed RNG, so no flakiness). At 1 nat most of the
    mass sits below the candidates: temperature-only rows then draw the tail slot and
    `_tail_event` resolves it; top-k/top-p rows that the candidates cannot decide go to
    their own sampler."""
    monkeypatch.setattr(sampling, "CANDIDATE_NATS", nats)
    logits = torch.tensor([2.0, 1.5, 1.5, 0.3, -0.2, -1.0, 0.9, 2.2, -3.0, 0.0, 1.1, -0.5])
    q = _reference(logits, p).numpy()
    rows = 2000
    samplers = _samplers([p] * rows)
    for i, s in enumerate(samplers):  # the fall-back rows' own generators, reproducibly
        s._gen.manual_seed(i)
    rng = np.random.default_rng(0)
    counts = np.zeros(len(logits), dtype=np.int64)
    for _ in range(20):
        drawn = sample_rows(logits.expand(rows, -1), samplers, rng)
        counts += np.bincount(drawn, minlength=len(logits))
    stat, dof = _chi_square(counts, q)
    # the 99.99th percentile of chi-square(dof) is below dof + 6 sqrt(2 dof) + 10 here
    assert stat < dof + 6 * math.sqrt(2 * dof) + 10, (stat, dof, counts, q)
    assert all(s.generated == 20 for s in samplers)


def test_tail_event_draws_the_tail_with_its_exact_share(monkeypatch) -> None:
    """A row whose candidates are only its best token: every other token is in the tail,
    so only `_tail_event` can draw them, and it must at their true rate."""
    monkeypatch.setattr(sampling, "CANDIDATE_NATS", 0.25)
    logits = torch.tensor([1.0, 0.0, 0.0, -0.5, 0.2])
    p = SamplingParams(temperature=1.0)
    plan = _plan_of(logits[None], [p])
    assert plan.cols.tolist() == [0] and plan.tail[0] > 0
    rows = 4000
    counts = np.zeros(5, dtype=np.int64)
    rng = np.random.default_rng(1)
    for _ in range(5):
        counts += np.bincount(sample_rows(logits.expand(rows, -1), _samplers([p] * rows), rng),
                              minlength=5)
    stat, dof = _chi_square(counts, _reference(logits, p).numpy())
    assert stat < dof + 6 * math.sqrt(2 * dof) + 10, (stat, counts)


def test_min_new_tokens_still_suppresses_eos_and_counts_batched_tokens() -> None:
    eos = 2
    logits = torch.full((2, 6), -5.0)
    logits[:, eos] = 5.0  # EOS is every row's argmax
    logits[:, 4] = 4.0
    held = [SamplingParams(min_new_tokens=2), SamplingParams(temperature=0.5, top_k=1,
                                                             min_new_tokens=3)]
    samplers = _samplers(held, frozenset([eos]))
    buffer = logits.clone()
    steps = [sample_rows(buffer, samplers) for _ in range(4)]
    assert steps == [[4, 4], [4, 4], [eos, 4], [eos, eos]]
    assert [s.generated for s in samplers] == [4, 4]
    assert torch.equal(buffer, logits)  # suppression never writes into the caller's logits


def test_mixed_batches_keep_row_order() -> None:
    """Greedy, seeded, unseeded, penalized, logprob and EOS-held rows, interleaved: each
    row's token comes back at its own position."""
    vocab = 50
    best = [7, 3, 41, 12, 25, 30, 8, 19]
    logits = torch.randn(len(best), vocab, generator=torch.Generator().manual_seed(3))
    logits[torch.arange(len(best)), best] = 40.0  # each row's clear winner
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(repetition_penalty=1.2),
              SamplingParams(logprobs=1), SamplingParams(min_new_tokens=1),
              SamplingParams(temperature=1.0, top_k=3), SamplingParams()]
    samplers = _samplers(params, frozenset([49]))
    assert sample_rows(logits, samplers) == best
    assert samplers[4].last is not None and samplers[4].last[1][0][0] == 25
    assert [s.generated for s in samplers] == [1] * len(best)


def test_torch_scan_agrees_with_numpy(monkeypatch) -> None:
    """The whole-row torch path (CUDA) decides as the numpy one does, on the same rows."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randint(-4, 5, (len(SAMPLED), VOCABS[1]), generator=g).float()
    want_greedy = sampling._scan(logits).argmax(list(range(len(SAMPLED))))
    want = _plan_of(logits, SAMPLED)
    monkeypatch.setattr(sampling, "_scan", lambda x: sampling._TorchScan(x.detach()))
    assert sampling._scan(logits).argmax(list(range(len(SAMPLED)))).tolist() == \
        want_greedy.tolist()
    got = _plan_of(logits, SAMPLED)
    for field in ("start", "cols", "keep", "weights", "tail", "exact"):
        assert np.array_equal(getattr(got, field), getattr(want, field)), field


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="expected \\[rows, vocab\\]"):
        sample_rows(torch.zeros(3, 5), _samplers([SamplingParams()] * 2))
    assert sample_rows(torch.zeros(0, 5), []) == []


def _transposed(logits: torch.Tensor, compiled: int, dtype: torch.dtype = torch.float32
                ) -> torch.Tensor:
    """`logits` [n, vocab] as transformers-neuronx hands them back for a decode of seq ids
    0..n-1: rows of a [vocab, compiled] buffer, transposed (base.py:L715-L721, L634-L635)."""
    n, vocab = logits.shape
    buf = torch.full((vocab, 1, compiled), -7.0, dtype=dtype)
    buf[:, 0, :n] = logits.t().to(dtype)
    return buf[:vocab, -1, :].transpose(0, 1)[:n]


@pytest.mark.parametrize("gather_limit", [0, 1024])
@pytest.mark.parametrize("vocab", [VOCABS[0], 4096, 4096 + 5])
def test_bf16_transposed_logits_are_read_as_bits_with_torchs_argmax(vocab, gather_limit,
                                                                    monkeypatch) -> None:
    """A bf16 transposed view is scanned through its bits (scan.Bf16ColumnScan): the same
    greedy tokens as torch.argmax of the float rows -- ties to the first index, -0.0 and
    0.0 tied, rows all negative, +inf, a positive NaN -- and the same float32 logits for
    whoever reads them whole (a grammar's rows). A negative NaN or -inf anywhere in the
    rows sends the step to the float32 path, which ranks NaN as torch does. All-negative
    blocks take their minimum gathered, or (past GATHER_LIMIT of them) in a whole pass."""
    monkeypatch.setattr(scan_module.Bf16ColumnScan, "GATHER_LIMIT", gather_limit)
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-3, 4, (8, vocab), generator=g).bfloat16()  # many ties
    logits[1] = -torch.rand(vocab, generator=g).bfloat16() - 0.5  # every value negative
    logits[2, [3, vocab - 2]] = 9  # a tie; the second may lie past the last full block
    logits[3] = -1
    logits[3, [4, 9]] = torch.tensor([-0.0, 0.0]).bfloat16()  # -0.0 first: it wins the tie
    logits[4, 7] = float("inf")
    logits[5, 11] = float("nan")  # positive: argmax is the NaN, as torch's
    logits[6] = 0.5
    logits[6, vocab - 1] = 0.75
    view = _transposed(logits, compiled=16, dtype=torch.bfloat16)
    got = scan_module.scan(view)
    assert isinstance(got, scan_module.Bf16ColumnScan)
    want = [int(row.float().argmax()) for row in logits]
    assert sample_rows(view, _samplers([SamplingParams()] * 8)) == want
    assert want[3] == 4 and want[5] == 11 and want[6] == vocab - 1
    assert np.array_equal(got.x, logits.float().numpy(), equal_nan=True)
    assert np.array_equal(got.max, logits.float().amax(dim=1).numpy(), equal_nan=True)
    blocks = logits[:, :got.blocks.shape[1] * got.width].float().unflatten(1, (-1, got.width))
    assert np.array_equal(got.block_max, blocks.amax(dim=2).numpy(), equal_nan=True)
    for bits in (-128, -64):  # 0xFF80 -inf, 0xFFC0 a NaN with its sign bit set (as x86
        held = logits.clone()  # makes NaN; torch's cast to bf16 would make it positive)
        held.view(torch.int16)[0, vocab // 2] = bits
        view = _transposed(held, compiled=16, dtype=torch.bfloat16)
        assert not isinstance(scan_module.scan(view), scan_module.Bf16ColumnScan)
        assert sample_rows(view, _samplers([SamplingParams()] * 8)) == [
            int(row.float().argmax()) for row in held]


@pytest.mark.parametrize("vocab", [VOCABS[0], 4096 + 5])
def test_transposed_logits_give_the_same_tokens_as_contiguous_ones(vocab) -> None:
    """transformers-neuronx's column-major view is read column-wise (scan.ColumnScan) and
    picks every token a contiguous copy does: greedy (ties to the first index), seeded and
    unseeded top-k / top-p rows with the same draws, and a step whose seeded row is taken
    out of the batch (the rest are not copied out of the view)."""
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(8, vocab, generator=g) * 3).bfloat16().float()  # bf16 values
    logits[0, [5, vocab - 3]] = 50.0  # a tie: the first index wins
    logits[1, vocab - 1] = 60.0  # the best past the last full block
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.8, top_k=20),
              SamplingParams(temperature=1.0, top_k=5, seed=7),
              SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(),
              SamplingParams(temperature=1.3, top_k=50, top_p=0.95), SamplingParams()]
    view = _transposed(logits, compiled=32)
    assert sampling.column_major(view) and torch.equal(view, logits)
    assert isinstance(sampling._scan(view), scan_module.ColumnScan)
    for rows in (params, [p for p in params if p.seed is None]):
        n = len(rows)
        for step in range(3):
            want = sample_rows(logits[:n].contiguous(), _samplers(rows),
                               rng=np.random.default_rng(step))
            got = sample_rows(_transposed(logits[:n], 32), _samplers(rows),
                              rng=np.random.default_rng(step))
            assert got == want
    greedy = sample_rows(view, _samplers([SamplingParams()] * 8))
    assert greedy == logits.argmax(dim=1).tolist() and greedy[:2] == [5, vocab - 1]
    bf16 = sample_rows(_transposed(logits, 32, torch.bfloat16), _samplers(params),
                       rng=np.random.default_rng(0))
    assert bf16 == sample_rows(logits, _samplers(params), rng=np.random.default_rng(0))
