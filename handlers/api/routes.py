"""Which API a request speaks, chosen by the path after /predictions/{model}/{version}/.

TorchServe 0.12 forwards extra path segments as the `url_path` request header: none is
the native API (handlers/api/native.py); anything else is the OpenAI-compatible surface
(handlers/api/openai.py), which builds on the native contract. Routing lives apart from
both so that neither imports the other back.
"""

from __future__ import annotations

from handlers.api.native import Api, NativeApi
from handlers.api.openai import openai_api


def select_api(url_path: str | None) -> Api:
    path = (url_path or "").strip("/")
    if not path:
        return NativeApi()
    # v1/... and the probes OpenAI-ecosystem clients send (health, ping, version); anything
    # else is theirs too (the native API has no path), so its 404 is in OpenAI's shape
    return openai_api(path)
