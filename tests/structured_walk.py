"""A stand-in model for grammar tests: it samples only what the mask allows.

`walk` plays a model whose logits favour short answers -- EOS where the grammar allows
it, tokens holding JSON punctuation over plain text -- over a seeded RNG, through the
same `MaskBatch.fill` / `apply` a backend uses, so what it produces is what the grammar
lets through. The corpus (tests/data/structured/schemas.json) is shared by the unit
tests, the end-to-end tests and bench/grammar_engines.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).resolve().parent / "data" / "structured" / "schemas.json"
PUNCT = set(b'"{}[],:0123456789')


def corpus() -> dict:
    return json.loads(CORPUS.read_text())


def token_bias(ll_tokenizer, vocab_size: int) -> np.ndarray:
    """[vocab] float32 logits of the stand-in model: punctuation-holding tokens +5, the
    rest 0 (EOS is raised where allowed by `walk`)."""
    bias = np.zeros(vocab_size, dtype=np.float32)
    for i in range(min(vocab_size, ll_tokenizer.vocab_size)):
        piece = ll_tokenizer.decode_bytes([i])
        if piece and len(piece) <= 4 and any(b in PUNCT for b in piece):
            bias[i] = 5.0
    return bias


def walk(grammar, masks, bias: np.ndarray, eos_ids: list[int], rng: np.random.Generator,
         max_tokens: int = 1200, row: int = 0) -> tuple[list[int], bool]:
    """(tokens, ended by EOS or a complete grammar) of one constrained answer."""
    tokens: list[int] = []
    for _ in range(max_tokens):
        if grammar.done:
            return tokens, True
        masks.fill([(row, grammar)])
        logits = np.zeros((row + 1, len(bias)), dtype=np.float32)
        logits[row] = bias + rng.gumbel(size=len(bias)).astype(np.float32)
        logits[row, eos_ids] += 20.0
        masks.apply(logits, [row])
        token = int(np.argmax(logits[row]))
        if token in eos_ids:
            return tokens, True
        if grammar.accept([token]) != 1:
            raise AssertionError(f"the grammar refused token {token} that its mask allowed: "
                                 f"{grammar.failed}")
        tokens.append(token)
    return tokens, False
