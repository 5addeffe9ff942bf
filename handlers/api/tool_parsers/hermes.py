"""Qwen2.5's and Qwen3's tool calls (the Hermes format), read as vLLM's `hermes` parser reads
them.

Each call is a JSON object {"name": ..., "arguments": {...}} between `<tool_call>` and
`</tool_call>`; Qwen's templates write `<tool_call>\\n{...}\\n</tool_call>` for each call of
an assistant turn, joined by a newline (the chat_template of Qwen/Qwen2.5-7B-Instruct and
Qwen/Qwen3-8B). vLLM takes the calls out of anywhere in the answer with a regex that also
accepts a last call whose `</tool_call>` never came (vllm-project/vllm@836d1f3:vllm/
entrypoints/openai/tool_parsers/hermes_tool_parser.py, `tool_call_regex` and
`extract_tool_calls`). Here the answer is read whole, as for every format: calls with
nothing but blanks around them; the last one may lack its closing tag (a model that stops
at `<|im_end|>` right after the JSON), never its JSON.
"""

from __future__ import annotations

import json

from handlers.api.tool_parsers.base import (
    Call,
    ToolParser,
    call_of,
    skip_blanks,
    undecided,
)
from handlers.structured.spec import ToolCallFormat

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    grammar = ToolCallFormat(args_key="arguments", prefix=f"{OPEN}\n", suffix=f"\n{CLOSE}",
                             separator="\n")

    @classmethod
    def speaks(cls, rendered_call: str) -> bool:
        return OPEN in rendered_call and CLOSE in rendered_call

    def parse(self, text: str) -> list[Call] | None:
        body = text.strip()
        decoder = json.JSONDecoder()
        calls: list[Call] = []
        at = 0
        while at < len(body):
            if not body.startswith(OPEN, at):
                return None
            try:
                obj, at = decoder.raw_decode(body, skip_blanks(body, at + len(OPEN)))
            except ValueError:  # cut short, or not JSON
                return None
            call = call_of(obj)
            if call is None:
                return None
            calls.append(call)
            at = skip_blanks(body, at)
            if body.startswith(CLOSE, at):
                at = skip_blanks(body, at + len(CLOSE))
            elif at < len(body):  # only the last call may go unclosed
                return None
        return calls or None

    def may_open(self, text: str) -> bool | None:
        body = text.lstrip()
        if undecided(body, OPEN):
            return None
        return body.startswith(OPEN)
