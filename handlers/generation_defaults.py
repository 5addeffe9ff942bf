"""A checkpoint's own sampling settings (generation_config.json) as handler.defaults.

Hub checkpoints ship the sampling their authors tuned (Llama-2-chat and Llama-3-Instruct:
do_sample, temperature 0.6, top_p 0.9), and vLLM serves those as the defaults of requests
that leave the fields out; users moving from it expect the same answers. So a setting
model-config.yaml's handler.defaults leaves unset comes from the checkpoint. Like vLLM,
only the keys the file holds count (transformers' own defaults, such as top_k 50, do not);
`do_sample: false` means greedy (temperature 0). The merge runs where the checkpoint is
known (the worker's start, and the packaging checks that mirror it), never in
handlers/config.py's parse, which stays a function of the YAML alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from handlers.backends import capabilities_for
from handlers.config import ModelConfig

SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def checkpoint_sampling(generation_config: Mapping[str, Any],
                        max_top_k: int | None = None) -> dict[str, Any]:
    """The sampling defaults a generation_config.json asks for, each within the range a
    request may ask (out-of-range values are left out, as the request would be refused)."""
    if generation_config.get("do_sample") is False:
        return {"temperature": 0.0}
    out: dict[str, Any] = {}
    t, p, k = (generation_config.get(key) for key in SAMPLING_KEYS)
    if _number(t) and 0 <= t <= 100:
        out["temperature"] = float(t)
    if _number(p) and 0 < p <= 1:
        out["top_p"] = float(p)
    if isinstance(k, int) and not isinstance(k, bool) and k >= 0 and (
            max_top_k is None or k <= max_top_k):
        out["top_k"] = k
    return out


#: the range a request may ask for each sampling key (handlers/api/request.py), for messages
RANGES = {"temperature": "[0, 100]", "top_p": "(0, 1]", "top_k": "an integer >= 0"}


def sampling_left_out(generation_config: Mapping[str, Any], max_top_k: int | None = None,
                      configured: set[str] = frozenset()) -> list[str]:
    """Why each sampling value of a generation_config.json is not taken as a default (one
    line each): out of a request's range, or above the backend's top_k. Keys the YAML sets
    are not read from the file, so they are not reported."""
    if generation_config.get("do_sample") is False:
        return []
    taken = checkpoint_sampling(generation_config, max_top_k)
    out = []
    for key in SAMPLING_KEYS:
        if key not in generation_config or key in taken or key in configured:
            continue
        value = generation_config[key]
        if value is None:
            continue
        why = f"outside {RANGES[key]}, the range a request may ask for"
        if (key == "top_k" and max_top_k is not None and isinstance(value, int)
                and not isinstance(value, bool) and value > max_top_k):
            why = f"above {max_top_k}, the most this backend samples from"
        out.append(f"{key} {value!r} is not used as a default ({why}); fix the file, or set "
                   f"handler.defaults.{key}")
    return out


def configured_defaults(raw: Mapping[str, Any] | None) -> set[str]:
    """The handler.defaults keys model-config.yaml sets (null means unset)."""
    handler = raw.get("handler") if isinstance(raw, Mapping) else None
    defaults = handler.get("defaults") if isinstance(handler, Mapping) else None
    if not isinstance(defaults, Mapping):
        return set()
    return {key for key, value in defaults.items() if value is not None}


def apply_generation_defaults(config: ModelConfig, raw: Mapping[str, Any] | None,
                              checkpoint: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """`config` with the checkpoint's sampling settings as the defaults the YAML leaves
    unset, and those taken (empty: `config` itself)."""
    path = Path(checkpoint) / "generation_config.json"
    if not path.is_file():
        return config, {}
    data = json.loads(path.read_text(encoding="utf-8"))  # checked by checkpoint_checks
    if not isinstance(data, dict):
        return config, {}
    caps = capabilities_for(config.handler)
    wanted = checkpoint_sampling(data, caps.max_top_k)
    taken = {k: v for k, v in wanted.items() if k not in configured_defaults(raw)}
    if not taken:
        return config, {}
    h = config.handler
    return replace(config, handler=replace(h, defaults=replace(h.defaults, **taken))), taken
