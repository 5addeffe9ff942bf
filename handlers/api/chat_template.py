"""Chat messages -> prompt text, rendered by transformers' own Jinja engine.

Which template: `handler.chat_template` when set (a preset name, inline Jinja, or a
file in the checkpoint directory, which is what gets packaged), else the
tokenizer's own. Presets are data looked up by exact name (handlers/presets/). The
rendered prompt is tokenized without a second BOS when the template already wrote one.

Whose fault a failed render is: a template that refuses the messages on purpose
(`raise_exception`, e.g. "roles must alternate") answers the client 400 on `messages`;
any other failure (a Jinja syntax error, an undefined name, a filter raising) is the
served template's, a 500 that names it, as the client can change nothing to get past it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handlers.api.reasoning import Start, start_of, teaches_thinking
from handlers.errors import RequestError
from handlers.presets.chat_templates import LLAMA2_CHAT as LLAMA2_CHAT  # re-exported
from handlers.presets.chat_templates import LLAMA3_CHAT as LLAMA3_CHAT  # re-exported
from handlers.presets.chat_templates import NO_TEMPLATE_FIX, PRESETS, is_inline

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=16)
def resolve_template(setting: str, checkpoint_dir: str) -> str:
    """The configured template's Jinja source; '' when none is configured.

    Raises FileNotFoundError naming the choices when `setting` is neither a preset,
    inline Jinja, nor an existing file.
    """
    if not setting:
        return ""
    if setting in PRESETS:
        return PRESETS[setting]
    if is_inline(setting):
        return setting
    path = Path(setting) if Path(setting).is_absolute() else Path(checkpoint_dir) / setting
    if not path.is_file():
        raise FileNotFoundError(
            f"handler.chat_template: {setting!r} is not a preset ({', '.join(PRESETS)}), inline "
            f"Jinja, or a file (looked for {path}); put the file in the checkpoint directory")
    return path.read_text(encoding="utf-8")


def template_for(tokenizer: Any, setting: str) -> str:
    """The Jinja source to render with: the configured one, else the tokenizer's."""
    try:
        configured = resolve_template(setting, str(getattr(tokenizer, "name_or_path", "") or "."))
    except FileNotFoundError as exc:
        raise RequestError("messages", str(exc), status=500) from exc
    template = configured or getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: use the default one
        template = template.get("default", "")
    if not template:  # the client's choice of endpoint, not a server fault: 400
        raise RequestError("messages", "no chat template: this model answers "
                           f"/v1/chat/completions with 400; {NO_TEMPLATE_FIX}")
    return template


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], setting: str = "",
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: Mapping[str, Any] | None = None) -> str:
    """Apply the chat template (with `tools` when given, and any extra template variables);
    a template's raise_exception becomes a 400 on `messages`, any other failure a 500
    naming the template."""
    return _render(tokenizer, template_for(tokenizer, setting), messages, setting, tools,
                   template_kwargs)


def _render(tokenizer: Any, template: str, messages: Sequence[dict[str, Any]], setting: str,
            tools: list[dict[str, Any]] | None,
            template_kwargs: Mapping[str, Any] | None) -> str:
    extra = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(list(messages), chat_template=template,
                                             tokenize=False, add_generation_prompt=True,
                                             **(template_kwargs or {}), **extra)
    except Exception as exc:
        raise template_error(exc, setting) from exc
    if not isinstance(text, str):  # defensive: some versions return a list for one chat
        text = text[0]
    return text


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat: its text, its token ids, and where the answer starts when the
    template teaches thinking (handlers/api/reasoning.py; None: the answer is all content)."""

    text: str
    ids: list[int]
    reasoning: Start | None


def chat_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]], setting: str = "",
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: Mapping[str, Any] | None = None) -> ChatPrompt:
    """A chat's prompt (rendered as render_chat does, then encode_chat), and how its answer
    is read: a template that writes `</think>` teaches thinking, and the prompt's end says
    where the answer starts."""
    template = template_for(tokenizer, setting)
    text = _render(tokenizer, template, messages, setting, tools, template_kwargs)
    return ChatPrompt(text, encode_chat(tokenizer, text),
                      start_of(text) if teaches_thinking(template) else None)


def template_error(exc: Exception, setting: str) -> RequestError:
    """A failed render as the client's fault or the server's. transformers' raise_exception
    raises jinja2's base TemplateError itself (transformers@v4.36.2:src/transformers/
    tokenization_utils_base.py:1774-1775, @v4.48.3 and 5.x: utils/chat_template_utils.py,
    `raise_exception`); Jinja's own errors are subclasses of it (TemplateSyntaxError,
    UndefinedError, ...), and anything else a template raises is not the client's either."""
    from jinja2.exceptions import TemplateError

    if type(exc) is TemplateError:
        return RequestError("messages", f"chat template rejected the messages: {exc}")
    message = (f"the model's chat template failed: {type(exc).__name__}: {exc} "
               f"({template_name(setting)}); the server's template is at fault, not the "
               "request")
    logger.error("%s", message)
    return RequestError("", message, status=500)


