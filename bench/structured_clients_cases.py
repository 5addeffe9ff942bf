"""The client half of bench/structured_clients_run.py: LangChain and Instructor, unmodified.

Runs in the clients' own virtual environment (langchain-openai, instructor and the openai
version they pin; none of the toolkit is importable there), against the router URL and
models the run passes: INF2SERVE_BASE_URL, INF2SERVE_TOKEN (the inference key: in the
environment, not on the command line), INF2SERVE_JSON_MODEL (a model whose template has no
tool format: the json_schema cases), INF2SERVE_TOOLS_MODEL (one whose template has: the
forced-tool-call cases). Prints one JSON object on stdout: the packages' versions and, per
case, what the client sent (each request's method, path and body, seen through an httpx
event hook on the client's own http client), the finish_reason, the parsed object and
whether it is an instance of the model that validates, or the error.

The models are shaped for a random-weight model under a grammar: every field closes within
a few tokens once the mask forces it (enums, bounded integers, booleans, strings of at most
12 characters, a list of at most 2), so a greedy answer ends with `stop` well within
MAX_TOKENS.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import traceback
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field

MAX_TOKENS = 200
SEED = 7
PROMPT = "Extract the order: two red mugs for Ana, shipped to Lisbon, paid."


class Address(BaseModel):
    city: str = Field(max_length=12)
    zone: int = Field(ge=1, le=9)


class Order(BaseModel):
    """An order, as a client extracting one would declare it."""

    customer: str = Field(max_length=12)
    # a Literal, not an Enum class: instructor 1.17's create_partial fails an Enum field
    # on its own final check ("Input should be an instance of Colour", given "red")
    colour: Literal["red", "green", "blue"]
    quantity: int = Field(ge=1, le=20)
    paid: bool
    ship_to: Address
    tags: list[str] = Field(max_length=2)


class Recorder:
    """An httpx client whose request hook keeps what each request sent (never its
    Authorization header): the body as the client library built it."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.client = httpx.Client(timeout=120, event_hooks={"request": [self._record]})

    def _record(self, request: httpx.Request) -> None:
        try:
            body = json.loads(request.content) if request.content else None
        except ValueError:
            body = request.content.decode("utf-8", "replace")
        self.sent.append({"method": request.method, "path": request.url.path, "body": body})

    def take(self) -> list[dict[str, Any]]:
        sent, self.sent = self.sent, []
        return sent


def dump(obj: Any) -> Any:
    return obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj


def finish_reason(raw: Any) -> str | None:
    """The finish_reason of an openai ChatCompletion or a LangChain AIMessage."""
    if hasattr(raw, "choices"):
        return raw.choices[0].finish_reason
    return (getattr(raw, "response_metadata", None) or {}).get("finish_reason")


def langchain_cases(base_url: str, token: str, model: str, rec: Recorder) -> list[dict]:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key=token, model=model, temperature=0, seed=SEED,
                     max_tokens=MAX_TOKENS, max_retries=0, http_client=rec.client)
    structured = llm.with_structured_output(Order, method="json_schema", strict=True)
    with_raw = llm.with_structured_output(Order, method="json_schema", strict=True,
                                          include_raw=True)

    def invoke() -> dict:
        out = structured.invoke(PROMPT)
        return {"parsed": out, "finish_reason": None}

    def invoke_raw() -> dict:
        out = with_raw.invoke(PROMPT)
        raw = out["raw"]
        return {"parsed": out["parsed"], "finish_reason": finish_reason(raw),
                "raw_content": raw.content, "parsing_error": repr(out["parsing_error"])
                if out["parsing_error"] else None}

    def stream() -> dict:
        parts = list(structured.stream(PROMPT))
        return {"parsed": parts[-1] if parts else None, "finish_reason": None,
                "partials": len(parts)}

    return [
        run_case("langchain", "with_structured_output json_schema strict, invoke", model,
                 invoke, rec),
        run_case("langchain", "with_structured_output json_schema strict, include_raw", model,
                 invoke_raw, rec),
        run_case("langchain", "with_structured_output json_schema strict, stream", model,
                 stream, rec),
    ]


