"""Incremental detokenization and stop strings, per sequence.

Decoding token by token breaks multi-byte characters (a byte-level BPE token can
hold half an emoji) and SentencePiece spacing; decoding everything each step is
O(n^2). We keep a short window (prefix/read offsets, as TGI does) and hold back
text that ends in U+FFFD, the mark of an incomplete UTF-8 sequence -- for a byte-level
tokenizer only that last character (`lossy_utf8`). The joined deltas equal
`tokenizer.decode(all_ids)`.
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


def lossy_utf8(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's text is `String::from_utf8_lossy` of all its tokens' bytes:
    the byte-level decoder alone (GPT-2, Llama 3; huggingface/tokenizers, tokenizers/src/
    pre_tokenizers/byte_level.rs, `impl Decoder for ByteLevel`). There an incomplete UTF-8
    sequence is one U+FFFD, and only at the very end; every other U+FFFD (a byte that can
    never start or continue a character) is final. SentencePiece's byte fallback (Llama 2)
    turns a whole run of byte tokens into one U+FFFD per byte until the run is valid, so
    nothing of such a run is final before it ends."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    from tokenizers import decoders

    return isinstance(backend.decoder, decoders.ByteLevel)


@functools.cache
def _stock_decode(cls: type) -> bool:
    """Whether `cls` decodes through transformers' own decode and fast _decode (once per
    class, not per request)."""
    def owner(name: str) -> str | None:
        return next((c.__module__ for c in cls.__mro__ if name in vars(c)), None)

    return owner("decode") == _STOCK_DECODE and owner("_decode") in _STOCK_FAST_DECODE


class IncrementalDetokenizer:
    """Holding back all of a text that ends in U+FFFD (TGI's rule) holds a stream of bytes
    that never form a character until a whole one follows: the bench model's answer to
    one prompt opened with lone continuation bytes, and its first text came 0.6 s late
    and a later one 3.4 s late. With a byte-level tokenizer only the last character waits."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode_ids = decoder(tokenizer)
        self._lossy = lossy_utf8(tokenizer)
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # end of the ids whose text was all returned
        self._prefix_text = ""  # decode of ids[prefix:read], cached: one decode per token
        self._shown = 0  # characters returned past prefix_text, from ids[read:] (lossy only)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._decode_ids(self._ids[start:end])

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        new_text = self._decode(self._prefix)
        done = len(self._prefix_text) + self._shown
        if len(new_text) > len(self._prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[done:]
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_text = self._decode(self._prefix, self._read)
            self._shown = 0
            return delta
        if self._lossy and new_text.endswith("\ufffd") and len(new_text) - 1 > done:
            delta = new_text[done:-1]  # all but the one character that may still complete
            self._shown += len(delta)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end)."""
        new_text = self._decode(self._prefix)
        delta = new_text[len(self._prefix_text) + self._shown:]
        self._prefix = self._read = len(self._ids)
        self._prefix_text, self._shown = "", 0
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
