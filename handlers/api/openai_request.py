"""An OpenAI body parsed once into one typed request: completions and chat.

As vLLM parses a body into its `ChatCompletionRequest`, each body is read here in one
pass into a frozen `CompletionRequest` or `ChatRequest`, from which everything
downstream reads fields: the generation settings (`params`: budget, sampling, stop,
deadline, read by handlers/api/request.py under OpenAI's names), the framing options
(`stream`, `stream_options`, `logprobs`, `echo`), the tool settings and the messages.
Nothing later reads the body dict again. What needs the served model (its name, what
its backend can honour, its chat template, its tokenizer) is checked where the request
meets it (handlers/api/openai.py).

Fields clients send with harmless default values are accepted; any other value, and any
unknown field, is refused naming the field. Beyond OpenAI's own fields this server
honours vLLM's and TGI's extensions that clients send (GuideLLM: `ignore_eos`,
`stream_options.continuous_usage_stats`), `top_k`, `min_tokens`, `repetition_penalty`,
and `timeout` (a server-side deadline). docs/design.md says why frozen dataclasses and not
pydantic, with the cost of each per request.

`response_format` json_object / json_schema (with `strict`), on chat and completions, is
the GrammarSpec handlers/structured/spec.py parses (read_params puts it in the sampling
settings, which carry it to the engine); `chat_template_kwargs` (vLLM's field, e.g. Qwen3's
`{"enable_thinking": false}`) is `ChatRequest.template_kwargs`, which the template render
passes on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from handlers.api import tool_calls
from handlers.api.body import brief, closest_hint, decode_body
from handlers.api.request import ASSEMBLED, FieldNames, GenerationParams, read_params
from handlers.api.tool_calls import ToolRequest
from handlers.config import HandlerConfig
from handlers.errors import RequestError
from handlers.structured.spec import GrammarSpec


def _number(expected: int) -> Callable[[Any], bool]:
    """`v == 1` alone would take true for 1 and false for 0."""
    return lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and v == expected


#: fields accepted only with the value that changes nothing: (check, what is allowed)
HARMLESS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_number(1), "1 (one choice per request: choices do not share a prefill here)"),
    "logit_bias": (lambda v: v == {}, "{} or null"),
    "user": (lambda v: isinstance(v, str), "a string"),
    "best_of": (_number(1), "1"),
    "suffix": (lambda v: v == "", "\"\" or null"),
    "store": (lambda v: v is False, "false"),
    "metadata": (lambda v: isinstance(v, dict), "an object"),
    "service_tier": (lambda v: v in ("auto", "default"), "'auto' or 'default'"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "true or false"),
}
#: the generation settings, read by handlers/api/request.read_params under these names
SETTINGS = ("temperature", "top_p", "top_k", "stop", "seed", "min_tokens", "ignore_eos",
            "repetition_penalty", "frequency_penalty", "presence_penalty",
            "timeout")  # our extension (OpenAI has no server-side deadline field)
COMMON = ("model", "stream", "stream_options", "n", "logit_bias", "user", *SETTINGS)
COMPLETION_FIELDS = ("prompt", "max_tokens", "logprobs", "echo", "best_of", "suffix",
                     "response_format", *COMMON)
CHAT_FIELDS = ("messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
               "store", "metadata", "service_tier", "response_format", "tools", "tool_choice",
               "parallel_tool_calls", "chat_template_kwargs", *COMMON)
COMPLETION_NAMES = FieldNames(budget="max_tokens", min_tokens="min_tokens")
CHAT_NAMES = FieldNames(budget="max_tokens", min_tokens="min_tokens", prompt="messages")
#: a chat that sends the budget under its newer name (max_tokens may repeat it)
CHAT_NEW_NAMES = FieldNames(budget="max_completion_tokens", min_tokens="min_tokens",
                            prompt="messages")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
MESSAGE_KEYS = ("role", "content", "name")
#: what tool calling and thinking add to a message: an assistant turn's calls and reasoning
#: (sent back as the answer gave it, under either name; Qwen3's template reads it as
#: reasoning_content), a tool result's call id
TOOL_KEYS = {"assistant": ("tool_calls", "reasoning_content", "reasoning"),
             "tool": ("tool_call_id",)}
#: what apply_chat_template or the template's own globals already name: a request's
#: chat_template_kwargs may not replace them
RESERVED_KWARGS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception",
    "strftime_now", "bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
    "cls_token", "mask_token", "additional_special_tokens"})
#: the most alternatives per token (vLLM's default max_logprobs is 20)
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class StreamOptions:
    """`stream_options`: usage after the last chunk, and on every chunk (vLLM's
    `continuous_usage_stats`, which GuideLLM sends; it needs include_usage)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


NO_STREAM_OPTIONS = StreamOptions()


@dataclass(frozen=True)
class OpenAIRequest:
    """What completions and chat share."""

    model: str | None  # None: whichever this endpoint serves
    params: GenerationParams
    stream: bool
    stream_options: StreamOptions
    logprobs: int | None  # top alternatives per token; None: no logprobs


