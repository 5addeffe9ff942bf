"""The one check every API runs a request against: what the backend can honour.

A request field a backend cannot honour exactly must be refused (HTTP 400 naming the
field), never answered differently: a greedy request sampled behind someone else's
temperature, or a seeded request that does not reproduce, is a wrong answer with a 200.
Each backend declares its `Capabilities` (backends/base.py) once, next to the code that
decides them; the engine process sends them to the worker with the model's limits, and
the native and OpenAI APIs both call `check_sampling` with their own names for the
fields.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING

from handlers.backends.base import Capabilities, SamplingParams
from handlers.errors import ConfigError, RequestError

if TYPE_CHECKING:
    from handlers.config import HandlerConfig


def asked(p: SamplingParams) -> list[str]:
    """The features (FEATURES) a request's parameters use, in FEATURES order."""
    used = {
        "seed": p.seed is not None and not p.greedy,  # greedy ignores a seed
        "min_new_tokens": p.min_new_tokens > 0,
        "ignore_eos": p.ignore_eos,
        "repetition_penalty": p.repetition_penalty != 1.0,
        "frequency_penalty": p.frequency_penalty != 0.0,
        "presence_penalty": p.presence_penalty != 0.0,
        "logprobs": p.logprobs is not None,
        "prompt_logprobs": p.prompt_logprobs is not None,
    }
    return [f for f, on in used.items() if on]


def check_sampling(p: SamplingParams, caps: Capabilities,
                   names: Mapping[str, str] | None = None) -> None:
    """Refuse the first feature of `p` the backend cannot honour: RequestError naming the
    field as the API calls it (`names` maps a feature to that name; default: the same)."""
    names = names or {}
    for feature in asked(p):
        if why := caps.unsupported.get(feature):
            raise RequestError(names.get(feature, feature), f"not supported here: {why}")
    if caps.max_top_k is not None and not p.greedy and p.top_k > caps.max_top_k:
        raise RequestError(names.get("top_k", "top_k"), f"{p.top_k} is out of range; allowed "
                           f"[0, {caps.max_top_k}] ({caps.max_top_k_setting})")


def sampling_group(p: SamplingParams) -> Hashable | None:
    """Requests that one shared-sampling device call serves exactly together: every greedy
    request; unseeded sampled requests with the same temperature, top-k and top-p. None: a
    seeded sampled request, which runs alone (its draws must not depend on which rows ran
    beside it)."""
    if p.greedy:
        return ("greedy",)
    if p.seed is not None:
        return None
    return ("sampled", p.temperature, p.top_k, p.top_p)


def check_defaults(config: HandlerConfig, caps: Capabilities) -> None:
    """handler.defaults apply to every request that leaves a field out: a default the
    backend cannot honour would refuse all of them, so it is a config error (packaging time
    and worker start), naming the key."""
    d = config.defaults
    params = SamplingParams(temperature=d.temperature, top_k=d.top_k, top_p=d.top_p,
                            seed=d.seed, min_new_tokens=d.min_new_tokens)
    try:
        check_sampling(params, caps)
    except RequestError as exc:
        raise ConfigError(f"handler.defaults.{exc.field}: {exc.message}") from None
