"""The native request contract: parsing and validation, one request at a time.

Every rejection is a RequestError naming the field and the allowed values, so the
handler can answer that request alone with HTTP 400 and serve the rest of the batch.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from handlers.backends.base import SamplingParams
from handlers.config import MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS, HandlerConfig
from handlers.errors import RequestError

#: prompts longer than handler.max_length x this many characters are refused before
#: tokenizing: tokenizing runs on the event loop every stream of the worker shares, and a
#: 6 MB prompt (just under TorchServe's default max_request_size) took ~13 s with the demo
#: tokenizer on a busy 2-core machine. Generous: the demo tokenizer's longest token has 7.
MAX_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    max_new_tokens: int
    min_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    stream_format: str  # text | ndjson
    details: bool = False  # add the generated token ids to the final answer
    timeout_s: float | None = None  # deadline, seconds from arrival; None = none
    #: the client asked for more than handler.max_new_tokens_limit, which reads as "as many
    #: as you allow": capped at the limit, and at the room the prompt leaves (fit_to_context)
    up_to_limit: bool = False


FIELDS = ("prompt", "max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "stop",
          "seed", "stream", "stream_format", "details", "timeout")
#: other names of FIELDS: what TorchServe's LLM examples send (its vLLM handler hands the body
#: to vLLM's SamplingParams, whose name `max_tokens` is)
ALIASES = {"max_tokens": "max_new_tokens"}
#: the sampling ranges a request may ask for (docs/request-api.md states them)
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1_000_000
#: the largest token budget a request may name (OpenAI's integer range); anything above the
#: server's limit is capped to it, not refused
MAX_REQUESTED_TOKENS = 2**31 - 1


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
    one (e.g. messages[0].content). Iterative: a body may nest ~1000 levels deep."""
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
    return body


_SURROGATE = re.compile("[\ud800-\udfff]")


def _int(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"expected an integer in [{lo}, {hi}], got {brief(value)}")
    if not lo <= value <= hi:
        raise RequestError(name, f"{value} is out of range; allowed [{lo}, {hi}]")
    return value


def bounded_float(body: dict, name: str, default: float, lo: float, hi: float,
                  lo_open: bool = False) -> float:
    """body[name] (else default) as a float in [lo, hi] ((lo, hi] with lo_open); a 400 naming
    the field otherwise."""
    value = body.get(name, default)
    rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(name, f"expected a number in {rng}, got {brief(value)}")
    if value < lo or value > hi or (lo_open and value == lo):
        raise RequestError(name, f"{value} is out of range; allowed {rng}")
    return float(value)


def _stop(body: dict, default: list[str]) -> tuple[str, ...]:
    value = body.get("stop", default)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise RequestError("stop", "expected a non-empty string or a list of non-empty strings")
    if len(value) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"{len(value)} stop strings; at most {MAX_STOP_STRINGS}")
    if max(map(len, value), default=0) > MAX_STOP_CHARS:
        raise RequestError("stop", f"a stop string of {max(map(len, value))} characters; at "
                           f"most {MAX_STOP_CHARS}")
    return tuple(value)


def _timeout(body: dict, config: HandlerConfig) -> float | None:
    """`timeout`: seconds after which generation stops (finish_reason "timeout")."""
    cap = config.max_request_timeout_s
    if "timeout" not in body:
        return config.request_timeout_s or None
    value = body["timeout"]
    rng = f"(0, {cap:g}] (handler.max_request_timeout_s)" if cap else "(0, inf)"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError("timeout", f"expected a number of seconds in {rng}, got {brief(value)}")
    if value <= 0 or (cap and value > cap):
        raise RequestError("timeout", f"{value} is out of range; allowed {rng}")
    return float(value)


def _max_name(body: dict[str, Any]) -> str:
    """Which name carries the token budget: `max_new_tokens`, or its alias `max_tokens`; both
    with different values is a 400 naming both."""
    if "max_tokens" not in body:
        return "max_new_tokens"
    if "max_new_tokens" not in body:
        return "max_tokens"
    if body["max_tokens"] != body["max_new_tokens"] or type(body["max_tokens"]) is not type(
            body["max_new_tokens"]):
        raise RequestError("max_tokens", f"max_tokens {brief(body['max_tokens'])} and "
                           f"max_new_tokens {brief(body['max_new_tokens'])} differ; max_tokens is "
                           "an alias of "
                           "max_new_tokens, so send one of them")
    return "max_new_tokens"


