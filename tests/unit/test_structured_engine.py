"""Structured outputs through the engine and a real model (the torch backend on the tiny
demo checkpoint): a request with a grammar waits for its compile outside the step loop,
then answers only what the grammar allows, ending with "stop" once it is complete; free
requests sharing its steps -- greedy and seeded sampled -- get exactly the tokens they get
alone; a schema that cannot compile ends its request with a 400 naming the field."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import pytest

from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from handlers.engine.core import Engine
from handlers.engine.scheduler import ErrorEvent, FinishEvent, Scheduler, Sequence
from handlers.engine.start import grammar_compiler
from handlers.structured import spec as specs

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                  "zip": {"type": "integer"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "address"], "additionalProperties": False}
FREE = [SamplingParams(), SamplingParams(temperature=0.9, top_k=50, seed=7),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3)]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from transformers import AutoTokenizer

    from handlers.backends.torch_backend import TorchBackend

    cfg = parse_config({"handler": {"batch_size": 8, "max_length": 256,
                                    "max_new_tokens_limit": 128}}).handler
    return TorchBackend(tiny_checkpoint, cfg), AutoTokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="module")
def compiler(model):
    """One compiler for the module (the tokenizer's conversion is the model's, done once)."""
    engine = Engine(model[0], Scheduler(model[0].batch_size, "continuous", 0))
    grammar_compiler(engine, model[1])  # as the engine process builds it at load
    yield engine.grammars.compiler
    engine.grammars.compiler.close()


def engine_of(model, compiler) -> Engine:
    backend, _ = model
    engine = Engine(backend, Scheduler(backend.batch_size, "continuous", 0))
    engine.use_grammars(compiler)
    return engine


def request(model, rid, prompt, params, events, n=40) -> Sequence:
    backend, tokenizer = model
    seq = Sequence(request_id=rid, prompt_ids=tokenizer(prompt)["input_ids"], max_new_tokens=n,
                   sampling=params, stop=(), tokenizer=tokenizer,
                   sink=events.setdefault(rid, []).append)
    return seq


def serve(engine: Engine, events: dict, want: int, timeout_s: float = 60) -> None:
    """Step until `want` requests ended (compiles land from other threads)."""
    deadline = time.monotonic() + timeout_s
    while sum(1 for ev in events.values() if ev and isinstance(
            ev[-1], (FinishEvent, ErrorEvent))) < want:
        assert time.monotonic() < deadline, events
        if engine.scheduler.has_work():
            engine.step()
        else:
            time.sleep(0.005)


def answers(events: dict) -> dict[str, FinishEvent]:
    return {rid: ev[-1] for rid, ev in events.items()}


def constrained(schema=SCHEMA, **params) -> SamplingParams:
    return SamplingParams(grammar=specs.response_format(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                "strict": True}}), **params)


def test_free_rows_beside_constrained_ones_get_exactly_their_tokens_alone(model,
                                                                          compiler) -> None:
    prompts = ["The sea", "Once upon a time", "Hello there, how are you"]
    alone: dict = {}
    engine = engine_of(model, compiler)
    for i, (prompt, p) in enumerate(zip(prompts, FREE, strict=True)):
        engine.submit(request(model, f"free{i}", prompt, p, alone))
        serve(engine, alone, i + 1)
    mixed: dict = {}
    engine = engine_of(model, compiler)
    held = [constrained(), constrained(temperature=0.8, top_p=0.95),
            SamplingParams(grammar=specs.response_format({"type": "json_object"}),
                           temperature=1.0, seed=5)]
    for i, p in enumerate(held):
        engine.submit(request(model, f"json{i}", "Describe a person", p, mixed, n=60))
    engine.step()  # the grammars compile meanwhile: the free rows may go first
    for i, (prompt, p) in enumerate(zip(prompts, FREE, strict=True)):
        engine.submit(request(model, f"free{i}", prompt, p, mixed))
    serve(engine, mixed, 6)
    got = answers(mixed)
    for rid, end in answers(alone).items():
        assert got[rid].token_ids == end.token_ids, rid
    for i in range(3):
        end = got[f"json{i}"]
        assert isinstance(end, FinishEvent), end
        if end.reason == "stop":
            value = json.loads(end.text)
            if i < 2:
                jsonschema.validate(value, SCHEMA)
            else:
                assert isinstance(value, dict)
        else:  # cut by its budget: still a prefix the grammar allowed
            assert end.reason == "length" and end.text.startswith("{")


def test_a_greedy_constrained_answer_is_the_masked_greedy_answer(model, compiler) -> None:
    """Token by token against the model's own logits masked by the same grammar."""
    import torch

    from handlers.structured.masks import RowGrammar, allowed, words

    backend, tokenizer = model
    events: dict = {}
    engine = engine_of(model, compiler)
    p = constrained()
    seq = request(model, "g", "Describe a person", p, events, n=60)
    engine.submit(seq)
    serve(engine, events, 1)
    got = list(answers(events)["g"].token_ids)

    import numpy as np

    vocab = backend.grammar_vocab()
    grammar = RowGrammar(compiler.compile(p.grammar).matcher())
    ids = list(seq.prompt_ids)
    want: list[int] = []
    bits = np.zeros(words(vocab), dtype=np.int32)
    for _ in range(len(got)):
        grammar.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.size * 4)
        with torch.no_grad():
            logits = backend.model(torch.tensor([ids])).logits[0, -1]
        ok = torch.from_numpy(allowed(bits, vocab))
        token = int(logits.masked_fill(~ok, float("-inf")).argmax())
        want.append(token)
        if token in backend.eos_token_ids:
            break
        grammar.accept([token])
        ids.append(token)
    assert got == want


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "properties": {"a": {"type": "string", "format": "ipv7"}}},
     "format"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}},
     "does not fetch"),
])
def test_a_schema_the_engine_cannot_compile_ends_its_request_with_a_400(model, compiler,
                                                                        schema, words) -> None:
    events: dict = {}
    engine = engine_of(model, compiler)
    engine.submit(request(model, "bad", "Hi", constrained(schema), events))
    serve(engine, events, 1)
    (end,) = events["bad"]
    assert isinstance(end, ErrorEvent) and end.status == 400
    assert end.field == "response_format.json_schema" and words in end.message.lower()


def test_a_request_cancelled_while_its_grammar_compiles_ends_with_499(model, compiler,
                                                                       monkeypatch) -> None:
    events: dict = {}
    engine = engine_of(model, compiler)
    gate = threading.Event()
    compile_ = engine.grammars.compiler._compile
    monkeypatch.setattr(engine.grammars.compiler, "_compile",
                        lambda spec: gate.wait(10) and compile_(spec))
    engine.submit(request(model, "c", "Hi", constrained({"type": "object", "properties": {
        "x": {"type": "integer"}}}), events))
    engine.cancel("c")
    gate.set()
    assert [type(e) for e in events["c"]] == [ErrorEvent] and events["c"][0].status == 499
    time.sleep(0.2)
    assert not engine.scheduler.has_work()  # the compile finished, and nothing was admitted
