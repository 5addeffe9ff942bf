"""The chat template renders a probe conversation, as the worker will render every chat.

handlers/checkpoint_checks.py compiles each template the worker may read (in the worker
too); here, where the tokenizer is loaded anyway, the one the worker will use (the
configured one, else the tokenizer's) renders a short conversation the way chat requests
are rendered, so a template that compiles but fails on every conversation (an undefined
filter, a `raise_exception` on a plain user turn) is refused at packaging, naming it.
"""

from __future__ import annotations

from typing import Any

from handlers.errors import Inf2ServeError
from handlers.presets.chat_templates import PRESETS

#: what every chat template must take: user, assistant, user (system turns are optional in
#: many templates, alternation is required by most)
PROBE = ({"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
         {"role": "user", "content": "How are you?"})


def template_source_name(tokenizer: Any, setting: str) -> str:
    """Where the template the worker renders comes from, for messages."""
    if setting:
        return f"handler.chat_template {setting[:60]!r}"
    return f"the tokenizer's chat template ({getattr(tokenizer, 'name_or_path', '') or '.'})"


def check_chat_template(tokenizer: Any, setting: str) -> None:
    """Render PROBE with the template the worker will use; nothing to do without one (a
    warning says so elsewhere)."""
    from handlers.api.chat_template import render_chat
    from handlers.errors import RequestError

    if not setting and not getattr(tokenizer, "chat_template", None):
        return
    try:
        render_chat(tokenizer, [dict(m) for m in PROBE], setting)
    except Exception as exc:  # RequestError, or one of jinja2's several kinds
        message = exc.message if isinstance(exc, RequestError) else f"{type(exc).__name__}: {exc}"
        message = " ".join(message.split())
        if message.startswith("handler.chat_template"):
            raise Inf2ServeError(message) from exc
        raise Inf2ServeError(f"{template_source_name(tokenizer, setting)} does not render a "
                             f"user/assistant/user conversation: {message}; every chat request "
                             "would fail: fix the template, or set handler.chat_template "
                             f"({', '.join(PRESETS)})") from exc
