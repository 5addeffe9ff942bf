"""Incremental detokenization against the real demo tokenizer (byte-level BPE)."""

import copy

import pytest

from handlers.engine.detokenize import IncrementalDetokenizer, StopMatcher, decoder, lossy_utf8


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


@pytest.mark.parametrize("text", [
    "plain ascii words",
    "Emojis 🙂🚀👍🏽 and ❤️ mixed",
    "日本語のテキスト。中文文本：今天天气很好",
    "한국어 Ελληνικά עברית",
])
def test_deltas_join_to_full_decode_and_never_split_a_character(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)
    assert len([d for d in deltas if d]) > 1  # it really streams


def test_random_byte_tokens_match_full_decode(tokenizer):
    import random

    rng = random.Random(0)
    ids = [rng.randrange(3, len(tokenizer)) for _ in range(200)]
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    assert out == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_stock_fast_tokenizer_decodes_in_rust_and_anything_else_through_decode(
        tokenizer, monkeypatch):
    import random

    rng = random.Random(1)
    ids = [rng.randrange(len(tokenizer)) for _ in range(64)] + list(tokenizer.all_special_ids)
    assert decoder(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True)

    def wrapped(self, token_ids, **kwargs):
        return "wrapper"

    custom = copy.copy(tokenizer)  # a model's own tokenizer class overriding _decode
    custom.__class__ = type("Custom", (type(tokenizer),), {"_decode": wrapped})
    assert decoder(custom)(ids) == "wrapper"
    cleaned = copy.copy(custom)
    cleaned.__class__ = type(tokenizer)
    cleaned.clean_up_tokenization_spaces = True  # the wrapper edits the backend's text
    monkeypatch.setattr(type(tokenizer), "_decode", wrapped)
    assert decoder(cleaned)(ids) == "wrapper"
    assert decoder(tokenizer)(ids) != "wrapper"  # the stock class: the Rust decode itself


def test_stop_matcher_holds_and_cuts():
    m = StopMatcher(("###", "\n\n"))
    assert m.feed("abc#") == ("abc", False)
    assert m.feed("#") == ("", False)
    assert m.feed("#tail") == ("", True)
    m = StopMatcher(("###",))
    assert m.feed("a#b") == ("a#b", False)
    assert m.feed("#") == ("", False)
    assert m.flush() == "#"


def _byte_ids(tokenizer, text: str) -> list[int]:
    """The single-byte tokens of `text`'s UTF-8 bytes, in order."""
    chars = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)[0][0]
    return tokenizer.convert_tokens_to_ids(list(chars))


def test_bytes_that_never_form_a_character_stream_one_token_late(tokenizer):
    """A byte-level tokenizer's lone continuation bytes (the bench model's answer to one
    prompt) go out a token late instead of waiting for a whole character; a character
    split over tokens still goes out whole."""
    lone = _byte_ids(tokenizer, "Ş")[1]  # 0x9E of C5 9E: never starts a character
    euro = _byte_ids(tokenizer, "€")  # E2 82 AC
    word = tokenizer(" the", add_special_tokens=False)["input_ids"]
    ids = [lone] * 3 + euro + word
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(i) for i in ids]
    assert deltas[:6] == ["", "\ufffd", "\ufffd", "\ufffd", "", "\u20ac"]
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids) == "\ufffd" * 3 + "€ the"


def test_byte_level_text_is_final_but_for_one_character(tokenizer):
    """Random runs of single bytes and words: what went out is always a prefix of the whole
    answer's text, and at most its last character waits."""
    import random

    rng = random.Random(2)
    words = tokenizer(" a word", add_special_tokens=False)["input_ids"]
    pool = _byte_ids(tokenizer, "éž€😀Ş") + words
    for _ in range(200):
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 24))]
        final = tokenizer.decode(ids)
        detok, out = IncrementalDetokenizer(tokenizer), ""
        for k, i in enumerate(ids, 1):
            out += detok.push(i)
            assert final.startswith(out)
            assert len(tokenizer.decode(ids[:k])) - len(out) <= 1
        assert out + detok.flush() == final


