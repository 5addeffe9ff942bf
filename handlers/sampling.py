"""Next-token choice from logits, with each row's own parameters.

Shared by the backends that return logits to the host (torch; Neuron in
continuous mode). Temperature, top-k and top-p use transformers' own logits
warpers, so a row samples exactly as `generate` would with the same settings.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from handlers.backends.base import SamplingParams


class RowSampler:
    """One sequence's sampling state: its parameters, RNG and generated count."""

    def __init__(self, params: SamplingParams, eos_ids: frozenset[int], device: torch.device):
        self.params = params
        self.generated = 0
        self._eos = sorted(eos_ids)
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

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] (float) for this row's last position."""
        scores = logits.float().unsqueeze(0)  # [1, vocab]
        if self.generated < self.params.min_new_tokens and self._eos:
            scores[:, self._eos] = float("-inf")
        self.generated += 1
        if self.params.greedy:
            return int(scores.argmax(dim=-1))
        for warp in self._warpers:
            scores = warp(None, scores)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._gen))
