"""Next-token choice from logits, with each row's own parameters.

Two parts: `row` (RowSampler: one sequence's state, sampled on its own; the
log-probability helpers) and `batched` (sample_rows: every row of a step in one call,
each with its own temperature, top-k, top-p and grammar mask, the rows that need their
own state handed to their RowSampler). The backends import both names from here.
"""

from __future__ import annotations

from handlers.backends.sampling.batched import sample_rows
from handlers.backends.sampling.row import RowSampler, prompt_logprobs, token_logprob

__all__ = ["RowSampler", "prompt_logprobs", "sample_rows", "token_logprob"]