def test_sentencepiece_byte_fallback_holds_a_byte_run_until_it_ends():
    """Llama 2's decoder turns a run of byte tokens into one U+FFFD per byte until the run
    is valid UTF-8, so no part of it is final before it ends: TGI's rule stays."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581word": 257}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert not lossy_utf8(fast)
    e_acute = [1 + 0xC3, 1 + 0xA9]
    ids = [1 + 0x9E] * 3 + e_acute + [257]
    detok = IncrementalDetokenizer(fast)
    deltas = [detok.push(i) for i in ids]
    assert deltas[:5] == [""] * 5 and deltas[5]
    assert "".join(deltas) + detok.flush() == fast.decode(ids) == "\ufffd" * 5 + " word"


class _PrefixStopMatcher:
    """The matcher before the automaton (kept here as the reference): every prefix of every
    stop string tried at each feed."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops, self._held = stops, ""

    def feed(self, text: str) -> tuple[str, bool]:
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


def _run(matcher, chunks: list[str]) -> tuple[list[tuple[str, bool]], str]:
    out = []
    for chunk in chunks:
        out.append(matcher.feed(chunk))
        if out[-1][1]:
            break
    return out, matcher.flush()


def test_stop_matcher_equals_the_prefix_reference_on_random_streams():
    """Same output, feed by feed, as trying every prefix (the old rule), on small alphabets
    where stops overlap, nest and recur, one of them with an emoji: 3,000 random streams."""
    import random

    rng = random.Random(7)
    for _ in range(3000):
        alphabet = rng.choice(("ab", "abc", "a\U0001f642b"))
        stops = tuple({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
                       for _ in range(rng.randint(1, 4))})
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _run(StopMatcher(stops), chunks) == _run(_PrefixStopMatcher(stops), chunks), (
            stops, chunks)


@pytest.mark.parametrize("stops, chunks, out", [
    (("abab",), list("xabab"), ["x", "", "", "", ""]),  # found across 1-char feeds
    (("abab",), ["aba", "bab"], ["", ""]),  # in "ababab": the first occurrence
    (("abac",), ["abab", "ac"], ["ab", ""]),  # the hold falls back from "aba" to "ab"
    (("ab", "abc"), ["xab"], ["x"]),  # a stop that is a prefix of another
    (("abcd", "bc"), ["abcd"], [""]),  # the earliest start wins, not the earliest end
    (("abcd", "bc"), ["ab", "c"], ["", "a"]),  # ...among what has arrived
    (("🤖!",), ["x🤖", "", "y🤖", "!z"], ["x", "", "🤖y", ""]),  # whole characters
    (("stop",), ["st", "", "ops"], ["", "", ""]),  # empty feeds keep the hold
])
def test_stop_matcher_edges(stops, chunks, out):
    m = StopMatcher(stops)
    fed = [m.feed(c) for c in chunks]
    assert [text for text, _ in fed] == out
    assert [hit for _, hit in fed] == [False] * (len(chunks) - 1) + [True]


def test_stop_matcher_work_does_not_grow_with_stop_length():
    """Per feed, the automaton steps once per new character: a stop set of 8 x 256
    characters costs the same steps as one short stop (bounded by the new text)."""
    from handlers.engine import detokenize

    steps = []
    real = detokenize._StopAutomaton.step

    def counted(self, state, char):
        steps.append(char)
        return real(self, state, char)

    long = tuple(("x" * 255) + str(i) for i in range(8))
    detokenize._StopAutomaton.step = counted
    try:
        m = StopMatcher(long)
        for _ in range(100):
            m.feed("xxxx")
    finally:
        detokenize._StopAutomaton.step = real
    assert len(steps) == 400
