"""Incremental detokenization and stop strings, per sequence.

Decoding token by token breaks multi-byte characters (a byte-level BPE token can
hold half an emoji) and SentencePiece spacing; decoding everything each step is
O(n^2). We keep a short window (prefix/read offsets, as TGI does) and hold back
text that ends in U+FFFD, the mark of an incomplete UTF-8 sequence -- for a byte-level
tokenizer only that last character (`lossy_utf8`). The joined deltas equal
`tokenizer.decode(all_ids)`.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _StopAutomaton:
    """Aho-Corasick over a request's stop strings, built once per distinct set.

    State n is a trie node: the longest suffix of the text seen so far that begins some
    stop string, `depth[n]` characters long. `goto[n]` holds the trie's edges and
    `fail[n]` the node of the next shorter such suffix; `longest[n]` is the length of the
    longest stop string ending here (through the fail chain), 0 if none."""

    goto: tuple[dict[str, int], ...]
    fail: tuple[int, ...]
    depth: tuple[int, ...]
    longest: tuple[int, ...]

    def step(self, state: int, char: str) -> int:
        goto, fail = self.goto, self.fail
        while True:
            nxt = goto[state].get(char)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]


#: a worst-case set (8 x 256 characters, 2,048 trie nodes) holds ~0.5 MB: 16 MB at most
_AUTOMATON_CACHE = 32


@functools.lru_cache(maxsize=_AUTOMATON_CACHE)
def _automaton(stops: tuple[str, ...]) -> _StopAutomaton:
    goto: list[dict[str, int]] = [{}]
    depth, ends = [0], [0]
    for stop in stops:
        node = 0
        for char in stop:
            edges = goto[node]
            nxt = edges.get(char)
            if nxt is None:
                nxt = edges[char] = len(goto)
                goto.append({})
                depth.append(depth[node] + 1)
                ends.append(0)
            node = nxt
        ends[node] = len(stop)
    fail, longest = [0] * len(goto), list(ends)
    queue = collections.deque(goto[0].values())  # the root's children fail to the root
    while queue:  # breadth first: a node's fail target is shallower, so already final
        node = queue.popleft()
        longest[node] = max(ends[node], longest[fail[node]])
        for char, child in goto[node].items():
            f = fail[node]  # the child fails to the deepest f on node's chain with an edge
            while (nxt := goto[f].get(char)) is None and f:
                f = fail[f]
            fail[child] = 0 if nxt is None else nxt
            queue.append(child)
    return _StopAutomaton(tuple(goto), tuple(fail), tuple(depth), tuple(longest))


class StopMatcher:
    """Cuts the stream at the first stop string, holding back a possible partial match.

    The text held back is the longest suffix that begins some stop string, so a stop
    split across tokens is still found and nothing that might be one goes out. Where a
    stop string ends, the earliest-starting stop string found in the held and new text
    wins. Trying every prefix of every stop string at each token cost ~233 us a token
    with 8 stop strings of 256 characters; the automaton carries its state from token to
    token, so the work per token is bounded by the new text, whatever the stop strings
    (bench/stop_strings.py)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._auto = _automaton(tuple(stops)) if stops else None
        self._state = 0
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was hit)."""
        auto = self._auto
        if auto is None:
            return text, False
        buf = self._held + text
        offset, state, longest = len(self._held), self._state, auto.longest
        first = -1  # the earliest start of a stop string found in buf
        for i, char in enumerate(text):
            state = auto.step(state, char)
            if longest[state]:
                start = offset + i + 1 - longest[state]
                if first < 0 or start < first:
                    first = start
        if first >= 0:
            self._held, self._state = "", 0
            return buf[:first], True
        hold = auto.depth[state]
        self._state = state
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        held, self._held, self._state = self._held, "", 0
        return held