@dataclass(frozen=True)
class CompletionRequest(OpenAIRequest):
    prompt: str | tuple[int, ...] = ""  # text, or token ids
    echo: bool = False  # put the prompt before the answer (and its logprobs)
    score_only: bool = False  # echo with max_tokens 0: the prompt scored, nothing shown


@dataclass(frozen=True)
class ChatRequest(OpenAIRequest):
    messages: tuple[dict[str, Any], ...] = ()  # as the chat template reads them
    tools: ToolRequest | None = None
    #: the first message that needs a template with a tool format (a tool result, an
    #: assistant's tool_calls), as an error names it; None when none does
    tool_turn: str | None = None
    #: `response_format` as the constraint it asks for (handlers/structured/spec.py), as
    #: `params.sampling.grammar` holds it; None for text
    response_format: GrammarSpec | None = None
    #: extra variables for the chat template (`chat_template_kwargs`); None: none sent
    template_kwargs: Mapping[str, Any] | None = None


def decode_json(payload: Any, content_type: str) -> dict[str, Any]:
    """TorchServe hands over a dict (JSON it decoded) or the raw bytes it could not decode;
    OpenAI names no param for a body it cannot read."""
    if payload is None or payload in (b"", ""):
        raise RequestError("", "empty request body; send a JSON object")
    try:
        return decode_body(payload, "application/json")
    except RequestError as exc:
        raise RequestError("" if exc.field == "body" else exc.field, exc.message,
                           exc.status) from exc


def check_fields(body: dict[str, Any], allowed: tuple[str, ...]) -> dict[str, Any]:
    """Drop nulls (clients send them for 'unset'); reject unknown fields and non-defaults."""
    body = {k: v for k, v in body.items() if v is not None}
    for key, value in body.items():
        if key not in allowed:
            raise RequestError(str(key), "unrecognized request argument"
                               f"{closest_hint(key, allowed)}")
        if key in HARMLESS and not HARMLESS[key][0](value):
            raise RequestError(key, f"{brief(value)} is not supported; this server accepts only "
                               f"{HARMLESS[key][1]}")
    if "model" in body and not isinstance(body["model"], str):
        raise RequestError("model", f"expected a string, got {brief(body['model'])}")
    return body


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise RequestError(key, f"expected true or false, got {brief(value)}")
    return value


def _stream_options(body: dict[str, Any], stream: bool) -> StreamOptions:
    options = body.get("stream_options")
    if options is None:
        return NO_STREAM_OPTIONS
    if not stream:
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
    return StreamOptions(include, include and continuous)


