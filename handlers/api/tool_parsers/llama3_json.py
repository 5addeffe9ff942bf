"""Llama 3.1+'s JSON tool calls, read as vLLM's `llama3_json` parser reads them.

The model answers, after an optional `<|python_tag|>`, with one or more JSON objects
`{"name": ..., "parameters": {...}}` (or `"arguments"`) separated by `;`
(vllm-project/vllm@02de3de:vllm/entrypoints/openai/tool_parsers/llama_tool_parser.py:
35-100). Where vLLM's regex takes calls out of surrounding text, this reads the answer
whole: a call followed by prose, a number or a list is not a call, and comes back as the
content the model wrote.
"""

from __future__ import annotations

import json

from handlers.api.tool_parsers.base import Call, ToolParser, call_of, undecided
from handlers.structured.spec import ToolCallFormat

#: the token Llama 3.1 writes before a tool call (vLLM's parser strips it too)
PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    #: `{"name": ..., "parameters": {...}}`, several joined by "; " (Llama 3.1's template
    #: writes each call so; `parse` reads them back)
    grammar = ToolCallFormat(name_key="name", args_key="parameters", separator="; ")

    @classmethod
    def speaks(cls, rendered_call: str) -> bool:
        """Any template that renders tools: the fallback format, listed last."""
        return True

    def parse(self, text: str) -> list[Call] | None:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return None
        decoder = json.JSONDecoder()
        calls: list[Call] = []
        at = 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except ValueError:  # cut short, or not JSON
                return None
            call = call_of(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            while at < len(body) and body[at] in _SEPARATORS:
                at += 1
        return calls or None

    def may_open(self, text: str) -> bool | None:
        body = text.lstrip()
        if undecided(body, PYTHON_TAG):
            return None
        return body.startswith(("{", PYTHON_TAG))

