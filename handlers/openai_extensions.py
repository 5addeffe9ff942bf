"""OpenAI fields beyond the native request: stream options, penalties, logprobs, echo.

vLLM's and TGI's extensions that clients send (GuideLLM: `ignore_eos`,
`stream_options.continuous_usage_stats`) and OpenAI's own logprobs and penalties,
parsed into `SamplingParams` and checked against what the archive's backend can do:
one that cannot honour a field refuses it by name, saying which setting decides.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from handlers.backends.base import SamplingParams
from handlers.config import HandlerConfig
from handlers.errors import RequestError
from handlers.request import bounded_float

# honoured beyond the native fields (handlers/sampling.py applies them)
EXTENSIONS = ("ignore_eos", "repetition_penalty", "frequency_penalty", "presence_penalty")
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
            raise RequestError("stream_options", f"{key}: expected true or false, got {value!r}")
        values.append(value)
    include, continuous = values
    return include, include and continuous  # vLLM: continuous stats need include_usage


def _count(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise RequestError(key, f"expected an integer in [0, {MAX_LOGPROBS}], got {value!r}")
    return value


def logprobs_asked(body: dict[str, Any], chat: bool) -> int | None:
    """Top alternatives per token, or None for no logprobs. Completions: `logprobs` is that
    number; chat: `logprobs` true and `top_logprobs` the number (OpenAI's two shapes)."""
    if not chat:
        return _count(body, "logprobs")
    asked = body.get("logprobs", False)
    if not isinstance(asked, bool):
        raise RequestError("logprobs", f"expected true or false, got {asked!r}")
    top = _count(body, "top_logprobs")
    if top is not None and not asked:
        if top == 0:
            return None
        raise RequestError("top_logprobs", "needs \"logprobs\": true")
    return (top or 0) if asked else None


def extensions(body: dict[str, Any], sampling: SamplingParams, config: HandlerConfig,
               logprobs: int | None, echo: bool) -> SamplingParams:
    """The fields the native API does not have, checked against what this backend can do."""
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError("ignore_eos", f"expected true or false, got {ignore_eos!r}")
    params = replace(
        sampling, ignore_eos=ignore_eos,
        repetition_penalty=bounded_float(body, "repetition_penalty", 1.0, 0, 10, lo_open=True),
        frequency_penalty=bounded_float(body, "frequency_penalty", 0.0, -2, 2),
        presence_penalty=bounded_float(body, "presence_penalty", 0.0, -2, 2),
        logprobs=logprobs, prompt_logprobs=logprobs if echo else None)
    asked = [k for k in EXTENSIONS if k in body and body[k] != SamplingParams.__dict__.get(k)]
    asked += ["min_tokens"] if params.min_new_tokens else []
    asked += ["logprobs"] if logprobs is not None else []
    asked += ["echo"] if params.prompt_logprobs is not None else []
    for field in asked:
        if why := unsupported(field, config):
            raise RequestError(field, f"not supported here: {why}")
    return params


def unsupported(field: str, config: HandlerConfig) -> str | None:
    """Why this archive's backend cannot honour `field`, or None when it can. Penalties and
    logprobs need logits on the host, where handlers/sampling.py applies and reads them;
    prompt logprobs (`echo` with `logprobs`) need every prompt position's logits."""
    backend, micro = config.backend, config.batching != "continuous"
    if field == "echo":
        return None if backend == "torch" else (
            f"handler.backend {backend} returns logits for the last prompt position only, so "
            "there are no prompt logprobs; send echo without logprobs, or use backend torch")
    if backend == "synthetic":
        return None if field in ("ignore_eos", "min_tokens") else (
            "handler.backend synthetic runs no model, so it has no logits")
    if backend == "neuron" and micro:
        # transformers-neuronx's sample loop stops a row at EOS and applies only top-k,
        # top-p and temperature (aws-neuron/transformers-neuronx@1ade6d7:src/
        # transformers_neuronx/sampling.py:L348-L365)
        return ("handler.batching micro samples inside transformers-neuronx's sample(), which "
                "ends rows at EOS and returns no logits; use handler.batching continuous")
    if backend == "nxdi" and config.nxdi.on_device_sampling and field != "ignore_eos":
        return ("handler.nxdi.on_device_sampling samples on the device, which returns token "
                "ids only; turn it off to sample on the host")
    return None