def template_name(setting: str) -> str:
    """Which template a message names: the configured one, or the tokenizer's own."""
    if not setting:
        return "the tokenizer's chat_template, from tokenizer_config.json"
    if setting in PRESETS:
        return f"handler.chat_template preset {setting!r}"
    if is_inline(setting):
        return "handler.chat_template, inline Jinja"
    return f"handler.chat_template file {setting!r}"


#: the tool the template probe renders; no real tool is called this
PROBE_NAME = "inf2serve_probe_tool_7f3a"
PROBE_TOOLS = [{"type": "function", "function": {
    "name": PROBE_NAME, "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}]


@dataclass(frozen=True)
class ToolFormat:
    """What a chat template does with tools: whether it shows them in the prompt, and what
    it writes for an assistant turn that calls one (how the model will write its calls)."""

    takes_tools: bool = False
    probe_call: str = ""


def tool_format(tokenizer: Any, setting: str = "") -> ToolFormat:
    """Both probes of the template's tool format at once (each rendered once per template):
    a request with tools asks this once."""
    try:
        template = template_for(tokenizer, setting)
    except RequestError:
        return ToolFormat()
    try:
        if not _takes_tools(tokenizer, template):
            return ToolFormat()
    except Exception as exc:  # a template that does not compile: the server's fault
        raise template_error(exc, setting) from exc
    return ToolFormat(True, _rendered_probe_call(tokenizer, template))


def takes_tools(tokenizer: Any, setting: str = "") -> bool:
    """Whether the chat template has a tool format: a probe tool's name shows up in the
    prompt it renders (transformers before 4.42 passes no tools to templates: False)."""
    return tool_format(tokenizer, setting).takes_tools


@functools.lru_cache(maxsize=16)
def _takes_tools(tokenizer: Any, template: str) -> bool:
    """Once per tokenizer and template: a render is ~1 ms, too much for every request."""
    from jinja2.exceptions import TemplateError, TemplateSyntaxError

    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             chat_template=template, tokenize=False,
                                             add_generation_prompt=True, tools=PROBE_TOOLS)
    except TemplateSyntaxError:
        raise  # no render works: takes_tools says so as render_chat would
    except (TemplateError, TypeError, ValueError):
        return False
    return PROBE_NAME in (text if isinstance(text, str) else str(text))


#: an assistant turn calling the probe tool, in Hugging Face's shape (arguments an object);
#: the id is 9 alphanumerics, as Mistral's templates demand of every call id
PROBE_CALL = {"role": "assistant", "content": "", "tool_calls": [{
    "id": "inf2probe", "type": "function",
    "function": {"name": PROBE_NAME, "arguments": {}}}]}


def rendered_probe_call(tokenizer: Any, setting: str = "") -> str:
    """What the chat template writes for an assistant turn that calls the probe tool: the
    tool-call format the template teaches, read by handlers/api/tool_parsers.parser_for ("" when
    the template cannot render a call)."""
    try:
        template = template_for(tokenizer, setting)
    except RequestError:
        return ""
    return _rendered_probe_call(tokenizer, template)


@functools.lru_cache(maxsize=16)
def _rendered_probe_call(tokenizer: Any, template: str) -> str:
    """Once per tokenizer and template: the conversation with the call, less the one
    without it."""
    from jinja2.exceptions import TemplateError

    ask = [{"role": "user", "content": "hi"}]
    try:
        texts = [tokenizer.apply_chat_template(messages, chat_template=template,
                                               tokenize=False, tools=PROBE_TOOLS)
                 for messages in (ask, [*ask, PROBE_CALL])]
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError):
        return ""
    before, after = (t if isinstance(t, str) else str(t) for t in texts)
    return after[len(before):] if after.startswith(before) else after


def encode_chat(tokenizer: Any, text: str) -> list[int]:
    """Token ids for a rendered chat prompt, with exactly one BOS at most."""
    bos = getattr(tokenizer, "bos_token", None)
    has_bos = bool(bos) and text.startswith(bos)
    return list(tokenizer(text, add_special_tokens=not has_bos)["input_ids"])