def instructor_cases(base_url: str, token: str, json_model: str, tools_model: str,
                     rec: Recorder) -> list[dict]:
    import instructor
    from openai import OpenAI

    openai = OpenAI(base_url=base_url, api_key=token, max_retries=0, http_client=rec.client)
    ask = [{"role": "user", "content": PROMPT}]
    common = {"messages": ask, "temperature": 0, "seed": SEED, "max_tokens": MAX_TOKENS,
              "max_retries": 0}
    out = []
    for mode, model in ((instructor.Mode.JSON_SCHEMA, json_model),
                        (instructor.Mode.TOOLS, tools_model)):
        client = instructor.from_openai(openai, mode=mode)

        def create(client=client, model=model) -> dict:
            order, completion = client.chat.completions.create_with_completion(
                model=model, response_model=Order, **common)
            message = completion.choices[0].message
            return {"parsed": order, "finish_reason": finish_reason(completion),
                    "raw_content": message.content,
                    "raw_tool_calls": [c.model_dump() for c in message.tool_calls or ()]}

        def partial(client=client, model=model) -> dict:
            parts = list(client.chat.completions.create_partial(
                model=model, response_model=Order, **common))
            final = Order.model_validate(parts[-1].model_dump()) if parts else None
            return {"parsed": final, "finish_reason": None, "partials": len(parts)}

        out.append(run_case("instructor", f"{mode.name}, create_with_completion", model,
                            create, rec))
        out.append(run_case("instructor", f"{mode.name}, create_partial (stream)", model,
                            partial, rec))

    def refused() -> dict:  # the Llama-2 template has no format to write a call in
        from openai import BadRequestError

        try:
            instructor.from_openai(openai, mode=instructor.Mode.TOOLS).chat.completions.create(
                model=json_model, response_model=Order, **common)
        except Exception as exc:  # instructor may wrap the client's error: walk the chain
            cause: BaseException | None = exc
            while cause is not None and not isinstance(cause, BadRequestError):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            return {"parsed": None, "finish_reason": None, "status": cause.status_code,
                    "server_error": cause.body}
        return {"parsed": None, "finish_reason": None, "status": 200}

    out.append(run_case("instructor", "TOOLS, create_with_completion, a template without a "
                        "tool format (expected: 400 naming tool_choice)", json_model, refused,
                        rec))
    return out


def run_case(client: str, case: str, model: str, call, rec: Recorder) -> dict:
    entry: dict[str, Any] = {"client": client, "case": case, "model": model}
    try:
        got = call()
        parsed = got.pop("parsed")
        entry.update(got)
        entry["parsed"] = dump(parsed)
        entry["is_order"] = isinstance(parsed, Order)
        entry["validates"] = isinstance(parsed, Order) and bool(
            Order.model_validate(parsed.model_dump()))
        entry["error"] = None
    except Exception as exc:  # the verdict records it: the run goes on to the next case
        entry.update(parsed=None, is_order=False, validates=False,
                     error=f"{type(exc).__name__}: {exc}"[:2000],
                     traceback=traceback.format_exc()[-2000:])
    entry["sent"] = rec.take()
    return entry


def main() -> int:
    base_url, token = os.environ["INF2SERVE_BASE_URL"], os.environ["INF2SERVE_TOKEN"]
    json_model = os.environ["INF2SERVE_JSON_MODEL"]
    tools_model = os.environ["INF2SERVE_TOOLS_MODEL"]
    rec = Recorder()
    versions = {name: importlib.metadata.version(name) for name in (
        "langchain-openai", "langchain-core", "instructor", "openai", "pydantic", "httpx")}
    versions["python"] = sys.version.split()[0]
    cases = langchain_cases(base_url, token, json_model, rec)
    cases += instructor_cases(base_url, token, json_model, tools_model, rec)
    json.dump({"versions": versions, "schema": Order.model_json_schema(), "cases": cases},
              sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
