"""The walk of a request from GenerationHandler.serve_one to the engine enters each file of
handlers/api/ once or twice: the body is parsed once into a typed request, and nothing
after reads it piecemeal (issue 36 counted 7 entries into api/openai.py, 5 into
api/request.py and 3 into api/openai_extensions.py for one chat request).

An entry is a call of a function defined in a file from code in another file, counted
with sys.setprofile from serve_one's start until the request reaches the service's
`submit`; calls within a file and library code in between do not count.
"""

from __future__ import annotations

import asyncio
import collections
import sys
from pathlib import Path

import pytest

import handlers.api
from handlers.backends import capabilities_for
from handlers.config import parse_config
from handlers.engine.messages import ModelLimits
from tests.unit.test_generation_handler import (
    Context,
    FakeService,
    GenerationHandler,
    RequestProcessor,
    Socket,
)
from tests.unit.test_openai_api import make_tokenizer
from tests.unit.test_tool_calls import TOOL_TEMPLATE, WEATHER

API = Path(handlers.api.__file__).parent
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
STREAMED = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4,
            "temperature": 0.7, "top_p": 0.9, "stop": ["ok"], "seed": 1}
WALKS = {  # name -> (url path, body, chat template)
    "chat": ("v1/chat/completions", {"messages": CHAT, **STREAMED}, "llama-2"),
    "chat with tools": ("v1/chat/completions",
                        {"messages": CHAT, **STREAMED, "tools": [WEATHER]}, TOOL_TEMPLATE),
    "completion": ("v1/completions", {"prompt": "hi there", **STREAMED}, ""),
    "native": ("", {"prompt": "hi there", "max_new_tokens": 4, "temperature": 0.7}, ""),
}


def walk(url_path: str, body: dict, template: str) -> tuple[collections.Counter, list, list]:
    """(entries per api/ file, the entries in order, what the service was handed)."""
    service = FakeService([])
    service.config = parse_config({"handler": {"chat_template": template}})
    service.limits = ModelLimits(1, 512, None, capabilities_for(service.config.handler))
    service.tokenizer = tokenizer = make_tokenizer()
    service.encode = lambda prompt: list(tokenizer(prompt)["input_ids"])
    submitted, on = [], [False]

    def submit(request_id, request, prompt_ids, loop, on_text=None):
        on[0] = False
        submitted.append(request)
        raise asyncio.CancelledError  # the walk ends here: nothing to stream

    service.submit = submit
    entries: collections.Counter = collections.Counter()
    order: list[tuple[str, str]] = []

    def profile(frame, event, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "serve_one":
            on[0] = True
        if not on[0] or not code.co_filename.startswith(str(API)):
            return
        caller = frame.f_back.f_code.co_filename if frame.f_back else ""
        if caller != code.co_filename:
            entries[Path(code.co_filename).name] += 1
            order.append((Path(code.co_filename).name, code.co_name))

    def run() -> None:
        handler = GenerationHandler()
        handler.service = service
        context = Context("tiny", "/m", {}, 1, None, "0.12.0")
        context.request_processor = [RequestProcessor({"url_path": url_path})]
        context.request_ids = {0: "req-1"}
        context.cl_socket = Socket()
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(handler.handle([{"body": body}], context))

    run()  # warm: the template probe and compiled templates are cached once per model
    submitted.clear()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return entries, order, submitted


@pytest.mark.parametrize("name", list(WALKS))
def test_each_api_file_is_entered_once_or_twice(name) -> None:
    entries, order, submitted = walk(*WALKS[name])
    assert len(submitted) == 1, order  # the walk reached the engine
    assert entries and max(entries.values()) <= 2, (dict(entries), order)
    if name.startswith("chat"):  # the body: read once, in one file
        assert entries["openai_request.py"] == 1 and entries["body.py"] == 1, order
        assert "openai_extensions.py" not in entries
