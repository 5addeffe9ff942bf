"""Incremental detokenization against the real demo tokenizer (byte-level BPE)."""

import copy

import pytest

from handlers.detokenize import IncrementalDetokenizer, StopMatcher, decoder


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
