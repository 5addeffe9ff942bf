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


def json_schema_answer(client, model: str, schema: dict, prompt: str, stream: bool,
                       **params) -> tuple[str, str]:
    """(finish_reason, text) of one chat answer under `schema` as a strict json_schema
    response_format, through the `openai` client `client`: whole, or streamed as
    `inf2serve chat` reads it (one finish_reason over the chunks)."""
    response_format = {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": schema, "strict": True}}
    ask = [{"role": "user", "content": prompt}]
    if not stream:
        answer = client.chat.completions.create(model=model, messages=ask,
                                                response_format=response_format, **params)
        return answer.choices[0].finish_reason, answer.choices[0].message.content
    text, reasons = "", []
    for chunk in client.chat.completions.create(model=model, messages=ask, stream=True,
                                                response_format=response_format, **params):
        text += chunk.choices[0].delta.content or ""
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    (reason,) = reasons
    return reason, text


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


def stand_in(hf_tokenizer):
    """(compiler, (masks, bias, eos ids)) over the tokenizer's vocabulary plus 6 ids past
    it, as a model's padded head has: what the grammar tests run against."""
    from handlers.structured.compiler import GrammarCompiler, grammar_tokenizer
    from handlers.structured.masks import MaskBatch

    vocab = hf_tokenizer.vocab_size + 6
    eos = [hf_tokenizer.eos_token_id]
    compiler = GrammarCompiler(lambda: grammar_tokenizer(hf_tokenizer, vocab, eos))
    return compiler, (MaskBatch(4, vocab), token_bias(compiler.tokenizer(), vocab), eos)


def finished_answers(compiler, model, spec, seeds=(0,)) -> list[str]:
    """The text of each seed's answer that finished (EOS, or the grammar complete)."""
    from handlers.structured.masks import RowGrammar

    masks, bias, eos = model
    compiled = compiler.compile(spec)
    texts = []
    for seed in seeds:
        grammar = RowGrammar(compiled.matcher())
        tokens, finished = walk(grammar, masks, bias, eos, np.random.default_rng(seed))
        if finished:
            texts.append(compiler.tokenizer().decode_str(tokens))
    return texts


def schema_spec(schema: dict, strict: bool = True):
    from handlers.structured import spec

    return spec.response_format({"type": "json_schema", "json_schema": {
        "name": "s", "schema": schema, "strict": strict}})


def corpus_tools() -> tuple[list[dict], list[dict]]:
    """(the corpus' function entries, the same as an OpenAI `tools` list)."""
    functions = [e for e in corpus()["schemas"] if e["kind"] == "function"]
    return functions, [{"type": "function", "function": {"name": e["name"],
                                                         "parameters": e["schema"]}}
                       for e in functions]
