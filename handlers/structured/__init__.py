"""Structured outputs: a request's JSON Schema, JSON object or forced tool call as a
grammar, and the per-step token masks that enforce it (spec -> compiler -> masks).

Below the engine and the backends, above nothing but handlers.errors: the API parses a
request's fields into a `GrammarSpec` (spec.py, no engine import), the engine process
compiles it once per (spec, tokenizer) off the step loop (compiler.py), and a backend that
samples on the host fills and applies the masks of its constrained rows (masks.py).
"""
