"""OpenAI fields beyond the native request: stream options, penalties, logprobs, echo.

vLLM's and TGI's extensions that clients send (GuideLLM: `ignore_eos`,
`stream_options.continuous_usage_stats`) and OpenAI's own logprobs and penalties,
parsed into `SamplingParams` and checked against what the loaded backend can do: one
that cannot honour a field refuses it by name, saying which setting decides.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from handlers.api.request import bounded_float, brief
from handlers.backends.base import Capabilities, SamplingParams
from handlers.backends.capabilities import check_sampling
from handlers.errors import RequestError

# honoured beyond the native fields (handlers/backends/sampling.py applies them)
EXTENSIONS = ("ignore_eos", "repetition_penalty", "frequency_penalty", "presence_penalty")
#: SamplingParams features under the names OpenAI clients send (backends/capabilities.py)
OPENAI_NAMES = {"min_new_tokens": "min_tokens", "prompt_logprobs": "echo"}
#: the most alternatives per token (vLLM's default max_logprobs is 20)
MAX_LOGPROBS = 20


def stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats): usage after the last chunk, and on every
    chunk (vLLM's extension, which GuideLLM sends)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if body.get("stream") is not True:
        raise RequestError("stream_options", "only allowed when stream is true")
    allowed = ("include_usage", "continuous_usage_stats")
    if not isinstance(options, dict) or set(options) - set(allowed):
        raise RequestError("stream_options", "expected {\"include_usage\": true|false, "
                           "\"continuous_usage_stats\": true|false}")
    values = []
    for key in allowed:
        value = options.get(key, False)
        if not isinstance(value, bool):
            raise RequestError("stream_options",
                               f"{key}: expected true or false, got {brief(value)}")
        values.append(value)
    include, continuous = values
    return include, include and continuous  # vLLM: continuous stats need include_usage


def _count(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise RequestError(key, f"expected an integer in [0, {MAX_LOGPROBS}], got {brief(value)}")
    return value


def logprobs_asked(body: dict[str, Any], chat: bool) -> int | None:
    """Top alternatives per token, or None for no logprobs. Completions: `logprobs` is that
    number; chat: `logprobs` true and `top_logprobs` the number (OpenAI's two shapes)."""
    if not chat:
        return _count(body, "logprobs")
    asked = body.get("logprobs", False)
    if not isinstance(asked, bool):
        raise RequestError("logprobs", f"expected true or false, got {brief(asked)}")
    top = _count(body, "top_logprobs")
    if top is not None and not asked:
        if top == 0:
            return None
        raise RequestError("top_logprobs", "needs \"logprobs\": true")
    return (top or 0) if asked else None


def extensions(body: dict[str, Any], sampling: SamplingParams, caps: Capabilities,
               logprobs: int | None, echo: bool) -> SamplingParams:
    """The fields the native API does not have; the whole request is then checked against
    what this backend can do (backends/capabilities.py), under OpenAI's field names."""
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError("ignore_eos", f"expected true or false, got {brief(ignore_eos)}")
    params = replace(
        sampling, ignore_eos=ignore_eos,
        repetition_penalty=bounded_float(body, "repetition_penalty", 1.0, 0, 10, lo_open=True),
        frequency_penalty=bounded_float(body, "frequency_penalty", 0.0, -2, 2),
        presence_penalty=bounded_float(body, "presence_penalty", 0.0, -2, 2),
        logprobs=logprobs, prompt_logprobs=logprobs if echo else None)
    check_sampling(params, caps, OPENAI_NAMES)
    return params
