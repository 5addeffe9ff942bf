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
        "grammar": p.grammar is not None,
    }
    return [f for f, on in used.items() if on]


def check_sampling(p: SamplingParams, caps: Capabilities,
                   names: Mapping[str, str] | None = None) -> None:
    """Refuse the first feature of `p` the backend cannot honour: RequestError naming the
    field as the API calls it (`names` maps a feature to that name; default: the same)."""
    names = names or {}
    for feature in asked(p):
        if why := caps.unsupported.get(feature):
            name = names.get(feature, feature)
            if feature == "grammar":  # the field that asked for it: response_format, tool_choice
                name = p.grammar.field.split(".")[0]
            raise RequestError(name, f"not supported here: {why}")
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


#: why an on-device sampler refuses a feature: both Neuron backends' samplers take per row
#: only top-k (after a global top-k), top-p and temperature, draw from the device's own RNG
#: (no seed input) and return token ids, not logits
ON_DEVICE_WHY = ("handler.neuron.on_device_sampling samples on the device, which takes only "
                 "top_k, top_p and temperature per request and returns token ids; turn it off "
                 "to sample on the host")
#: why a grammar (structured outputs) cannot apply there: neither SDK's on-device sampler
#: takes a mask or a bias -- NxD Inference's Sampler.forward takes the logits and per-row
#: (top_k, top_p, temperature) only (aws-neuron/neuronx-distributed-inference@v0.7.14366:
#: src/neuronx_distributed_inference/modules/generation/sampling.py:392-420), as does
#: transformers-neuronx's GenerationConfig (aws-neuron/transformers-neuronx@1ade6d74:
#: src/transformers_neuronx/config.py:106-120)
GRAMMAR_ON_DEVICE_WHY = ("handler.neuron.on_device_sampling samples on the device, and "
                         "neither Neuron SDK's on-device sampler takes a token mask or bias "
                         "(only top_k, top_p and temperature per request), so no grammar can "
                         "constrain it; turn on_device_sampling off to sample on the host")
#: why speculation refuses a grammar: the drafts are accepted on the device, unchecked
GRAMMAR_SPECULATION_WHY = ("handler.neuron.speculation accepts draft tokens on the device, "
                           "where no grammar checks them; serve structured outputs from a "
                           "model without speculation")
#: a greedy request on such a sampler: the best token only
GREEDY_ROW = (1, 1.0, 1.0)


def on_device_capabilities(global_top_k: int,
                           reasons: Mapping[str, str] | None = None) -> Capabilities:
    """What an on-device sampler honours; `reasons` overrides the reason of a feature
    refused for a cause of the backend's own (NxD Inference's prompt logprobs)."""
    unsupported = {f: ON_DEVICE_WHY for f in ("seed", "min_new_tokens", "repetition_penalty",
                                              "frequency_penalty", "presence_penalty",
                                              "logprobs", "prompt_logprobs")}
    unsupported["grammar"] = GRAMMAR_ON_DEVICE_WHY
    return Capabilities({**unsupported, **(reasons or {})}, max_top_k=global_top_k,
                        max_top_k_setting="handler.neuron.global_top_k, the most the on-device "
                        "sampler considers")


def refusing(caps: Capabilities, feature: str, why: str) -> Capabilities:
    """`caps` with `feature` refused too (an earlier reason for it stays)."""
    if feature in caps.unsupported:
        return caps
    return Capabilities({**caps.unsupported, feature: why}, caps.max_top_k,
                        caps.max_top_k_setting, caps.shared_sampling)


def device_sampling_row(p: SamplingParams, caps: Capabilities,
                        global_top_k: int) -> tuple[int, float, float]:
    """(top_k, top_p, temperature) of a request for an on-device sampler, checked against
    `caps` again (the engine is public). top_k 0 ("off") is every token the global top-k
    keeps (0 would mean uniform there)."""
    check_sampling(p, caps)
    if p.greedy:
        return GREEDY_ROW
    return (int(p.top_k or global_top_k), float(p.top_p), float(p.temperature))
