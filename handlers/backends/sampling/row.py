"""One sequence's next token on its own: `RowSampler` and the log-probability helpers.

A row that carries state of its own (a seed, penalties, logprobs, or EOS still suppressed
by min_new_tokens) is sampled here, token by token, exactly as transformers' warpers
and vLLM's penalty formulas say; every other row may be taken by the batched pass
(handlers/backends/sampling/batched.py), which asks `RowSampler.route()` which rows it may.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from handlers.backends.base import SamplingParams, TokenLogprob

GREEDY, SAMPLE, ROW = 0, 1, 2  # RowSampler.route()


class RowSampler:
    """One sequence's sampling state: its parameters, RNG and generated count."""

    def __init__(self, params: SamplingParams, eos_ids: frozenset[int], device: torch.device,
                 prompt: Sequence[int] = ()):
        self.params = params
        self.generated = 0
        self.last: TokenLogprob | None = None  # the last token's, when params.logprobs is set
        self._penalized = params.penalized  # read per token: plain attributes, no property
        self._logprobs = params.logprobs
        self._greedy = params.greedy
        self._min_new = params.min_new_tokens
        self._prompt = prompt if self._penalized else ()
        self._counts: torch.Tensor | None = None  # [vocab] output counts (penalties only)
        self._seen: torch.Tensor | None = None  # [vocab] in prompt or output (repetition)
        self._eos = sorted(eos_ids)
        self._eos_index: torch.Tensor | None = None
        # the batched paths take rows that carry no per-row state but the count
        self._route = (ROW if self._penalized or self._logprobs is not None
                       else GREEDY if self._greedy
                       else ROW if params.seed is not None else SAMPLE)
        self._warpers = []
        if not params.greedy:
            self._warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                self._warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                self._warpers.append(TopPLogitsWarper(params.top_p))
        self._gen = None
        if not params.greedy:
            self._gen = torch.Generator(device=device)
            if params.seed is not None:
                self._gen.manual_seed(params.seed)
            else:
                self._gen.seed()

    def route(self) -> int:
        """GREEDY or SAMPLE: `sample_rows` may take this row's next token in its batched
        pass; ROW: it must come from `__call__` (a seed, penalties, logprobs, or EOS still
        suppressed by min_new_tokens)."""
        if self.generated < self._min_new and self._eos:
            return ROW
        return self._route

    def __call__(self, logits: torch.Tensor, allowed: np.ndarray | None = None) -> int:
        """logits: [vocab] (float) for this row's last position; `allowed`: [vocab] bool, the
        only tokens it may take (a grammar's mask), applied after penalties."""
        scores = logits.float().unsqueeze(0)  # [1, vocab]; for float32 logits, a view
        logprobs = None
        if self._logprobs is not None:  # of the model's own distribution
            logprobs = torch.log_softmax(scores[0], dim=-1)
        if self._penalized:
            scores = self._penalize(scores)
        if self.generated < self._min_new and self._eos:
            if self._eos_index is None:
                self._eos_index = torch.tensor(self._eos, device=scores.device)
            # out of place: `scores` may be the caller's logits (the synthetic device reuses
            # one buffer every step)
            scores = scores.index_fill(1, self._eos_index, float("-inf"))
        if allowed is not None:  # out of place too
            keep = torch.from_numpy(allowed).to(scores.device)
            scores = scores.masked_fill(~keep[None], float("-inf"))
        self.generated += 1
        if self._greedy:
            token = int(scores.argmax(dim=-1))
        else:
            token = int(torch.multinomial(self.warped(scores), 1, generator=self._gen))
        if logprobs is not None:
            self.last = token_logprob(logprobs, token, self._logprobs)
        if self._counts is not None:
            self._counts[token] += 1
            self._seen[token] = True
        return token

    def warped(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [1, vocab] float -> the probabilities this row samples from (temperature,
        top-k, top-p as transformers' warpers)."""
        for warp in self._warpers:
            scores = warp(None, scores)
        return torch.softmax(scores, dim=-1)

    def _penalize(self, scores: torch.Tensor) -> torch.Tensor:
        """vLLM's order and formulas (vllm/model_executor/layers/utils.py apply_penalties)."""
        p = self.params
        if self._counts is None:
            self._counts = torch.zeros(scores.shape[-1], device=scores.device)
            self._seen = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
            if len(self._prompt):
                self._seen[torch.tensor(list(self._prompt), device=scores.device)] = True
        scores = scores.clone()
        row = scores[0]
        if p.repetition_penalty != 1.0:
            hit = row[self._seen]
            row[self._seen] = torch.where(hit > 0, hit / p.repetition_penalty,
                                          hit * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            row -= p.frequency_penalty * self._counts + p.presence_penalty * (self._counts > 0)
        return scores


def token_logprob(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """logprobs: [vocab] log-softmax; `token`'s value and the top `k` (id, value) pairs."""
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = torch.topk(logprobs, k)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return float(logprobs[token]), top


def prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int], k: int
                    ) -> list[TokenLogprob | None]:
    """logits: [len(prompt), vocab] of a forward over the prompt; position i predicts token
    i + 1, so the first token has none (None)."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)  # [L-1, vocab]
    ids = torch.tensor(list(prompt[1:]), device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    tops: list[tuple] = [()] * len(chosen)
    if k:
        values, top_ids = torch.topk(logprobs, k, dim=-1)
        tops = [tuple(zip(i, v, strict=True))
                for i, v in zip(top_ids.tolist(), values.tolist(), strict=True)]
    return [None, *zip(chosen, tops, strict=True)]
