"""Incremental detokenization and stop strings, per sequence.

Decoding token by token breaks multi-byte characters (a byte-level BPE token can
hold half an emoji) and SentencePiece spacing; decoding everything each step is
O(n^2). We keep a short window (prefix/read offsets, as TGI does) and hold back
text that ends in U+FFFD, the mark of an incomplete UTF-8 sequence. The joined
deltas equal `tokenizer.decode(all_ids)`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

#: where transformers' stock decode path lives: PreTrainedTokenizerBase.decode, then the
#: fast tokenizer's _decode (4.x: tokenization_utils_fast, 5.x: tokenization_utils_tokenizers)
_STOCK_DECODE = "transformers.tokenization_utils_base"
_STOCK_FAST_DECODE = ("transformers.tokenization_utils_fast",
                      "transformers.tokenization_utils_tokenizers")


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def decoder(tokenizer: Tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, straight from the Rust tokenizer
    where transformers' wrapper adds nothing: a stock fast tokenizer's decode is the
    backend's decode plus an optional clean-up of spaces (4.36-5.x). The wrapper's input
    conversion costs ~5 us of the ~6 us a short decode takes, twice per generated token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
            and _stock_decode(type(tokenizer))):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


@functools.cache
def _stock_decode(cls: type) -> bool:
    """Whether `cls` decodes through transformers' own decode and fast _decode (once per
    class, not per request)."""
    def owner(name: str) -> str | None:
        return next((c.__module__ for c in cls.__mro__ if name in vars(c)), None)

    return owner("decode") == _STOCK_DECODE and owner("_decode") in _STOCK_FAST_DECODE


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode_ids = decoder(tokenizer)
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # end of the text already returned
        self._prefix_text = ""  # decode of ids[prefix:read], cached: one decode per token

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._decode_ids(self._ids[start:end])

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        new_text = self._decode(self._prefix)
        if len(new_text) > len(self._prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(self._prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_text = self._decode(self._prefix, self._read)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end)."""
        new_text = self._decode(self._prefix)
        self._prefix = self._read = len(self._ids)
        delta, self._prefix_text = new_text[len(self._prefix_text):], ""
        return delta


class StopMatcher:
    """Cuts the stream at the first stop string, holding back a possible partial match."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        if not self._stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[:min(hits)], True
        hold = max((k for s in self._stops for k in range(1, len(s)) if buf.endswith(s[:k])),
                   default=0)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
