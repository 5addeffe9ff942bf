"""The whole corpus of real schemas through the grammar layer: every schema as a
response_format, every function schema as a forced (named) tool call; each finished answer of
the stand-in model (tests/structured_walk.py) validates with jsonschema. The grammar layer's
own tests, which also run under transformers 4.x and CPython 3.10, are test_structured.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from archive_tools.demo_model import SIZES, build_tokenizer
from handlers.structured import spec as specs
from tests.structured_walk import corpus, corpus_tools, finished_answers, schema_spec, stand_in

CORPUS = corpus()
FUNCTIONS, TOOLS = corpus_tools()


@pytest.fixture(scope="module")
def stand_in_model():
    compiler, model = stand_in(build_tokenizer(SIZES["tiny"], seed=0))
    yield compiler, model
    compiler.close()


@pytest.mark.parametrize("entry", CORPUS["schemas"], ids=lambda e: e["id"])
def test_every_finished_answer_validates_against_its_schema(stand_in_model, entry) -> None:
    texts = finished_answers(*stand_in_model, schema_spec(entry["schema"]))
    assert texts, f"{entry['id']}: no answer finished within 1200 tokens"
    for text in texts:
        jsonschema.validate(json.loads(text), entry["schema"])


@pytest.mark.parametrize("entry", FUNCTIONS, ids=lambda e: e["id"])
def test_a_named_function_is_called_with_valid_arguments(stand_in_model, entry) -> None:
    spec = specs.forced_tool_call(TOOLS, entry["name"])
    texts = finished_answers(*stand_in_model, spec)
    assert texts
    for text in texts:
        call = json.loads(text)
        assert list(call) == ["name", "parameters"] and call["name"] == entry["name"]
        jsonschema.validate(call["parameters"], entry["schema"])
