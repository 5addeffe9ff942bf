"""The client side of `inf2serve chat`: OpenAI base URLs, the token, models, streamed replies.

Kept apart from the page (archive_tools/chat_page.py, Gradio) and the command
(archive_tools/chat_cmd.py) so that each can be tested alone: everything here runs against
any OpenAI-compatible server, and the unit tests drive it against a local fake. The
`openai` client is imported inside the functions that use it, so importing this module
needs neither it nor Gradio (the 3.10 runtime check imports every module of the package).

What it sends: the conversation as OpenAI chat messages, so the model's own chat template
(applied by the server) formats it, streamed as server-sent events, each delta passed on as
it arrives. The token stays in this Python process; a token read from a key_file.json is
read again for every request, so after `inf2serve token` the next message goes through
without a restart.

Every failure becomes one readable message (`explain`): a refused token says how to get a
fresh one, a 4xx carries the server's own message, a 5xx points at the server's logs, a
refused connection or a timeout says so, and an error event inside a stream ends the reply
with that message; the client has timeouts, so nothing hangs.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from handlers.errors import Inf2ServeError

#: seconds to wait for a connection, and (DEFAULT_TIMEOUT_S) for each part of an answer
CONNECT_TIMEOUT_S = 5.0
DEFAULT_TIMEOUT_S = 120.0
#: the sampling defaults of the page: near-greedy, short enough for a chat turn
DEFAULT_TEMPERATURE = 0.3
DEFAULT_TOP_P = 0.9
DEFAULT_MAX_TOKENS = 256
#: the max-tokens slider's end when no model says how long its context is
UNKNOWN_MAX_TOKENS = 4096
#: an OpenAI base URL of a TorchServe archive: the model's name is in it
_PREDICTIONS = re.compile(r"/predictions/([^/]+)/[^/]+/v1/?$")
#: what TorchServe answers (400, its own shape) for a missing, wrong or expired token
_TOKEN_REFUSED = "InvalidKeyException"


class ChatError(Inf2ServeError):
    """`inf2serve chat` cannot start as asked (no server, a bad URL, a port in use)."""


class PageError(Exception):
    """A message for the page (the chat page shows it as an error)."""


@dataclass(frozen=True)
class Token:
    """Where the bearer token comes from: a value, or a key_file.json read per request.

    Read per request because TorchServe tokens expire and `inf2serve token` writes a new
    one to the same file; `fix` is what a refused token's message tells the user to do."""

    value: str | None = None
    key_file: Path | None = None
    run_dir: Path | None = None  # the run directory the key file belongs to, for the fix

    def get(self) -> str | None:
        if self.key_file is None:
            return self.value
        return read_key_file(self.key_file)

    @property
    def fix(self) -> str:
        if self.run_dir is not None:
            return (f"get a fresh one with `inf2serve token --run-dir {self.run_dir}`; this "
                    "page reads it on the next message")
        if self.key_file is not None:
            return (f"get a fresh one with `inf2serve token` (it rewrites {self.key_file}); "
                    "this page reads it on the next message")
        return ("restart `inf2serve chat` with a valid --token (a fresh one: `inf2serve "
                "token` on the server's host)")


