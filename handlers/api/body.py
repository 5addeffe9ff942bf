"""A request body as TorchServe hands it over, read into one JSON object.

TorchServe's worker decodes application/json itself and hands over a dict, or another
JSON value, or the raw bytes when it cannot (ts/protocol/otf_message_handler.py:332-343);
text/* arrives as a str. Every API reads its body here first, so a malformed, non-UTF-8
or surrogate-laden body is refused the same way (a 400 naming `body` or the field)
before any field is read. Also the two helpers every error message uses.
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Any

from handlers.errors import RequestError


def brief(value: Any, limit: int = 60) -> str:
    """repr(value) for an error message, cut to `limit` characters: a message names the
    field and what is wrong, and never echoes a large value (a tools list, a long prompt)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def closest_hint(name: str, valid: tuple[str, ...]) -> str:
    """'; did you mean X?' for a misspelt field, or ''."""
    close = difflib.get_close_matches(str(name), valid, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def decode_body(data: Any, content_type: str = "", *,
                string_is_prompt: bool = False) -> dict[str, Any]:
    """TorchServe hands us a dict (JSON it decoded), a str (text/*, or a JSON string it
    decoded), another JSON value it decoded, or raw bytes.

    `string_is_prompt`: a body that is a JSON string (`"hello"`) is the prompt (the native
    API); otherwise it is refused with what to send instead."""
    if isinstance(data, dict):
        return check_text(data)
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError("body", f"not valid UTF-8 (byte {exc.start})") from exc
        if "json" in content_type or data.lstrip().startswith("{"):
            return _json_object(_json_value(data), string_is_prompt)
        return {"prompt": data}
    if isinstance(data, str):
        if "json" not in content_type:
            return {"prompt": data}
        if data.lstrip().startswith("{"):  # JSON text handed over undecoded
            return _json_object(_json_value(data), string_is_prompt)
        # TorchServe decodes application/json itself (otf_message_handler.py:332-336): a str
        # here is what the body was, a JSON string
        return _json_object(data, string_is_prompt)
    if data is None:
        if "form" in content_type:
            raise RequestError("body", f"{content_type} bodies are parsed as forms by "
                               "TorchServe; send -H 'Content-Type: application/json' (or "
                               "text/plain) with `curl -d`")
        raise RequestError("body", "empty request; send JSON {\"prompt\": ...} or plain text")
    return _json_object(data, string_is_prompt)  # a list, number or boolean TorchServe decoded


def _json_value(text: str) -> Any:
    """TorchServe's worker parses application/json itself and hands over the raw bytes when
    that fails (ts/protocol/otf_message_handler.py:332-343), e.g. on JSON nested too deeply
    for Python's recursion limit or an integer of more than 4300 digits: the same errors here
    are the client's, not ours."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError("body", f"malformed JSON: {exc.msg} at position {exc.pos}") from exc
    except RecursionError as exc:
        raise RequestError("body", "JSON nested too deeply; a request is a flat object") from exc
    except ValueError as exc:  # e.g. an integer beyond sys.get_int_max_str_digits()
        raise RequestError("body", f"unreadable JSON: {exc}") from exc


def _json_object(obj: Any, string_is_prompt: bool = False) -> dict[str, Any]:
    """A decoded body as a request object: a JSON string is the prompt where the API allows
    it; anything else but an object is refused saying what to send."""
    if isinstance(obj, str) and string_is_prompt:
        return check_text({"prompt": obj})
    if isinstance(obj, str):
        raise RequestError("body", "the body is a JSON string; send a JSON object, e.g. "
                           "{\"prompt\": \"...\"}")
    if not isinstance(obj, dict):
        kind = {list: "array", bool: "boolean", int: "number", float: "number"}.get(
            type(obj), type(obj).__name__)
        raise RequestError("body", f"expected a JSON object, got a JSON {kind}; send "
                           "{\"prompt\": \"...\"}" + (" or the prompt as a JSON string"
                                                    if string_is_prompt else ""))
    return check_text(obj)


def check_text(body: dict[str, Any]) -> dict[str, Any]:
    """Refuse lone UTF-16 surrogates ("\\ud800" in JSON decodes to one): no tokenizer takes
    them and no answer echoing them can be encoded as UTF-8. Names the first field holding
    one (e.g. messages[0].content). Iterative: a body may nest ~1000 levels deep. Every
    request pays for the walk, so it builds no field paths and skips ASCII text (an O(1)
    flag in CPython); only a body that holds a surrogate is walked again to name where."""
    stack: list[Any] = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                _name_surrogate(body)
        elif isinstance(value, dict):
            for key in value:
                if not key.isascii() and _SURROGATE.search(key):
                    _name_surrogate(body)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return body


def _name_surrogate(body: dict[str, Any]) -> None:
    """Raise the 400 naming the first field that holds a lone surrogate."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise RequestError(path or "body", "contains a lone UTF-16 surrogate (e.g. "
                                   "\\ud800 without its pair); send valid Unicode text")
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    raise RequestError(path or "body", "a key contains a lone UTF-16 surrogate")
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


_SURROGATE = re.compile("[\ud800-\udfff]")