def default_stream_format(body: dict[str, Any], configured: str) -> str:
    """The framing of a request that names no `stream_format`: NDJSON (one JSON object per
    chunk) for the dialect of TorchServe's LLM examples, whose clients send `max_tokens` and
    json.loads every chunk they read (examples/large_models/utils/
    test_llm_streaming_response.py); else the configured one (raw text, for `curl -N`)."""
    return "ndjson" if "max_tokens" in body else configured


def parse_request(body: dict[str, Any], config: HandlerConfig,
                  extra_fields: tuple[str, ...] = ()) -> GenerationRequest:
    """Validate a decoded body against the configured defaults and limits."""
    for key in body:
        if key not in FIELDS and key not in ALIASES and key not in extra_fields:
            raise RequestError(str(key), f"unknown field{closest_hint(key, FIELDS)} "
                               f"(valid: {', '.join(FIELDS)})")
    d = config.defaults
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("prompt", "expected a non-empty string")
    if len(prompt) > config.max_length * MAX_CHARS_PER_TOKEN:
        raise RequestError("prompt", f"{len(prompt)} characters; at most {config.max_length} "
                           f"tokens fit (handler.max_length), and prompts over "
                           f"{config.max_length * MAX_CHARS_PER_TOKEN} characters are refused "
                           "untokenized")
    asked = _int(body, _max_name(body), d.max_new_tokens, 1, MAX_REQUESTED_TOKENS)
    max_new = min(asked, config.max_new_tokens_limit)
    min_new = _int(body, "min_new_tokens", min(d.min_new_tokens, max_new), 0, max_new)
    seed = body.get("seed", d.seed)
    if seed is not None:
        seed = _int(body, "seed", seed, 0, MAX_SEED)
    sampling = SamplingParams(
        temperature=bounded_float(body, "temperature", d.temperature, 0.0, MAX_TEMPERATURE),
        top_k=_int(body, "top_k", d.top_k, 0, MAX_TOP_K),
        top_p=bounded_float(body, "top_p", d.top_p, 0.0, 1.0, lo_open=True),
        seed=seed,
        min_new_tokens=min_new,
    )  # what the backend can honour is checked by the API (backends/capabilities.py)
    stream = body.get("stream", d.stream)
    if not isinstance(stream, bool):
        raise RequestError("stream", f"expected true or false, got {brief(stream)}")
    fmt = body.get("stream_format", default_stream_format(body, d.stream_format))
    if fmt not in ("text", "ndjson"):
        raise RequestError("stream_format",
                           f"{brief(fmt)} is not allowed; choose 'text' or 'ndjson'")
    details = body.get("details", d.details)
    if not isinstance(details, bool):
        raise RequestError("details", f"expected true or false, got {brief(details)}")
    return GenerationRequest(prompt=prompt, max_new_tokens=max_new, min_new_tokens=min_new,
                             sampling=sampling, stop=_stop(body, d.stop), stream=stream,
                             stream_format=fmt, details=details,
                             timeout_s=_timeout(body, config),
                             up_to_limit=asked > config.max_new_tokens_limit)


def fit_to_context(request: GenerationRequest, prompt_tokens: int, max_length: int,
                   max_prompt_length: int | None = None) -> GenerationRequest:
    """The request as it will run: a budget asked above the server's limit also shrinks to
    the room the prompt leaves (a chat UI's `max_tokens: 1000` title request on a small
    model), while a budget within the limit that does not fit is a 400 naming it, as vLLM
    answers; a prompt that does not fit is a 400 either way."""
    if request.up_to_limit:
        room = max_length - prompt_tokens
        if 1 <= room < request.max_new_tokens:
            request = replace(request, max_new_tokens=room,
                              min_new_tokens=min(request.min_new_tokens, room),
                              sampling=replace(request.sampling, min_new_tokens=min(
                                  request.sampling.min_new_tokens, room)))
    check_length(prompt_tokens, request.max_new_tokens, max_length, max_prompt_length)
    return request


def check_length(prompt_tokens: int, max_new_tokens: int, max_length: int,
                 max_prompt_length: int | None = None) -> None:
    """Reject prompts that cannot fit the compiled/configured context."""
    limit = min(max_length - 1, max_prompt_length or max_length)
    if prompt_tokens > limit:
        raise RequestError("prompt", f"{prompt_tokens} tokens; at most {limit} fit (max_length "
                           f"{max_length}, longest prefill {limit})")
    if prompt_tokens + max_new_tokens > max_length:
        raise RequestError("max_new_tokens", f"{max_new_tokens} with a {prompt_tokens}-token "
                           f"prompt exceeds max_length {max_length}; allowed [1, "
                           f"{max_length - prompt_tokens}]")
