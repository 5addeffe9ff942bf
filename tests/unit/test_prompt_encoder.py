"""handlers/torchserve/service.py prompt_encoder: the Rust tokenizer's ids only where they equal the
wrapper's, so a faster tokenization never changes a prompt."""

from __future__ import annotations

import types

from handlers.engine.start import load_tokenizer
from handlers.torchserve.service import prompt_encoder

PROMPTS = ["Once upon a time", "", "  two leading spaces", "line\nbreaks\n\nand\ttabs",
           "<s> looks special </s>", "ünïcödé and 🤖", "x" * 300]


def test_the_fast_path_gives_the_wrappers_ids(tiny_checkpoint):
    tokenizer = load_tokenizer(tiny_checkpoint)
    encode = prompt_encoder(tokenizer)
    assert encode.__name__ == "direct"  # the demo tokenizer qualifies (a Rust tokenizer)
    for prompt in PROMPTS:
        assert encode(prompt) == list(tokenizer(prompt)["input_ids"]), prompt


def test_a_backend_that_disagrees_on_any_probe_is_not_used():
    class Backend:
        def encode(self, text):
            return types.SimpleNamespace(ids=list(map(ord, text)))

    class Tokenizer:  # its wrapper adds a BOS that its backend does not
        backend_tokenizer = Backend()

        def __call__(self, text):
            return {"input_ids": [1, *map(ord, text)]}

    assert prompt_encoder(Tokenizer())("hi") == [1, 104, 105]


def test_a_tokenizer_without_a_rust_backend_keeps_the_wrapper():
    class Slow:
        def __call__(self, text):
            return {"input_ids": [7, len(text)]}

    assert prompt_encoder(Slow())("abc") == [7, 3]
