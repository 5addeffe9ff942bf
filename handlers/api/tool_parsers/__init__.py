"""Tool calls read back out of a model's answer, in the format its chat template teaches.

`parser_for` picks the format from how the template renders a probe call (chat_template.
rendered_probe_call), trying the formats in `PARSERS` in order, most specific first; a new
format is one module with one `ToolParser` subclass and one entry there. `ToolCallReader`
holds the chosen format and the names of the tools the prompt showed, and is the one way
the framers read calls: it never raises, and anything it cannot take whole as calls of
those tools -- malformed JSON, a call cut short, prose around a call, a function the
request did not offer -- is None, which the client gets as plain content (vLLM falls back
the same way: llama_tool_parser.py:92-100).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from handlers.api.tool_parsers.base import Call, ToolParser
from handlers.api.tool_parsers.hermes import HermesParser
from handlers.api.tool_parsers.llama3_json import Llama3JsonParser
from handlers.api.tool_parsers.mistral import MistralArgsParser, MistralParser

logger = logging.getLogger(__name__)

#: every format, most specific first: the first whose `speaks` accepts the template wins
PARSERS: tuple[type[ToolParser], ...] = (HermesParser, MistralArgsParser, MistralParser,
                                         Llama3JsonParser)


def parser_for(rendered_call: str) -> ToolParser:
    """The format of a template that renders tools, from its rendering of the probe call
    ("" when it could not render one: the fallback format)."""
    for parser in PARSERS:
        if parser.speaks(rendered_call):
            return parser()
    return Llama3JsonParser()


@dataclass(frozen=True)
class ToolCallReader:
    """One request's calls, read out of its answer: the template's format and the names of
    the tools its prompt showed."""

    parser: ToolParser
    names: frozenset[str]

    @classmethod
    def of(cls, parser: ToolParser, tools: Iterable[dict[str, Any]]) -> ToolCallReader:
        return cls(parser, frozenset(t["function"]["name"] for t in tools))

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI `tool_calls` when the whole answer is calls of the offered tools, else
        None. Never raises: a format's failure is a plain answer, not a failed request."""
        try:
            parsed = self.parser.parse(text)
            if not parsed or any(call.name not in self.names for call in parsed):
                return None
            return [openai_call(call, self.parser.call_id()) for call in parsed]
        except Exception:  # a parser's bug must not cost the client its answer
            logger.warning("the %s parser failed on an answer; sent as content",
                           self.parser.name, exc_info=True)
            return None

    def may_open(self, text: str) -> bool:
        """Streamed text so far: True while it could still be calls (or only blanks came),
        False once it is content."""
        try:
            return self.parser.may_open(text) is not False
        except Exception:
            logger.warning("the %s parser failed on streamed text; sent as content",
                           self.parser.name, exc_info=True)
            return False


def openai_call(call: Call, call_id: str) -> dict[str, Any]:
    """OpenAI's shape: arguments as a JSON string, an id for the tool's answer to name.
    Raises ValueError on NaN or Infinity, which JSON has no words for."""
    return {"id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(
                call.arguments, ensure_ascii=False, allow_nan=False)}}


__all__ = ["PARSERS", "Call", "ToolCallReader", "ToolParser", "openai_call",
           "parser_for"]
