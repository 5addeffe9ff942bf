"""A thinking model's reasoning, read out of its answer: `<think>...</think>` becomes
`reasoning_content`.

Qwen3 (and QwQ, DeepSeek-R1-Distill-Qwen) think between `<think>` and `</think>` before
they answer. OpenAI-compatible servers return the thinking as `reasoning_content` beside
`content` -- `message.reasoning_content` whole, `delta.reasoning_content` streamed, and
under `reasoning` too (openai_framing.reasoning_fields) -- as vLLM's `qwen3` reasoning
parser does (vllm-project/vllm@693e2a4:vllm/reasoning/
qwen3_reasoning_parser.py `extract_reasoning`: the text before `</think>` is reasoning, the
rest content; basic_parsers.py `extract_reasoning_streaming` the same per delta), and Open
WebUI shows it folded above the answer.

Whether an answer is read so follows the chat template, as the tool-call format does, never
the checkpoint's config: a template that writes `</think>` teaches thinking (Qwen3's strips
old reasoning with it, DeepSeek-R1-Distill's too). Where the answer starts follows the end
of the rendered prompt:

- it ends with an open `<think>` (DeepSeek-R1-Distill's generation prompt, Qwen3's 2507
  thinking models): the answer starts inside reasoning, and only `</think>` comes;
- it ends with a closed block (Qwen3 with `enable_thinking: false` writes
  `<think>\\n\\n</think>\\n\\n`): no reasoning, all of the answer is content;
- else (Qwen3 thinking, its default): reasoning only if the answer opens with `<think>`.

Inside reasoning, the text up to the first `</think>` is reasoning and the rest content; an
answer cut short before `</think>` is all reasoning (vLLM's later qwen3 parser reads a
truncated answer so). Text is kept as the model wrote it, blanks included, as vLLM keeps
it. One class reads both streamed and whole answers, so they read the same: a streamed
piece that may be the start of a marker waits for the text after it. Nothing here raises
on any text.
"""

from __future__ import annotations

from typing import Literal

THINK, END = "<think>", "</think>"
#: where an answer starts: inside reasoning, after an optional <think> (auto), in content
Start = Literal["inside", "auto", "off"]
REASONING, CONTENT = "reasoning", "content"
Piece = tuple[str, str]  # (REASONING or CONTENT, text)


def teaches_thinking(template: str) -> bool:
    return END in template


def start_of(prompt: str) -> Start:
    """Where the answer to a rendered prompt starts (the prompt's end decides)."""
    tail = prompt.rstrip()
    if tail.endswith(END):
        return "off"
    if tail.endswith(THINK):
        return "inside"
    return "auto"


class ReasoningSplitter:
    """One answer's text, as it arrives, into reasoning and content pieces."""

    def __init__(self, start: Start) -> None:
        #: "opening" (before the answer shows whether it thinks), "reasoning", "content"
        self.state = "content" if start == "off" else "opening"
        self.inside = start == "inside"  # an answer that does not open <think> still thinks
        self.held = ""
        self.reasoned = False  # reasoning began (reasoning_content is not null)

    def feed(self, text: str) -> list[Piece]:
        if self.state == "content":
            return [(CONTENT, text)] if text else []
        if self.state == "reasoning":
            return self._reason(text)
        self.held += text
        body = self.held.lstrip()
        if body.startswith(THINK):
            self.held = ""
            return self._enter(body[len(THINK):])
        if THINK.startswith(body):  # blanks, or a start of <think>: undecided
            return []
        held, self.held = self.held, ""
        if self.inside:
            return self._enter(held)
        self.state = "content"
        return [(CONTENT, held)]

    def flush(self) -> list[Piece]:
        """The text still held, at the answer's end."""
        held, self.held = self.held, ""
        if self.state == "opening":
            if not self.inside:
                self.state = "content"
                return [(CONTENT, held)] if held else []
            self.state, self.reasoned = "reasoning", True
        return [(REASONING if self.state == "reasoning" else CONTENT, held)] if held else []

    def _enter(self, text: str) -> list[Piece]:
        self.state, self.reasoned = "reasoning", True
        return self._reason(text)

    def _reason(self, text: str) -> list[Piece]:
        text = self.held + text
        self.held = ""
        end = text.find(END)
        if end >= 0:
            self.state = "content"
            pieces = [(REASONING, text[:end]), (CONTENT, text[end + len(END):])]
            return [p for p in pieces if p[1]]
        keep = _partial_suffix(text, END)
        self.held = text[len(text) - keep:] if keep else ""
        text = text[:len(text) - keep]
        return [(REASONING, text)] if text else []


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def split(text: str, start: Start) -> tuple[str | None, str]:
    """A whole answer: (reasoning, or None when it did not think; content)."""
    splitter = ReasoningSplitter(start)
    pieces = splitter.feed(text) + splitter.flush()
    reasoning = "".join(t for kind, t in pieces if kind == REASONING)
    return (reasoning if splitter.reasoned else None,
            "".join(t for kind, t in pieces if kind == CONTENT))
