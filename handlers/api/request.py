"""The native request contract, and the generation settings every API reads the same way.

An API parses its body once into one typed request; the settings generation shares
(budget, sampling, stop strings, deadline) are read here for every API, under the names
that API gives them (`FieldNames`: `max_tokens` for OpenAI, `max_new_tokens` natively),
so an error names the field the client sent. Every rejection is a RequestError naming
the field and the allowed values, so the handler answers that request alone with HTTP
400 and serves the rest of the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from handlers.api.body import brief, closest_hint, decode_body
from handlers.backends.base import SamplingParams
from handlers.config import MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS, HandlerConfig
from handlers.errors import RequestError
from handlers.structured import spec as grammar_spec

#: prompts longer than handler.max_length x this many characters are refused before
#: tokenizing: tokenizing runs on the event loop every stream of the worker shares, and a
#: 6 MB prompt (just under TorchServe's default max_request_size) took ~13 s with the demo
#: tokenizer on a busy 2-core machine. Generous: the demo tokenizer's longest token has 7.
MAX_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class FieldNames:
    """The body keys an API sends the shared settings under: errors name what was sent."""

    budget: str = "max_new_tokens"
    min_tokens: str = "min_new_tokens"
    prompt: str = "prompt"  # what the prompt is made of (a chat's: `messages`)


NATIVE_NAMES = FieldNames()
#: the native API with the budget under its alias (TorchServe's LLM examples)
NATIVE_ALIAS_NAMES = FieldNames(budget="max_tokens")


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
    names: FieldNames = NATIVE_NAMES  # what the errors of fit_to_context name


@dataclass(frozen=True)
class GenerationParams:
    """What a body says about generating, validated once: the budget, the sampling, the
    stop strings and the deadline. An API's typed request holds one; the prompt joins it
    when the API has one (`request`, or `fitted` once tokenized: a chat's prompt is
    rendered from its messages after the body is parsed)."""

    max_new_tokens: int
    min_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    timeout_s: float | None
    up_to_limit: bool
    names: FieldNames

    def request(self, prompt: str, stream: bool, stream_format: str = "text",
                details: bool = False) -> GenerationRequest:
        return GenerationRequest(prompt, self.max_new_tokens, self.min_new_tokens,
                                 self.sampling, self.stop, stream, stream_format, details,
                                 self.timeout_s, self.up_to_limit, self.names)

    def fitted(self, prompt: str, prompt_tokens: int, *, stream: bool, max_length: int,
               max_prompt_length: int | None = None) -> GenerationRequest:
        """The request as it will run for a prompt of `prompt_tokens` (fit_to_context)."""
        return fit_to_context(self.request(prompt, stream), prompt_tokens, max_length,
                              max_prompt_length)


FIELDS = ("prompt", "max_new_tokens", "min_new_tokens", "temperature", "top_k", "top_p", "stop",
          "seed", "stream", "stream_format", "details", "timeout", "response_format")
#: other names of FIELDS: what TorchServe's LLM examples send (its vLLM handler hands the body
#: to vLLM's SamplingParams, whose name `max_tokens` is)
ALIASES = {"max_tokens": "max_new_tokens"}
#: the sampling ranges a request may ask for (docs/request-api.md states them)
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1_000_000


def _int(body: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"expected an integer in [{lo}, {hi}], got {brief(value)}")
    if not lo <= value <= hi:
        raise RequestError(name, f"{value} is out of range; allowed [{lo}, {hi}]")
    return value


def _budget(body: dict, name: str, default: int, limit: int) -> int:
    """The token budget asked for: any integer >= 1. One above the server's limit means "as
    many as you allow" and is capped (by the caller), however large: a chat UI's 10^9 and
    10^12 read the same."""
    value = body.get(name, default)
    rule = (f"allowed [1, {limit}], and any larger integer is capped at {limit} "
            "(handler.max_new_tokens_limit)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"expected an integer; {rule}; got {brief(value)}")
    if value < 1:
        raise RequestError(name, f"{value} is out of range; {rule}")
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestError(name, f"expected true or false, got {brief(value)}")
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


#: read_params' `prompt` when the body has no text prompt: one the API assembles (a chat's),
#: or token ids
ASSEMBLED = object()


def _check_prompt(prompt: Any, chars: int, config: HandlerConfig, name: str) -> None:
    """A text prompt is a string with something in it (ASSEMBLED: a prompt of `chars`
    characters the API builds itself); either way no larger than can fit."""
    if prompt is not ASSEMBLED:
        if not isinstance(prompt, str) or not prompt.strip():
            raise RequestError(name, f"expected a non-empty string, got {brief(prompt)}")
        chars = len(prompt)
    most = config.max_length * MAX_CHARS_PER_TOKEN
    if chars > most:
        raise RequestError(name, f"{chars} characters; at most {config.max_length} tokens fit "
                           f"(handler.max_length), and prompts over {most} characters are "
                           "refused untokenized")


def read_params(body: dict[str, Any], config: HandlerConfig, names: FieldNames = NATIVE_NAMES,
                *, prompt: Any = ASSEMBLED, prompt_chars: int = 0, logprobs: int | None = None,
                prompt_logprobs: int | None = None) -> GenerationParams:
    """The generation settings of a body whose fields were already checked by name (an
    unknown field is the API's to refuse): the configured defaults for what it leaves out.
    `prompt`: the body's text prompt, to check (a non-blank string, not too large); or
    ASSEMBLED and `prompt_chars` the size of the one the API builds itself. The penalties
    and `ignore_eos` are OpenAI's (vLLM's) fields: absent from a native body, they take
    their neutral defaults. `response_format` (OpenAI's shape in every API) is the answer's
    grammar (handlers/structured/spec.py), compiled by the engine."""
    d = config.defaults
    _check_prompt(prompt, prompt_chars, config, names.prompt)
    limit = config.max_new_tokens_limit
    asked = _budget(body, names.budget, d.max_new_tokens, limit)
    max_new = min(asked, limit)
    min_new = _int(body, names.min_tokens, min(d.min_new_tokens, max_new), 0, max_new)
    seed = body.get("seed", d.seed)
    if seed is not None:
        seed = _int(body, "seed", seed, 0, MAX_SEED)
    sampling = SamplingParams(  # the configured defaults are checked as a request's would be
        temperature=bounded_float(body, "temperature", d.temperature, 0.0, MAX_TEMPERATURE),
        top_k=_int(body, "top_k", d.top_k, 0, MAX_TOP_K),
        top_p=bounded_float(body, "top_p", d.top_p, 0.0, 1.0, lo_open=True),
        seed=seed,
        min_new_tokens=min_new,
        # OpenAI's (vLLM's) fields, absent from native bodies: read only when sent
        ignore_eos=_bool(body, "ignore_eos", False) if "ignore_eos" in body else False,
        repetition_penalty=(bounded_float(body, "repetition_penalty", 1, 0, 10, lo_open=True)
                            if "repetition_penalty" in body else 1.0),
        frequency_penalty=(bounded_float(body, "frequency_penalty", 0, -2, 2)
                           if "frequency_penalty" in body else 0.0),
        presence_penalty=(bounded_float(body, "presence_penalty", 0, -2, 2)
                          if "presence_penalty" in body else 0.0),
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        grammar=(grammar_spec.response_format(body["response_format"])
                 if "response_format" in body else None),
    )  # what the backend can honour is checked by the API (backends/capabilities.py)
    return GenerationParams(max_new, min_new, sampling, _stop(body, d.stop),
                            _timeout(body, config), asked > limit, names)


def _names(body: dict[str, Any]) -> FieldNames:
    """Which name carries the token budget: `max_new_tokens`, or its alias `max_tokens`; both
    with different values is a 400 naming both."""
    if "max_tokens" not in body:
        return NATIVE_NAMES
    if "max_new_tokens" not in body:
        return NATIVE_ALIAS_NAMES
    if body["max_tokens"] != body["max_new_tokens"] or type(body["max_tokens"]) is not type(
            body["max_new_tokens"]):
        raise RequestError("max_tokens", f"max_tokens {brief(body['max_tokens'])} and "
                           f"max_new_tokens {brief(body['max_new_tokens'])} differ; max_tokens is "
                           "an alias of "
                           "max_new_tokens, so send one of them")
    return NATIVE_NAMES


def default_stream_format(body: dict[str, Any], configured: str) -> str:
    """The framing of a request that names no `stream_format`: NDJSON (one JSON object per
    chunk) for the dialect of TorchServe's LLM examples, whose clients send `max_tokens` and
    json.loads every chunk they read (examples/large_models/utils/
    test_llm_streaming_response.py); else the configured one (raw text, for `curl -N`)."""
    return "ndjson" if "max_tokens" in body else configured


def parse_request(body: dict[str, Any], config: HandlerConfig,
                  extra_fields: tuple[str, ...] = ()) -> GenerationRequest:
    """A decoded native body, validated against the configured defaults and limits."""
    for key in body:
        if key not in FIELDS and key not in ALIASES and key not in extra_fields:
            raise RequestError(str(key), f"unknown field{closest_hint(key, FIELDS)} "
                               f"(valid: {', '.join(FIELDS)})")
    d = config.defaults
    prompt = body.get("prompt")
    params = read_params(body, config, _names(body), prompt=prompt)
    stream = _bool(body, "stream", d.stream)
    fmt = body.get("stream_format", default_stream_format(body, d.stream_format))
    if fmt not in ("text", "ndjson"):
        raise RequestError("stream_format",
                           f"{brief(fmt)} is not allowed; choose 'text' or 'ndjson'")
    return params.request(prompt, stream, fmt, _bool(body, "details", d.details))


def parse_native(payload: Any, content_type: str, config: HandlerConfig) -> GenerationRequest:
    """A native body as TorchServe hands it over (JSON, plain text or a JSON string, which
    is the prompt), parsed once."""
    return parse_request(decode_body(payload, content_type, string_is_prompt=True), config)


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
    check_length(prompt_tokens, request.max_new_tokens, max_length, max_prompt_length,
                 request.names)
    return request


def check_length(prompt_tokens: int, max_new_tokens: int, max_length: int,
                 max_prompt_length: int | None = None,
                 names: FieldNames = NATIVE_NAMES) -> None:
    """Reject prompts that cannot fit the compiled/configured context."""
    limit = min(max_length - 1, max_prompt_length or max_length)
    if prompt_tokens > limit:
        raise RequestError(names.prompt, f"{prompt_tokens} tokens; at most {limit} fit "
                           f"(max_length {max_length}, longest prefill {limit})")
    if prompt_tokens + max_new_tokens > max_length:
        raise RequestError(names.budget, f"{max_new_tokens} with a {prompt_tokens}-token "
                           f"prompt exceeds max_length {max_length}; allowed [1, "
                           f"{max_length - prompt_tokens}]")
