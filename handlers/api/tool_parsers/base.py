"""What a tool-call format is to the server: one small class per format.

A model calls tools in the format its chat template teaches it (Llama 3.1's bare JSON,
Qwen's `<tool_call>` tags, Mistral's `[TOOL_CALLS]` list...). Each format is a subclass of
`ToolParser` with four jobs: say whether a template speaks it (from how the template
renders a probe call), read the calls out of a whole answer, tell a streamed answer's
beginning from prose early enough that prose flows without delay, and write calls the way
the model does (`render`: the one statement of the format, from which a grammar that forces
a call is built, and which `parse` reads back). Nothing here frames OpenAI objects or
checks the request's tools: `ToolCallReader` (the package's __init__) does both, around any
format, and turns every failure into "not a call".
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from handlers.structured.spec import ToolCallFormat


@dataclass(frozen=True)
class Call:
    """One call as the model wrote it: the function's name and its arguments object."""

    name: str
    arguments: dict[str, Any]


class ToolParser(ABC):
    """One tool-call format. Subclasses are stateless; `parse` and `may_open` may raise on
    odd text (the reader catches it), but should simply answer None / False."""

    #: the format's name, as vLLM's `--tool-call-parser` spells it where it has one
    name: ClassVar[str]
    #: how the calls are written, each one JSON object: `tool_choice` "required" or a named
    #: function forces calls in this shape (handlers/structured/compiler.tool_call_lark);
    #: None for a format that is not (it overrides `render`, and forcing is refused)
    grammar: ClassVar[ToolCallFormat | None] = None

    @classmethod
    @abstractmethod
    def speaks(cls, rendered_call: str) -> bool:
        """Whether a chat template that rendered the probe call (an assistant turn calling
        the probe tool) as `rendered_call` teaches this format."""

    @abstractmethod
    def parse(self, text: str) -> list[Call] | None:
        """The calls, when the whole answer is calls in this format (blanks around them
        aside); None for anything else, which the client then gets as plain content."""

    @abstractmethod
    def may_open(self, text: str) -> bool | None:
        """Streamed text so far: True while it could still be calls (held back), False once
        it cannot (it flows as content), None while nothing decides yet (blanks)."""

    def render(self, calls: Sequence[Call]) -> str:
        """The answer text of a model calling `calls` in this format."""
        if self.grammar is None:
            raise NotImplementedError(f"{type(self).__name__} writes no JSON shape; it "
                                      "overrides render")
        return self.grammar.render(calls)

    def call_id(self) -> str:
        """A new call's id, as the client gets it and sends it back with the tool's result
        (vLLM's ids; a format whose template checks ids writes its own)."""
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_of(obj: Any, args_keys: tuple[str, ...] = ("arguments",)) -> Call | None:
    """{"name": ..., <one of args_keys>: {...}} as a Call; None for any other value.
    Arguments sent as a JSON string (as OpenAI writes them) are read too; an object with
    two of the argument keys is refused (vLLM refuses "parameters" with "arguments")."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    present = [k for k in args_keys if k in obj]
    if len(present) != 1:
        return None
    arguments = obj[present[0]]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(obj["name"], arguments)


def skip_blanks(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def undecided(body: str, marker: str) -> bool:
    """Whether streamed `body` (blanks stripped) is empty or a start of `marker`: nothing
    tells a call from prose yet."""
    return not body or marker.startswith(body)
