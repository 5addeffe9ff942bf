"""Host sampling's penalties and logprobs (handlers/sampling.py): vLLM's formulas, and
nothing changes for a request that asks for neither."""

from __future__ import annotations

import math

import pytest
import torch

from handlers.backends.base import SamplingParams
from handlers.sampling import RowSampler, prompt_logprobs, token_logprob

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
