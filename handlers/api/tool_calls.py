"""OpenAI tool calling: what a request's `tools` / `tool_choice` ask, and tool calls read
back out of the generated text.

A model calls tools only as its chat template teaches it to: the template renders the
tool definitions into the prompt (Llama 3.1+ writes them as JSON into the first user
turn), and the model answers with a JSON call. So the server (1) validates the request's
tools, (2) renders them through the model's own template when that template has a tool
format (probed once per template: a tool named here must show up in the rendered prompt),
and (3) reads the calls back out of the answer in the format the template teaches
(handlers/api/tool_parsers: one class per format, picked by how the template renders a
probe call). Anything that is not, whole, calls of the offered tools is the content the
model wrote, with finish_reason "stop" (or "length") -- never a failed request. `required`
or a named tool is enforced by a grammar of the offered functions' calls in the template's
format (handlers/api/openai.forced_calls; handlers/structured), so the answer is calls
with finish_reason "tool_calls" unless `max_tokens` cuts it ("length").

A template without a tool format answers `auto` and `none` as plain chat (the tools are
not rendered), as a chat UI that always sends its built-in tools expects; `required` or a
named tool is a 400 naming `tool_choice`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from handlers.api.chat_template import rendered_probe_call, tool_format
from handlers.api.request import brief
from handlers.api.tool_parsers import ToolCallReader, parser_for
from handlers.errors import RequestError


@dataclass(frozen=True)
class ToolRequest:
    """The request's tools (OpenAI's shape, validated) and its choice: 'auto', 'none',
    'required' or the name of one tool."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    named: bool = False  # choice names one tool
    forced: bool = False  # "required" or named: the answer must be calls (a grammar says so)

    def rendered(self) -> list[dict[str, Any]]:
        """The tools the prompt shows: all of them, or the named one."""
        if self.named:
            return [t for t in self.tools if t["function"]["name"] == self.choice]
        return list(self.tools)


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools, or None when it has none (or `tool_choice: "none"` with none)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise RequestError("tool_choice", f"{brief(choice)} needs tools; the request has "
                               "none")
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", f"expected a list of {{\"type\": \"function\", "
                           f"\"function\": {{...}}}} objects, got {brief(tools)}")
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RequestError(f"{where}.type", "expected \"function\" (the only tool type)")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"{where}.function", "expected an object with name, "
                               "description and parameters")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise RequestError(f"{where}.function.name", "expected a name of 1 to 64 "
                               f"characters, got {brief(name)}")
        if not isinstance(function.get("parameters", {}), dict):
            raise RequestError(f"{where}.function.parameters", "expected a JSON Schema object")
        names.append(name)
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError("tool_choice", "expected \"none\", \"auto\", \"required\" or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in names:
            raise RequestError("tool_choice.function.name", f"{brief(name)} is not among the "
                               "request's tools")
        return ToolRequest(tuple(tools), name, named=True, forced=True)
    if choice not in ("none", "auto", "required"):
        raise RequestError("tool_choice", f"{brief(choice)} is not allowed; choose \"none\", "
                           "\"auto\", \"required\" or a named function")
    return ToolRequest(tuple(tools), choice, forced=choice == "required")


def chat_message(message: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant turn's `tool_calls` in the shape chat templates read (Hugging Face's:
    arguments as an object, where OpenAI sends a JSON string)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise RequestError(f"{where}.tool_calls", "expected a non-empty list of tool calls")
    out = []
    for i, call in enumerate(calls):
        at = f"{where}.tool_calls[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{at}.function", "expected {\"name\", \"arguments\"}")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as exc:
                raise RequestError(f"{at}.function.arguments", "expected a JSON object "
                                   "(as a string)") from exc
        if not isinstance(arguments, dict):
            raise RequestError(f"{at}.function.arguments", "expected a JSON object")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return {"role": "assistant", "content": message.get("content") or "", "tool_calls": out}


def call_reader(tokenizer: Any, setting: str, tools: list[dict[str, Any]]) -> ToolCallReader:
    """How the answer's calls are read: the format the chat template teaches (its probe
    call, rendered once per template), and the tools the prompt showed."""
    return ToolCallReader.of(parser_for(rendered_probe_call(tokenizer, setting)), tools)


def for_template(asked: ToolRequest | None, tool_turn: str | None, tokenizer: Any,
                 setting: str) -> tuple[list[dict[str, Any]] | None, ToolCallReader | None]:
    """What the chat template's tool format makes of a request: the tools its prompt shows
    and how the answer's calls are read, or (None, None) for plain chat. A template without
    a tool format answers `auto` and `none` as plain chat; `required` or a named tool is a
    400 naming tool_choice, and a tool result or an assistant's tool_calls (`tool_turn`,
    where the first is) one naming that message."""
    if asked is None and tool_turn is None:
        return None, None
    fmt = tool_format(tokenizer, setting)
    if asked is not None and asked.forced and not fmt.takes_tools:
        raise RequestError("tool_choice", f"{asked.choice!r} needs a model that calls "
                           "tools, and this model's chat template has no tool format; "
                           "send \"auto\" or \"none\" (answered as plain chat)")
    if tool_turn is not None and not fmt.takes_tools:
        raise RequestError(tool_turn, "this model's chat template has no tool format, so it "
                           "cannot read tool calls or results; send plain messages")
    if asked is None or not fmt.takes_tools or asked.choice == "none":
        return None, None
    tools = asked.rendered()
    return tools, ToolCallReader.of(parser_for(fmt.probe_call), tools)
