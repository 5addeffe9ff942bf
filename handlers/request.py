"""The native request contract: parsing and validation, one request at a time.

Every rejection is a RequestError naming the field and the allowed values, so the
handler can answer that request alone with HTTP 400 and serve the rest of the batch.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from typing import Any

from handlers.backends.base import SamplingParams
from handlers.config import HandlerConfig
from handlers.errors import RequestError

MAX_STOP_STRINGS = 8
MAX_SEED = 2**63 - 1


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


FIELDS = ("prompt", "max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "stop",
          "seed", "stream", "stream_format", "details")


def closest_hint(name: str, valid: tuple[str, ...]) -> str:
    """'; did you mean X?' for a misspelt field, or ''."""
    close = difflib.get_close_matches(str(name), valid, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def decode_body(data: Any, content_type: str = "") -> dict[str, Any]:
    """TorchServe hands us a dict (JSON it decoded), a str (text/*) or raw bytes."""
    if isinstance(data, dict):
        return data
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError("body", f"not valid UTF-8 (byte {exc.start})") from exc
        if "json" in content_type or data.lstrip().startswith("{"):
            return _json_object(data)
    if isinstance(data, str):
        if "json" in content_type:
            return _json_object(data)
        return {"prompt": data}
    if data is None:
        if "form" in content_type:
            raise RequestError("body", f"{content_type} bodies are parsed as forms by "
                               "TorchServe; send -H 'Content-Type: application/json' (or "
                               "text/plain) with `curl -d`")
        raise RequestError("body", "empty request; send JSON {\"prompt\": ...} or plain text")
    raise RequestError("body", f"expected a JSON object, got {type(data).__name__}")


def _json_object(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError("body", f"malformed JSON: {exc.msg} at position {exc.pos}") from exc
    if not isinstance(obj, dict):
        raise RequestError("body", f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _int(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"expected an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise RequestError(name, f"{value} is out of range; allowed [{lo}, {hi}]")
    return value


def _float(body: dict, name: str, default: float, lo: float, hi: float,
           lo_open: bool = False) -> float:
    value = body.get(name, default)
    rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(name, f"expected a number in {rng}, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        raise RequestError(name, f"{value} is out of range; allowed {rng}")
    return float(value)


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop", [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise RequestError("stop", "expected a non-empty string or a list of non-empty strings")
    if len(value) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"{len(value)} stop strings; at most {MAX_STOP_STRINGS}")
    return tuple(value)


def parse_request(body: dict[str, Any], config: HandlerConfig,
                  extra_fields: tuple[str, ...] = ()) -> GenerationRequest:
    """Validate a decoded body against the configured defaults and limits."""
    for key in body:
        if key not in FIELDS and key not in extra_fields:
            raise RequestError(str(key), f"unknown field{closest_hint(key, FIELDS)} "
                               f"(valid: {', '.join(FIELDS)})")
    d = config.defaults
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("prompt", "expected a non-empty string")
    max_new = _int(body, "max_new_tokens", d.max_new_tokens, 1, config.max_new_tokens_limit)
    min_new = _int(body, "min_new_tokens", 0, 0, max_new)
    seed = body.get("seed")
    if seed is not None:
        seed = _int(body, "seed", 0, 0, MAX_SEED)
    sampling = SamplingParams(
        temperature=_float(body, "temperature", d.temperature, 0.0, 100.0),
        top_k=_int(body, "top_k", d.top_k, 0, 1_000_000),
        top_p=_float(body, "top_p", d.top_p, 0.0, 1.0, lo_open=True),
        seed=seed,
        min_new_tokens=min_new,
    )
    stream = body.get("stream", d.stream)
    if not isinstance(stream, bool):
        raise RequestError("stream", f"expected true or false, got {stream!r}")
    fmt = body.get("stream_format", d.stream_format)
    if fmt not in ("text", "ndjson"):
        raise RequestError("stream_format", f"{fmt!r} is not allowed; choose 'text' or 'ndjson'")
    details = body.get("details", False)
    if not isinstance(details, bool):
        raise RequestError("details", f"expected true or false, got {details!r}")
    return GenerationRequest(prompt=prompt, max_new_tokens=max_new, min_new_tokens=min_new,
                             sampling=sampling, stop=_stop(body), stream=stream,
                             stream_format=fmt, details=details)


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
