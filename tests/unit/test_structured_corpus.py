"""The whole corpus of real schemas through the grammar layer: every schema as a
response_format; every schema that is a valid function-parameters schema (an object: the 47
functions and 19 of the documents) as a tool forced by name among the corpus' functions and
alone under `tool_choice: "required"`; each finished answer of the stand-in model
(tests/structured_walk.py) validates with jsonschema. The grammar layer's
own tests, which also run under transformers 4.x and CPython 3.10, are test_structured.py."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from archive_tools.demo_model import SIZES, build_tokenizer
from handlers.structured import spec as specs
from tests.structured_walk import corpus, corpus_tools, finished_answers, schema_spec, stand_in

CORPUS = corpus()
FUNCTIONS, TOOLS = corpus_tools()
#: every schema a function may take as its parameters (an object), each as a tool: a
#: document gets a function name made of its id
PARAMETERS = [e for e in CORPUS["schemas"] if e["schema"].get("type") == "object"]


def _tool(entry: dict) -> dict:
    name = entry.get("name") or re.sub(r"[^A-Za-z0-9_-]", "_", entry["id"])[:64]
    return {"type": "function", "function": {"name": name, "parameters": entry["schema"]}}


def _calls(text: str, tools: list[dict]) -> None:
    """`text` is one call of one of `tools` whose arguments validate."""
    call = json.loads(text)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert list(call) == ["name", "parameters"] and call["name"] in schemas
    jsonschema.validate(call["parameters"], schemas[call["name"]])


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


def test_every_object_schema_of_the_corpus_is_a_function_parameters_schema() -> None:
    assert len(PARAMETERS) == 66 and len({_tool(e)["function"]["name"] for e in PARAMETERS}) == 66


@pytest.mark.parametrize("entry", PARAMETERS, ids=lambda e: e["id"])
def test_a_named_function_is_called_with_valid_arguments(stand_in_model, entry) -> None:
    """Forced by name among the corpus' functions (a document: beside them)."""
    tool = _tool(entry)
    offered = TOOLS if entry in FUNCTIONS else [*TOOLS, tool]
    texts = finished_answers(*stand_in_model,
                             specs.forced_tool_call(offered, tool["function"]["name"]))
    assert texts
    for text in texts:
        assert json.loads(text)["name"] == tool["function"]["name"]
        _calls(text, [tool])


@pytest.mark.parametrize("entry", PARAMETERS, ids=lambda e: e["id"])
def test_required_calls_the_offered_function_with_valid_arguments(stand_in_model,
                                                                  entry) -> None:
    tools = [_tool(entry)]
    texts = finished_answers(*stand_in_model, specs.forced_tool_call(tools, None))
    assert texts, f"{entry['id']}: no call finished within 1200 tokens"
    for text in texts:
        _calls(text, tools)


#: two functions as pydantic writes nested models: each its own "#/$defs/Item", different
PYDANTIC = [{"type": "function", "function": {"name": name, "parameters": {
    "$defs": {"Item": item}, "type": "object", "required": ["items"],
    "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}}}}}
    for name, item in (("order", {"type": "object", "required": ["sku"], "additionalProperties":
                                  False, "properties": {"sku": {"type": "string"}}}),
                       ("count", {"type": "integer", "minimum": 3}))]


def test_functions_with_their_own_defs_are_called_each_with_its_own(stand_in_model) -> None:
    """A pointer in a function's parameters is its own document's, not the call's: two
    functions each with a $defs entry of one name keep them apart (required and named)."""
    for choice in (None, "order", "count"):
        texts = finished_answers(*stand_in_model, specs.forced_tool_call(PYDANTIC, choice),
                                 seeds=(0, 1, 2))
        assert texts
        for text in texts:
            _calls(text, PYDANTIC)
            assert choice in (None, json.loads(text)["name"])
