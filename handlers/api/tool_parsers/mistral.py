"""Mistral's tool calls, read as vLLM's `mistral` parser reads them: two generations.

Mistral-7B-Instruct-v0.3 (and the v7 templates after it) answer `[TOOL_CALLS] [{"name":
..., "arguments": {...}}, ...]`: one JSON list of calls after the control token (its
chat_template writes an assistant turn's calls so; vllm-project/vllm@a5cdcfa:vllm/
entrypoints/openai/tool_parsers/mistral_tool_parser.py, `extract_tool_calls`, reads the
list after the token). The v11 tokenizers (Mistral-Small-3.2, Magistral, Devstral) write
each call as `[TOOL_CALLS]name[ARGS]{...}`, optionally `[CALL_ID]id` before `[ARGS]`
(vLLM's v11 parser, `fn_name_regex`). The template's probe call tells which: `[ARGS]` in it.

`[TOOL_CALLS]`, `[ARGS]` and `[CALL_ID]` are special tokens in Mistral's tokenizers, and
the engine decodes answers without special tokens (vLLM turns `skip_special_tokens` off
for this parser instead), so the answer may reach the parser without them: a bare JSON
list, or `name{...}`. Both are read -- still only when the whole answer is calls of the
offered tools, so prose never turns into a call. Mistral's templates refuse any call id
that is not 9 letters and digits (mistral-common's validator), so calls get such ids here,
as vLLM gives them (`MistralToolCall.generate_random_id`).
"""

from __future__ import annotations

import json
import re
import secrets
import string

from handlers.api.tool_parsers.base import (
    Call,
    ToolParser,
    call_of,
    skip_blanks,
    undecided,
)
from handlers.structured.spec import ToolCallFormat

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ALPHANUMERIC = string.ascii_letters + string.digits
#: OpenAI's function names (vLLM's v11 regex takes the same characters)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_ID = re.compile(r"[A-Za-z0-9]+")


class _MistralIds(ToolParser):
    def call_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


class MistralParser(_MistralIds):
    """`[TOOL_CALLS] [{...}, ...]` (v0.3 and v7 templates)."""

    name = "mistral"
    grammar = ToolCallFormat(args_key="arguments", start=f"{TOOL_CALLS} [", separator=", ",
                             end="]")

    @classmethod
    def speaks(cls, rendered_call: str) -> bool:
        return TOOL_CALLS in rendered_call and ARGS not in rendered_call

    def parse(self, text: str) -> list[Call] | None:
        body = text.strip()
        if body.startswith(TOOL_CALLS):
            body = body[len(TOOL_CALLS):].lstrip()
        if not body.startswith("["):
            return None
        try:
            items, at = json.JSONDecoder().raw_decode(body)
        except ValueError:  # cut short, or not JSON
            return None
        if at != len(body) or not isinstance(items, list):
            return None
        calls = [call_of(item) for item in items]
        if not calls or any(call is None for call in calls):
            return None
        return calls

    def may_open(self, text: str) -> bool | None:
        body = text.lstrip()
        if body.startswith(TOOL_CALLS):
            return True
        if undecided(body, TOOL_CALLS):  # also "[", which opens the bare list too
            return None
        if not body.startswith("["):
            return False
        rest = body[1:].lstrip()
        return not rest or rest.startswith("{")


class MistralArgsParser(_MistralIds):
    """`[TOOL_CALLS]name[ARGS]{...}` per call (v11 tokenizers' templates)."""

    name = "mistral"
    grammar = ToolCallFormat(prefix=TOOL_CALLS, args_marker=ARGS, separator="")

    @classmethod
    def speaks(cls, rendered_call: str) -> bool:
        return TOOL_CALLS in rendered_call and ARGS in rendered_call

    def parse(self, text: str) -> list[Call] | None:
        body = text.strip()
        decoder = json.JSONDecoder()
        calls: list[Call] = []
        at = 0
        while at < len(body):
            if body.startswith(TOOL_CALLS, at):
                at += len(TOOL_CALLS)
            name = _NAME.match(body, at)
            if name is None:
                return None
            at = name.end()
            if body.startswith(CALL_ID, at):
                call_id = _ID.match(body, at + len(CALL_ID))
                if call_id is None:
                    return None
                at = call_id.end()
            if body.startswith(ARGS, at):
                at += len(ARGS)
            if not body.startswith("{", at):
                return None
            try:
                arguments, at = decoder.raw_decode(body, at)
            except ValueError:  # cut short, or not JSON
                return None
            if not isinstance(arguments, dict):
                return None
            calls.append(Call(name.group(), arguments))
            at = skip_blanks(body, at)
        return calls or None

    def may_open(self, text: str) -> bool | None:
        body = text.lstrip()
        if body.startswith(TOOL_CALLS):
            return True
        if undecided(body, TOOL_CALLS):
            return None
        name = _NAME.match(body)  # the control tokens may be gone: name{...}
        if name is None:
            return False
        rest = body[name.end():]
        return (not rest or rest.startswith("{")
                or any(m.startswith(rest) or rest.startswith(m) for m in (ARGS, CALL_ID)))