def _count(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise RequestError(key, f"expected an integer in [0, {MAX_LOGPROBS}], got {brief(value)}")
    return value


def _logprobs(body: dict[str, Any], chat: bool, stream: bool) -> int | None:
    """Top alternatives per token, or None for no logprobs. Completions: `logprobs` is that
    number; chat: `logprobs` true and `top_logprobs` the number (OpenAI's two shapes)."""
    if chat:
        asked = _flag(body, "logprobs")
        top = _count(body, "top_logprobs")
        if top is not None and not asked and top != 0:
            raise RequestError("top_logprobs", "needs \"logprobs\": true")
        count = (top or 0) if asked else None
    else:
        count = _count(body, "logprobs")
    if count is not None and stream and not chat:  # a streamed chat's come with its end
        raise RequestError("logprobs", "not supported with \"stream\": true here; send the "
                           "request without streaming")
    return count


def _common(body: dict[str, Any]) -> tuple[bool, StreamOptions]:
    """`stream` (OpenAI's default false, whatever the native config says) and its options."""
    stream = _flag(body, "stream")
    return stream, _stream_options(body, stream)


def parse_completion(payload: Any, content_type: str, config: HandlerConfig
                     ) -> CompletionRequest:
    """POST v1/completions: {"model", "prompt", "max_tokens", ...}, parsed once."""
    body = check_fields(decode_json(payload, content_type), COMPLETION_FIELDS)
    stream, options = _common(body)
    echo = _flag(body, "echo")
    if echo and stream:
        raise RequestError("echo", "not supported with \"stream\": true here")
    logprobs = _logprobs(body, chat=False, stream=stream)
    prompt = completion_prompt(body)
    # max_tokens 0 with echo scores the prompt alone (lm-evaluation-harness, vLLM): one
    # token is generated and not shown
    score_only = echo and body.get("max_tokens") == 0
    if score_only:
        body["max_tokens"] = 1
    params = read_params(body, config, COMPLETION_NAMES,
                         prompt=prompt if isinstance(prompt, str) else ASSEMBLED,
                         logprobs=logprobs, prompt_logprobs=logprobs if echo else None)
    return CompletionRequest(body.get("model"), params, stream, options, logprobs,
                             prompt=prompt, echo=echo, score_only=score_only)


def completion_prompt(body: dict[str, Any]) -> str | tuple[int, ...]:
    """One prompt: text, or token ids (lm-evaluation-harness sends [[ids]] by default). Text
    must have something in it, as natively (read_params checks it)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list):
        raise RequestError("prompt", "send one prompt per request: a string, a list of token "
                           "ids, or a list holding one of them (lm-evaluation-harness: "
                           "batch_size=1)")
    if not isinstance(prompt, str):
        raise RequestError("prompt", f"required: a non-empty string, got {brief(prompt)}")
    return prompt


def parse_chat(payload: Any, content_type: str, config: HandlerConfig) -> ChatRequest:
    """POST v1/chat/completions: {"model", "messages", "max_tokens", ...}, parsed once."""
    body = check_fields(decode_json(payload, content_type), CHAT_FIELDS)
    names = CHAT_NAMES
    if "max_completion_tokens" in body:  # the newer name; max_tokens may repeat it
        if body.get("max_tokens", body["max_completion_tokens"]) != body["max_completion_tokens"]:
            raise RequestError("max_completion_tokens", "differs from max_tokens; send one")
        names = CHAT_NEW_NAMES
    stream, options = _common(body)
    logprobs = _logprobs(body, chat=True, stream=stream)
    tools = tool_calls.parse_tools(body)
    messages, tool_turn, chars = parse_messages(body)
    params = read_params(body, config, names, prompt_chars=chars, logprobs=logprobs)
    grammar = params.sampling.grammar
    if grammar is not None and tools is not None and tools.forced:
        raise RequestError("response_format", f"cannot be combined with tool_choice "
                           f"{brief(tools.choice)}, which forces the answer's shape itself; "
                           "send one of them")
    return ChatRequest(body.get("model"), params, stream, options, logprobs,
                       messages=messages, tools=tools, tool_turn=tool_turn,
                       response_format=grammar,
                       template_kwargs=template_kwargs(body.get("chat_template_kwargs")))


def template_kwargs(value: Any) -> Mapping[str, Any] | None:
    """A chat request's `chat_template_kwargs` (vLLM's field): more variables for the
    template, such as Qwen3's {"enable_thinking": false}; none may replace what the
    renderer passes itself."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("chat_template_kwargs", "expected an object of template "
                           "variables, such as {\"enable_thinking\": false}")
    for key in value:
        if not key.isidentifier() or key.startswith("_") or key in RESERVED_KWARGS:
            raise RequestError(f"chat_template_kwargs.{key}", "not allowed: a template "
                               "variable is a name (letters, digits, _) that the server "
                               "does not set itself (messages, tools, add_generation_prompt, "
                               "the special tokens...)")
    return MappingProxyType(dict(value))


def _content(value: Any, where: str) -> str:
    """A message's text: a string or a list of {"type": "text", "text": ...} parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in value):
        return "\n".join(p["text"] for p in value)
    raise RequestError(f"{where}.content", "expected a string or a list of text parts "
                       "({\"type\": \"text\", \"text\": ...}); images and audio are not supported")


def parse_messages(body: dict[str, Any]
                   ) -> tuple[tuple[dict[str, Any], ...], str | None, int]:
    """The chat's messages as the template reads them, where the first message that needs
    a template with a tool format is (a tool result, an assistant's `tool_calls`), and how
    many characters of text they hold (a prompt's size limit applies before rendering)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "required: a non-empty list of {\"role\", \"content\"} "
                           "objects")
    out: list[dict[str, Any]] = []
    tool_turn, chars = None, 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(where, f"expected an object, got {brief(message)}")
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role", f"{brief(role)} is not allowed; choose one of "
                               f"{', '.join(repr(r) for r in ROLES)}")
        allowed = MESSAGE_KEYS + TOOL_KEYS.get(role, ())
        extra = [k for k, v in message.items() if k not in allowed and v is not None]
        if extra:
            raise RequestError(f"{where}.{extra[0]}", f"not supported in a {role!r} message; "
                               f"it has {', '.join(allowed)}")
        reasoning = _reasoning(message, where)
        if message.get("tool_calls") is not None:
            tool_turn = tool_turn or f"{where}.tool_calls"
            entry = tool_calls.chat_message(message, where)
        else:
            if role == "tool":
                tool_turn = tool_turn or f"{where}.role"
            entry = {"role": ROLES[role], "content": _content(message.get("content"), where)}
            if role == "tool" and message.get("tool_call_id") is not None:
                entry["tool_call_id"] = str(message["tool_call_id"])
        chars += len(entry["content"])
        if reasoning is not None:
            entry["reasoning_content"] = reasoning
        out.append(entry)
    return tuple(out), tool_turn, chars


def _reasoning(message: dict[str, Any], where: str) -> str | None:
    """An assistant turn's reasoning as a client sends it back, under either name the
    answers carry (handlers/api/openai_framing.reasoning_fields)."""
    found = None
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise RequestError(f"{where}.{key}", "expected a string (the reasoning of an "
                               "earlier answer, as it came)")
        found = found if found is not None else value
    return found
