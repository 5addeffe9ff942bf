"""Per-request parse cost of each API's body, and the same bodies through pydantic v2.

Three figures per body, in µs per request, each the fastest of many short rounds:
- prepare: `Api.prepare` as the handler calls it, with a tokenizer stub whose render and
  encode cost nothing, so what is left is reading and validating the body, checking it
  against the served model and setting up the framer (the whole per-request host work
  of handlers/api/ before the engine);
- parse: the body to the typed request alone (handlers/api/openai_request.py,
  handlers/api/request.py);
- pydantic: a pydantic v2 model of the same fields and rules (below: strict types, ranges,
  extra fields forbidden; the lone-surrogate walk of body.check_text added, as both must
  do it), validated with `model_validate` and then turned into the same GenerationParams
  the engine reads ("+ convert").

The bodies are what clients send: the bench load generator's native NDJSON request,
GuideLLM's completions request, an Open WebUI chat turn, and a tool-calling chat with
two tools. Run: `.venv/bin/python bench/request_parse.py` (`--only prepare` runs the part
that any version of handlers/api has, for a before/after pair).

`--instructions` counts instructions per request instead, under valgrind's callgrind (a
profile dumped at each marker call, so only the measured calls count): a figure that the
other work of a shared machine does not move, where a time does, by 2x on a busy 2-core VM.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from handlers.api.routes import select_api  # noqa: E402
from handlers.backends import capabilities_for  # noqa: E402
from handlers.config import parse_config  # noqa: E402
from handlers.engine.messages import ModelLimits  # noqa: E402

TEXT = ("Once upon a time, in a village at the edge of a great forest, there lived an old "
        "clockmaker who had never once left the valley. ") * 4
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "max_results": {"type": "integer"}},
            "required": ["query"]}}}]
TURNS = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
         {"role": "user", "content": TEXT[:200]},
         {"role": "assistant", "content": TEXT[200:380]},
         {"role": "user", "content": "And then what happened to the clockmaker?"}]
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "native (bench load generator)": ("", {
        "prompt": TEXT, "max_new_tokens": 128, "min_new_tokens": 0, "temperature": 0.0,
        "seed": 7, "stream": True, "stream_format": "ndjson"}),
    "completions (GuideLLM)": ("v1/completions", {
        "model": "model", "prompt": TEXT, "max_tokens": 128, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True, "temperature": 0.0}),
    "chat (Open WebUI turn)": ("v1/chat/completions", {
        "model": "model", "messages": TURNS, "stream": True,
        "stream_options": {"include_usage": True}, "max_tokens": 1000, "temperature": 0.8,
        "top_p": 0.9, "seed": None, "stop": None, "frequency_penalty": 0, "user": "u-1"}),
    "chat with 2 tools": ("v1/chat/completions", {
        "model": "model", "messages": TURNS, "stream": True, "max_tokens": 256,
        "temperature": 0.2, "tools": TOOLS, "tool_choice": "auto"}),
}


class StubTokenizer:
    """Renders and encodes for free: the figure is the API's own work. The prompt it
    renders names the probe tool, so the template reads as one with a tool format."""

    name_or_path = "model"
    bos_token = "<s>"
    chat_template = "{{ messages }}"
    ids = list(range(3, 103))

    def apply_chat_template(self, messages, tools=None, **kwargs) -> str:
        return "<s>chat " + (tools[0]["function"]["name"] if tools else "")

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.ids}

    def decode(self, ids) -> str:
        return "x"

    def __len__(self) -> int:
        return 32000


def stub_service() -> SimpleNamespace:
    config = parse_config({"handler": {"max_length": 4096, "max_new_tokens_limit": 1024}})
    tokenizer = StubTokenizer()
    return SimpleNamespace(config=config, tokenizer=tokenizer,
                           limits=ModelLimits(1, 4096, None, capabilities_for(config.handler)),
                           encode=lambda prompt: tokenizer.ids)


def per_call_us(fn: Callable[[], Any], calls: int, rounds: int) -> float:
    """Time per call, the fastest of many short rounds (timeit's rule): a round shorter
    than a scheduler slice that ran unpreempted measures the code, a slower one the other
    work of a shared machine."""
    fn()  # warm: caches, the template probe
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / calls * 1e6


COLUMNS = ("prepare", "parse", "pydantic", "+ convert")


def measured(only: str | None) -> dict[tuple[str, str], Callable[[], Any]]:
    """(body, column) -> the call to measure."""
    service = stub_service()
    config = service.config.handler
    out: dict[tuple[str, str], Callable[[], Any]] = {}
    for name, (path, body) in BODIES.items():
        api = select_api(path)
        out[name, "prepare"] = lambda a=api, b=body: a.prepare(b, "application/json", service)
    if only:
        return out
    from handlers.api.body import check_text
    from handlers.api.openai_request import parse_chat, parse_completion
    from handlers.api.request import parse_native

    parsers = {"": parse_native, "v1/completions": parse_completion,
               "v1/chat/completions": parse_chat}
    models, convert = pydantic_models()
    for name, (path, body) in BODIES.items():
        model = models[path]
        out[name, "parse"] = lambda p=parsers[path], b=body: p(b, "application/json", config)
        out[name, "pydantic"] = lambda m=model, b=body: m.model_validate(check_text(b))
        out[name, "+ convert"] = lambda m=model, b=body: convert(
            m.model_validate(check_text(b)), config)
    return out


def marked(calls: int, only: str | None) -> None:
    """Under callgrind (--dump-before=getppid): each measurement's calls between two
    markers, after a warm-up outside them."""
    for fn in measured(only).values():
        fn()
        os.getppid()
        for _ in range(calls):
            fn()
        os.getppid()


def instructions(calls: int, only: str | None) -> dict[tuple[str, str], float]:
    """Instructions per call of each measurement: the dump between its two markers."""
    labels = list(measured(only))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", "--dump-before=getppid",
               f"--callgrind-out-file={out}", sys.executable, __file__, "--marked",
               "--calls", str(calls), *(["--only", only] if only else [])]
        subprocess.run(cmd, check=True, capture_output=True)
        dumps = sorted(Path(tmp).glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:]))
        totals = [int(re.search(r"^totals: (\d+)", d.read_text(), re.M).group(1))
                  for d in dumps]
    # dump 1 is everything before the first marker; then (calls, warm-up) pairs
    return {label: totals[1 + 2 * i] / calls for i, label in enumerate(labels)}


def pydantic_models() -> tuple[dict[str, Any], Callable[[Any, Any], Any]]:
    """The request contract as pydantic v2 models (strict: no "5" for 5, no 1 for true),
    the ranges of handlers/api/request.py, extra fields forbidden; the cross-field rules
    (min <= max, stop sizes, a non-blank prompt) in validators, as they would have to be."""
    from typing import Annotated, Literal

    from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

    from handlers.api.request import MAX_CHARS_PER_TOKEN, NATIVE_NAMES, GenerationParams
    from handlers.backends.base import SamplingParams
    from handlers.config import MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    Budget = Annotated[int, Field(ge=1)]
    Unit = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
    Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]

    class Settings(Strict):
        min_tokens: Annotated[int, Field(ge=0)] | None = None
        temperature: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] | None = None
        top_p: Unit | None = None
        top_k: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
        seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
        stop: str | list[str] | None = None
        timeout: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] | None = None
        ignore_eos: bool | None = None
        repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
        frequency_penalty: Penalty | None = None
        presence_penalty: Penalty | None = None
        stream: bool | None = None
        model: str | None = None
        user: str | None = None
        n: Literal[1] | None = None
        logit_bias: dict | None = None

        @field_validator("stop")
        @classmethod
        def _stop(cls, value):
            values = [value] if isinstance(value, str) else value or []
            if len(values) > MAX_STOP_STRINGS or not all(0 < len(s) <= MAX_STOP_CHARS
                                                         for s in values):
                raise ValueError("up to 8 non-empty strings of at most 256 characters")
            return value

    class StreamOptions(Strict):
        include_usage: bool = False
        continuous_usage_stats: bool = False

    class Native(Settings):
        prompt: str
        max_new_tokens: Budget | None = None
        max_tokens: Budget | None = None
        min_new_tokens: Annotated[int, Field(ge=0)] | None = None
        stream_format: Literal["text", "ndjson"] | None = None
        details: bool | None = None

        @field_validator("prompt")
        @classmethod
        def _prompt(cls, value):
            if not value.strip() or len(value) > 4096 * MAX_CHARS_PER_TOKEN:
                raise ValueError("expected a non-empty string that fits")
            return value

    class Completion(Settings):
        prompt: str | list[int] | list[str] | list[list[int]]
        max_tokens: Budget | None = None
        stream_options: StreamOptions | None = None
        logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
        echo: bool | None = None

    class TextPart(Strict):
        type: Literal["text"]
        text: str

    class Function(Strict):
        name: Annotated[str, Field(min_length=1, max_length=64)]
        arguments: str | dict = "{}"

    class ToolCall(Strict):
        id: str | None = None
        type: Literal["function"] = "function"
        function: Function

    class Message(Strict):
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
        name: str | None = None
        tool_calls: list[ToolCall] | None = None
        tool_call_id: str | None = None

    class FunctionSpec(Strict):
        name: Annotated[str, Field(min_length=1, max_length=64)]
        description: str | None = None
        parameters: dict = {}

    class Tool(Strict):
        type: Literal["function"]
        function: FunctionSpec

    class Chat(Settings):
        messages: Annotated[list[Message], Field(min_length=1)]
        max_tokens: Budget | None = None
        max_completion_tokens: Budget | None = None
        stream_options: StreamOptions | None = None
        logprobs: bool | None = None
        top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
        tools: list[Tool] | None = None
        tool_choice: Literal["none", "auto", "required"] | dict | None = None
        response_format: dict | None = None
        parallel_tool_calls: bool | None = None

        @model_validator(mode="after")
        def _fits(self):
            chars = sum(len(m.content) for m in self.messages if isinstance(m.content, str))
            if chars > 4096 * MAX_CHARS_PER_TOKEN:
                raise ValueError("messages: too large")
            return self

    def convert(body, config) -> GenerationParams:
        """The validated model as the GenerationParams the engine reads: defaults, the cap."""
        d = config.defaults
        asked = (getattr(body, "max_new_tokens", None) or getattr(body, "max_completion_tokens",
                                                                   None)
                 or body.max_tokens or d.max_new_tokens)
        max_new = min(asked, config.max_new_tokens_limit)
        min_new = min(getattr(body, "min_new_tokens", None) or body.min_tokens or 0, max_new)
        stop = body.stop if body.stop is not None else d.stop
        sampling = SamplingParams(
            temperature=d.temperature if body.temperature is None else body.temperature,
            top_k=d.top_k if body.top_k is None else body.top_k,
            top_p=d.top_p if body.top_p is None else body.top_p,
            seed=d.seed if body.seed is None else body.seed, min_new_tokens=min_new,
            ignore_eos=bool(body.ignore_eos),
            repetition_penalty=body.repetition_penalty or 1.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0)
        return GenerationParams(max_new, min_new, sampling,
                                (stop,) if isinstance(stop, str) else tuple(stop),
                                body.timeout or config.request_timeout_s,
                                asked > config.max_new_tokens_limit, NATIVE_NAMES)

    return {"": Native, "v1/completions": Completion, "v1/chat/completions": Chat}, convert


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20, help="calls per round (per measurement "
                    "with --instructions)")
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--only", choices=("prepare",), help="only Api.prepare (any version)")
    ap.add_argument("--instructions", action="store_true", help="count instructions per "
                    "request under valgrind's callgrind instead of timing")
    ap.add_argument("--marked", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.marked:
        marked(args.calls, args.only)
        return 0
    if args.instructions:
        figures, unit, fmt = instructions(args.calls, args.only), "instructions", "{:10,.0f}"
    else:
        figures = {k: per_call_us(fn, args.calls, args.rounds)
                   for k, fn in measured(args.only).items()}
        unit, fmt = "us", "{:10.1f}"
    columns = [c for c in COLUMNS if any(k[1] == c for k in figures)]
    print(f"{'body':32s}" + "".join(f"{c:>10s}" for c in columns) + f"  ({unit} per request)")
    for name in BODIES:
        print(f"{name:32s}" + "".join(fmt.format(figures[name, c]) for c in columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