def read_key_file(path: Path) -> str:
    """The "inference" key of a TorchServe key_file.json."""
    try:
        data = json.loads(Path(path).read_text("utf-8"))
        key = data["inference"]["key"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ChatError(f"cannot read the inference token from {path} ({exc}); pass "
                        "TorchServe's key_file.json, or --token") from exc
    if not isinstance(key, str) or not key:
        raise ChatError(f"{path} has an empty inference key; pass --token")
    return key


@dataclass(frozen=True)
class ServedModel:
    """One model the page offers: its id at one base URL, and its context if it says."""

    id: str
    base_url: str
    max_model_len: int | None = None

    def label(self, ambiguous: bool) -> str:
        return f"{self.id} @ {self.base_url}" if ambiguous else self.id


@dataclass(frozen=True)
class Sampling:
    """The page's sampling settings, as the OpenAI chat request carries them."""

    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    max_tokens: int = DEFAULT_MAX_TOKENS

    def body(self, model: ServedModel) -> dict[str, Any]:
        """Request fields, with max_tokens clamped to what the model says it holds."""
        limit = model.max_model_len or self.max_tokens
        return {"temperature": self.temperature, "top_p": self.top_p,
                "max_tokens": max(1, min(int(self.max_tokens), limit))}


@dataclass
class Listing:
    """Models found at the base URLs, and one message per base URL that failed."""

    models: list[ServedModel] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def labels(self) -> dict[str, ServedModel]:
        """Dropdown label -> model; a model id served at two base URLs names its URL."""
        ids = [m.id for m in self.models]
        return {m.label(ids.count(m.id) > 1): m for m in self.models}


def model_from_url(base_url: str) -> str | None:
    """The model's name in a TorchServe OpenAI base URL (/predictions/NAME/VERSION/v1)."""
    found = _PREDICTIONS.search(urlsplit(base_url).path)
    return found.group(1) if found else None


def _error_body(exc: Any) -> dict[str, Any]:
    body = getattr(exc, "body", None)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        body = body["error"]
    return body if isinstance(body, dict) else {}


def explain(exc: BaseException, base_url: str, token: Token,
            timeout_s: float = DEFAULT_TIMEOUT_S, midway: bool = False) -> str:
    """One message for the page: what went wrong and what to do, never a traceback.

    TorchServe refuses a missing, wrong or expired token with 400 InvalidKeyException (its
    own shape, not OpenAI's 401), so both read as a refused token; other 4xx carry the
    handler's OpenAI-shaped message (the field and its allowed range); 5xx and a stream
    cut short (`midway`: after part of the reply) mean the worker failed, which its log
    explains."""
    import openai

    logs = f" ({token.run_dir / 'logs' / 'model_log.log'})" if token.run_dir else ""
    if isinstance(exc, openai.APIStatusError):
        body = _error_body(exc)
        message = str(body.get("message") or exc.response.text.strip() or exc.message)
        status = exc.status_code
        if status in (401, 403) or body.get("type") == _TOKEN_REFUSED:
            return (f"the server refused the token ({status} {body.get('type') or 'Unauthorized'}"
                    f": expired, wrong or missing); {token.fix}")
        if status == 503:  # a full queue, or a model process being restarted
            return (f"the server is busy (503): {message}; send the message again in a "
                    "moment")
        if status >= 500:
            return (f"the server failed ({status}): {message}; its worker log says why{logs}, "
                    "and the next message is tried afresh")
        return f"the server refused the request ({status}): {message}"
    if isinstance(exc, openai.APITimeoutError):
        return (f"no answer from {base_url} within {timeout_s:g} s; the server may be busy or "
                "stuck (its logs say which); try again, or raise `inf2serve chat --timeout`")
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc
        if midway:
            return (f"the reply was cut short ({type(cause).__name__}): the server or its "
                    f"worker stopped; its log says why{logs}")
        return (f"cannot reach {base_url} ({type(cause).__name__}: {' '.join(str(cause).split())}"
                "); is the server running? (`inf2serve serve ...`, or check --url)")
    if isinstance(exc, openai.APIError):  # an error event inside the stream
        return f"the server ended the reply with an error: {exc.message}"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _content_text(content: Any) -> str:
    """A chat message's text: Gradio gives a string or a list of parts (text, files)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text") or "") if content.get("type", "text") == "text" else ""
    if isinstance(content, (list, tuple)):
        return "\n".join(t for t in (_content_text(part) for part in content) if t)
    return ""


def _field(message: Any, key: str) -> Any:
    """A key of a message, a dict or a gr.ChatMessage alike."""
    return message.get(key) if isinstance(message, dict) else getattr(message, key, None)


def to_messages(history: Sequence[Any], message: Any, system: str = "") -> list[dict[str, str]]:
    """The OpenAI messages of a turn: the system prompt (when set), the history as Gradio
    keeps it, the new message. Gradio's messages are role/content dicts with extra keys;
    one with a metadata title is a notice the page showed (an error), not something the
    model said, so it stays out."""
    out = [{"role": "system", "content": system}] if system.strip() else []
    for turn in history:
        role, metadata = _field(turn, "role"), _field(turn, "metadata")
        text = _content_text(_field(turn, "content"))
        if isinstance(metadata, dict) and metadata.get("title"):
            continue
        if role in ("user", "assistant") and text:
            out.append({"role": role, "content": text})
    out.append({"role": "user", "content": _content_text(message)})
    return out


class ChatBackend:
    """The page's link to the servers: lists their models and streams replies.

    One `openai.AsyncOpenAI` per request (its httpx pool closes with it), no retries (a
    retry would hide a refused token for seconds), a connect timeout of CONNECT_TIMEOUT_S
    and `timeout_s` for each read. A stream is read inside `async with`: when the page's
    stop button cancels the reply, the HTTP request is closed at once."""

    def __init__(self, base_urls: Sequence[str], token: Token,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.base_urls = list(base_urls)
        self.token = token
        self.timeout_s = timeout_s

    def _client(self, base_url: str) -> Any:
        import openai

        try:
            key = self.token.get()
        except ChatError as exc:
            raise PageError(str(exc)) from exc
        # the client insists on a key; a server without auth ignores this one
        return openai.AsyncOpenAI(base_url=base_url, api_key=key or "no-token", max_retries=0,
                                  timeout=openai.Timeout(self.timeout_s,
                                                         connect=CONNECT_TIMEOUT_S))

    async def _list_one(self, base_url: str) -> list[ServedModel]:
        async with self._client(base_url) as client:
            page = await client.models.list()
            return [ServedModel(m.id, base_url, _int_or_none(getattr(m, "max_model_len", None)))
                    for m in page.data]

    async def list_models(self) -> Listing:
        """Every base URL's models; a base URL that fails adds its message and, when its
        path names the model (TorchServe's /predictions/NAME/VERSION/v1), that model, so
        the page still offers it and shows the error again when it is used."""
        listing = Listing()
        answers = await asyncio.gather(*(self._list_one(u) for u in self.base_urls),
                                       return_exceptions=True)
        for base_url, answer in zip(self.base_urls, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, Exception):
                    raise answer
                listing.errors.append(f"{base_url}: {self.explain(answer, base_url)}")
                name = model_from_url(base_url)
                if name is not None:
                    listing.models.append(ServedModel(name, base_url))
            else:
                listing.models.extend(answer)
        return listing

    def explain(self, exc: BaseException, base_url: str, midway: bool = False) -> str:
        if isinstance(exc, PageError):
            return str(exc)
        return explain(exc, base_url, self.token, self.timeout_s, midway)

    async def stream(self, model: ServedModel, messages: list[dict[str, str]],
                     sampling: Sampling) -> AsyncIterator[str]:
        """The reply's text deltas as they arrive; any failure raises PageError with the
        message for the page (after the deltas that did arrive)."""
        midway = False
        try:
            async with self._client(model.base_url) as client:
                stream = await client.chat.completions.create(
                    model=model.id, messages=messages, stream=True, **sampling.body(model))
                async with stream:
                    async for chunk in stream:
                        midway = True
                        for choice in chunk.choices:
                            if choice.delta is not None and choice.delta.content:
                                yield choice.delta.content
        except PageError:
            raise
        except Exception as exc:
            raise PageError(self.explain(exc, model.base_url, midway)) from exc


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None
