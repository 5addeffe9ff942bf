"""What a tool-call format is to the server: one small class per format.

A model calls tools in the format its chat template teaches it (Llama 3.1's bare JSON,
Qwen's `<tool_call>` tags, Mistral's `[TOOL_CALLS]` list...). Each format is a subclass of
`ToolParser` with three jobs: say whether a template speaks it (from how the template
renders a probe call), read the calls out of a whole answer, and tell a streamed answer's
beginning from prose early enough that prose flows without delay. Nothing here frames
OpenAI objects or checks the request's tools: `ToolCallReader` (the package's __init__)
does both, around any format, and turns every failure into "not a call".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
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
    #: how a grammar writes one call and joins several (`tool_choice` "required" or a named
    #: function forces calls in this shape: handlers/structured/compiler.tool_call_lark)
    grammar: ClassVar[ToolCallFormat]

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
