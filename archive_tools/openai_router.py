"""One OpenAI base URL for every served model: `/v1/models` lists them all, and
`/v1/chat/completions` and `/v1/completions` go to the model the body names.

TorchServe 0.12 serves each model's OpenAI API under its own prefix
(`/predictions/{model}/{version}/v1`), and cannot carry a root `/v1` itself: an endpoint
plugin answers with one whole `FullHttpResponse` after it returns, so it cannot stream,
and its context cannot reach a worker (docs/design.md cites the lines). vLLM's and TGI's
users, and chat UIs (Open WebUI's `OPENAI_API_BASE_URLS`, HF chat-ui's `OPENAI_BASE_URL`),
expect one base URL. So `inf2serve serve` runs this small router beside TorchServe: it
reads only the `model` field, forwards the request unchanged -- the client's bearer token
included, so TorchServe's own token check is the only auth -- and copies the answer back
chunk by chunk as it arrives.

It is also the server's one Prometheus scrape target (docs/monitoring.md): `/metrics`
serves every worker's metrics under vLLM's names, read from the files the workers write
(handlers/telemetry), followed by TorchServe's own metrics and, with `--neuron-monitor`, the
device exporter's, each fetched from its port on loopback at scrape time. Like TorchServe's
metrics port it asks for no token.

A client that leaves frees its slot within a step. TorchServe 0.12 tells a worker nothing
of a disconnect (docs/design.md), but this router holds the client's connection: it names
each request it forwards (the `x-inf2serve-client-id` header), and when the client goes
away -- a chat UI's stop button, a closed tab -- it POSTs that name to the model's
`inf2serve/cancel` path, with the client's own token, and the handler ends the request.

No answer looks complete unless it is. An upstream stream cut short (TorchServe cuts
streams when a worker dies) ends, for the client, with an SSE error event and a connection
closed without the chunked terminator -- as vLLM ends a stream on an engine error -- so
the `openai` client raises instead of returning a truncated answer; a non-streamed answer
is read whole before it is sent, and a cut one is a 502. Every error, the router's own
(malformed body, unknown path, wrong method, body too large) and TorchServe's (503 no
worker, 507 out of memory...), is OpenAI's JSON error object. Nothing waits unbounded:
relays give up after READ_TIMEOUT_S of upstream silence, cancel POSTs after
CANCEL_TIMEOUT_S, and at most MAX_PENDING_CANCELS are on their way at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from archive_tools import pids
from handlers.api.openai_framing import error_object as error
from handlers.api.openai_framing import sse
from handlers.api.request import brief, decode_body
from handlers.errors import Inf2ServeError, RequestError
from handlers.telemetry.exposition import CONTENT_TYPE, render

log = logging.getLogger("inf2serve.router")
#: TorchServe's own default max_request_size: a bigger body would be a 413 there anyway
MAX_BODY = 6_553_500
ROUTED = ("chat/completions", "completions")
#: the name the router gives each forwarded request (handlers/torchserve/generation_handler.py)
CLIENT_ID_HEADER = "x-inf2serve-client-id"
#: headers passed to TorchServe, and back to the client
REQUEST_HEADERS = ("authorization", "content-type", "accept")
RESPONSE_HEADERS = ("content-type", "retry-after", "www-authenticate")
#: upstream silence after which a relay gives up: longer than any responseTimeout in the
#: shipped configs (600 s), after which TorchServe itself ends a silent worker's requests
READ_TIMEOUT_S = 900.0
#: a cancel POST's bound, and how many may be on their way at once (a hung TorchServe
#: must not make them pile up); one dropped only leaves its request to run to its end
CANCEL_TIMEOUT_S = 10.0
MAX_PENDING_CANCELS = 256
#: the routes, for the 404 that names them
SERVED = "/v1/models, /v1/chat/completions, /v1/completions, /health"


#: how TorchServe 0.12 refuses a bad token: a 400 with this text (TokenAuthorizationHandler)
TOKEN_REFUSAL = b"Token Authorization failed"


def auth_refusal(status: int, body: bytes) -> dict[str, Any] | None:
    """TorchServe's token refusal as the 401 OpenAI clients know (the `openai` client raises
    AuthenticationError, chat UIs ask for a new key); None for any other answer."""
    if status == 400 and TOKEN_REFUSAL in body[:500]:
        return error(401, "the token was refused (wrong or expired); get a fresh one with "
                     "`inf2serve token`")
    return None


@dataclass(frozen=True)
class Upstream:
    """TorchServe's inference address and the served models (name -> version)."""

    url: str
    models: dict[str, str]

    def base(self, model: str) -> str:
        return f"{self.url}/predictions/{model}/{self.models[model]}/v1"

    def cancel_url(self, model: str) -> str:
        return f"{self.url}/predictions/{model}/{self.models[model]}/inf2serve/cancel"


@dataclass(frozen=True)
class MetricsSources:
    """What /metrics serves: the workers' files, then each exporter's text, in order."""

    directory: str = ""  # INF2SERVE_METRICS_DIR of the server's workers
    upstreams: tuple[tuple[str, str], ...] = ()  # (name, URL of its /metrics)

    def args(self) -> list[str]:
        return [*(["--metrics-dir", self.directory] if self.directory else []),
                *[a for name, url in self.upstreams for a in ("--metrics-from", f"{name}={url}")]]


#: TorchServe's own error statuses, with what they mean here (ts/async_service.py:49-81,
#: the frontend's "no worker" 503)
TORCHSERVE_ERRORS = {503: "no worker of the model is ready (loading, or restarting after a "
                          "failure) or its prediction failed; retry shortly",
                     507: "the model's worker ran out of memory"}


def upstream_error(status: int, body: bytes) -> tuple[int, dict[str, Any]]:
    """TorchServe's or the handler's error answer as (status, OpenAI's error object). The
    handler's errors are OpenAI's already; TorchServe's own are {"code", "type",
    "message"} (NettyUtils.sendError) or a reason phrase, and its token refusal is a 400
    that OpenAI clients know as a 401."""
    refused = auth_refusal(status, body)
    if refused is not None:
        return 401, refused
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return status, data
    message = data.get("message") if isinstance(data, dict) else None
    if not isinstance(message, str) or not message:
        message = body[:200].decode("utf-8", "replace").strip() or f"status {status}"
    meaning = TORCHSERVE_ERRORS.get(status)
    return status, error(status, f"{meaning} (TorchServe: {message})" if meaning
                         else f"TorchServe answered {status}: {message}")


def pick_model(body: bytes, models: dict[str, str]) -> tuple[str | None, dict | None]:
    """(model, None), or (None, an error to answer): the body's `model`, which may be left
    out only when one model is served. A body that is no JSON object is named as the
    per-model URL names it (handlers/api/request.decode_body)."""
    if not body:
        return None, error(400, "empty request body; send a JSON object")
    try:
        data = decode_body(body, "application/json")
    except RequestError as exc:  # OpenAI names no param for a body it cannot read
        return None, error(exc.status, exc.message)
    name = data.get("model")
    if name is None and len(models) == 1:
        return next(iter(models)), None
    if name is None:
        return None, error(400, f"name the model; served: {', '.join(sorted(models))}",
                           "model")
    if name not in models:
        return None, error(404, f"the model {brief(name)} does not exist; served: "
                           f"{', '.join(sorted(models))} (GET /v1/models lists them)", "model")
    return name, None


def make_app(upstream: Upstream, read_timeout_s: float = READ_TIMEOUT_S,
             metrics: MetricsSources | None = None) -> Any:
    """The aiohttp application (imported here: the runtime never needs aiohttp's server)."""
    import aiohttp
    from aiohttp import web

    timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=read_timeout_s)
    cancel_timeout = aiohttp.ClientTimeout(total=CANCEL_TIMEOUT_S)
    client_key = web.AppKey("client", aiohttp.ClientSession)

    async def session(app: web.Application):
        app[client_key] = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        yield
        await app[client_key].close()

    def forwarded(request: web.Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in REQUEST_HEADERS}

    def answer(status: int, body: dict, headers: dict[str, str] | None = None) -> web.Response:
        return web.json_response(body, status=status, headers=headers)

    def unreachable(exc: BaseException) -> web.Response:
        if isinstance(exc, asyncio.TimeoutError):
            return answer(504, error(504, f"TorchServe sent nothing for {read_timeout_s:g}s"))
        return answer(502, error(502, f"TorchServe did not answer: {exc}"))

    @web.middleware
    async def json_errors(request: web.Request, handler) -> web.StreamResponse:
        """aiohttp's own refusals (no route, wrong method, body too large) in OpenAI's
        JSON, as the per-model URL answers."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            headers = {}
            if isinstance(exc, web.HTTPMethodNotAllowed):
                allowed = ", ".join(sorted(exc.allowed_methods))
                headers["Allow"] = allowed
                message = f"{request.method} is not allowed on {request.path}; use {allowed}"
            elif isinstance(exc, web.HTTPRequestEntityTooLarge):
                message = (f"the request body is over {MAX_BODY} bytes, TorchServe's limit "
                           "(max_request_size)")
            elif isinstance(exc, web.HTTPNotFound):
                message = f"no such path {brief(request.path)}; served: {SERVED}"
            else:
                message = exc.reason
            return answer(exc.status, error(exc.status, message), headers)

    async def refused(request: web.Request) -> web.Response | None:
        """TorchServe's token check, before anything that lists the served models: its
        /ping checks the client's token (0.12). None when the token passes."""
        try:
            async with request.app[client_key].get(f"{upstream.url}/ping",
                                                   headers=forwarded(request)) as r:
                body = await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return unreachable(exc)
        verdict = auth_refusal(r.status, body)
        return None if verdict is None else answer(401, verdict)

    async def models(request: web.Request) -> web.Response:
        """Every model's own listing, merged; a refusal (a bad token) is passed on."""
        client: aiohttp.ClientSession = request.app[client_key]

        async def one(name: str) -> tuple[int, Any]:
            async with client.get(f"{upstream.base(name)}/models",
                                  headers=forwarded(request)) as r:
                body = await r.read()
                return upstream_error(r.status, body) if r.status != 200 else (
                    200, json.loads(body))

        try:
            answers = await asyncio.gather(*(one(m) for m in upstream.models))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return unreachable(exc)
        except ValueError as exc:
            return answer(502, error(502, f"TorchServe's model listing is no JSON: {exc}"))
        for status, body in answers:
            if status != 200:
                return answer(status, body)
        data = [card for _, body in answers for card in body.get("data", [])]
        return web.json_response({"object": "list", "data": data})

    async def model(request: web.Request) -> web.StreamResponse:
        name = request.match_info["model"]
        if name not in upstream.models:
            return await refused(request) or answer(
                404, error(404, "no such model; GET /v1/models lists them", "model"))
        return (await relay(request, f"{upstream.base(name)}/models/{name}", b""))[0]

    pending: set[asyncio.Task] = set()  # cancels on their way, kept from the collector

    async def cancel(request: web.Request, model: str, client_id: str) -> None:
        """Tell the model that this client left (its own token authorizes it)."""
        client: aiohttp.ClientSession = request.app[client_key]
        headers = {k: v for k, v in forwarded(request).items() if k.lower() == "authorization"}
        try:
            async with client.post(upstream.cancel_url(model), json={"client_id": client_id},
                                   headers=headers, timeout=cancel_timeout) as r:
                answered = (await r.read())[:100].decode("utf-8", errors="replace")
                log.info("client %s left: cancel answered %s %s", client_id, r.status,
                         " ".join(answered.split()))  # text, not a bytes repr
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("client %s left; the cancel failed: %r", client_id, exc)

    def cancel_later(request: web.Request, model: str, client_id: str) -> None:
        if len(pending) >= MAX_PENDING_CANCELS:
            log.warning("client %s left; %d cancels already wait on TorchServe, so its "
                        "request runs to its end", client_id, len(pending))
            return
        task = asyncio.get_running_loop().create_task(cancel(request, model, client_id))
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def routed(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        name, refusal = pick_model(body, upstream.models)
        if refusal is not None:  # the token first: a refusal may list the served models
            return await refused(request) or answer(refusal["error"]["code"], refusal)
        client_id = uuid.uuid4().hex
        finished = False
        try:
            response, finished = await relay(request, f"{upstream.base(name)}/"
                                             f"{request.match_info['path']}", body, client_id)
            return response
        finally:
            if not finished:  # the client left (or the relay was cancelled): free its slot
                cancel_later(request, name, client_id)

    async def relay(request: web.Request, url: str, body: bytes,
                    client_id: str = "") -> tuple[web.StreamResponse, bool]:
        """The upstream answer -- an event stream chunk by chunk as it arrives, anything
        else whole -- and whether the upstream request is over (False: the client left,
        or TorchServe went silent, and it may still run)."""
        client: aiohttp.ClientSession = request.app[client_key]
        headers = forwarded(request)
        if client_id:
            headers[CLIENT_ID_HEADER] = client_id
        try:
            upstream_response = await client.request(request.method, url, data=body or None,
                                                     headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return unreachable(exc), not isinstance(exc, asyncio.TimeoutError)
        async with upstream_response as r:
            kept = {k: v for k, v in r.headers.items() if k.lower() in RESPONSE_HEADERS}
            if "text/event-stream" not in r.headers.get("Content-Type", "") or r.status != 200:
                try:
                    data = await r.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    log.info("answer to %s cut short: %r", request.remote, exc)
                    return unreachable(exc), not isinstance(exc, asyncio.TimeoutError)
                if r.status != 200:  # its JSON body replaces TorchServe's, headers aside
                    status, shaped = upstream_error(r.status, data)
                    return answer(status, shaped, {
                        k: v for k, v in kept.items() if k.lower() != "content-type"}), True
                return web.Response(status=200, body=data, headers=kept), True
            out = web.StreamResponse(status=200, headers=kept)
            await out.prepare(request)
            try:
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
            except ConnectionResetError:  # the client left
                return out, False
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                log.info("stream to %s cut short: %r", request.remote, exc)
                await cut(request, out, exc)
                return out, not isinstance(exc, asyncio.TimeoutError)
            await out.write_eof()
            return out, True

    async def cut(request: web.Request, out: web.StreamResponse, exc: BaseException) -> None:
        """A stream TorchServe cut (or left silent) ends, for the client, as one that
        failed: an error event, then the connection closed without the chunked
        terminator (aiohttp's write_eof then finds it closing and lets it be)."""
        status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
        message = (f"TorchServe sent nothing for {read_timeout_s:g}s"
                   if status == 504 else "TorchServe ended the stream early (a worker died?)"
                   "; the answer is incomplete")
        try:
            await out.write(sse(error(status, message)).encode())
        except ConnectionResetError:
            return
        if request.transport is not None:
            request.transport.close()  # flushes what is written, then closes: no terminator

    async def health(request: web.Request) -> web.Response:
        try:
            # TorchServe 0.12 wants the inference token on /ping too: the client's is passed
            async with request.app[client_key].get(f"{upstream.url}/ping",
                                                   headers=forwarded(request)) as r:
                body = await r.read()
                if r.status != 200:
                    return answer(*upstream_error(r.status, body))
                return web.json_response(json.loads(body), status=r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return unreachable(exc)
        except ValueError as exc:
            return answer(502, error(502, f"TorchServe's /ping is no JSON: {exc}"))

    async def scrape(request: web.Request) -> web.Response:
        sources = metrics or MetricsSources()

        async def fetch(url: str) -> bytes | None:
            try:
                async with request.app[client_key].get(
                        url, headers={"Accept-Encoding": "identity"},
                        timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return await r.read() if r.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return None

        texts = await asyncio.gather(*(fetch(url) for _, url in sources.upstreams))
        directory = Path(sources.directory) if sources.directory else None
        body = await asyncio.to_thread(
            render, directory, [(name, text) for (name, _), text in zip(sources.upstreams, texts,
                                                                         strict=True)])
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    app = web.Application(client_max_size=MAX_BODY, middlewares=[json_errors])
    app.cleanup_ctx.append(session)
    app.router.add_get("/metrics", scrape)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_post("/v1/{path:chat/completions|completions}", routed)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    return app


PID_FILE = "openai_router.pid"
LOG_FILE = "openai_router.log"
#: routers started by this process, reaped when stopped (a test's server, not the CLI's)
_CHILDREN: dict[int, subprocess.Popen] = {}


def start(run_dir: Path, upstream: Upstream, port: int, timeout_s: float = 30,
          metrics: MetricsSources | None = None) -> str:
    """Run the router as its own process (it outlives `inf2serve serve`, as TorchServe does)
    and return its base URL once it answers; its pid goes to RUN_DIR/openai_router.pid."""
    stop(run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "archive_tools.openai_router", "--upstream", upstream.url,
           "--port", str(port), *[a for name, version in upstream.models.items()
                                  for a in ("--model", f"{name}={version}")],
           *(metrics.args() if metrics else [])]
    with open(logs / LOG_FILE, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=Path(__file__).resolve().parents[1])
    (run_dir / PID_FILE).write_text(str(proc.pid))
    _CHILDREN[proc.pid] = proc
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/ping", timeout=2).status_code < 500:
                return f"{url}/v1"
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(run_dir)
    raise Inf2ServeError(f"the OpenAI router did not start on port {port}; see "
                         f"{logs / LOG_FILE}")


def terminate(run_dir: Path) -> list[int]:
    """SIGTERM the router of `run_dir`, if one runs, without waiting: its pid, or none."""
    path = run_dir / PID_FILE
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return []
    path.unlink(missing_ok=True)
    _CHILDREN.pop(pid, None)  # reaped by pids.end
    return [pid] if pids.terminate_if(pid, b"archive_tools.openai_router") else []


def stop(run_dir: Path) -> bool:
    """Stop the router of `run_dir`, if one runs; True if it did."""
    signalled = terminate(run_dir)
    pids.end(signalled, 5)
    return bool(signalled)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="TorchServe's inference URL")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=VERSION",
                        help="a served model and its version (repeat)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S, metavar="S",
                        help="seconds of upstream silence after which a relay gives up "
                        f"(default {READ_TIMEOUT_S:g})")
    parser.add_argument("--metrics-dir", default="", help="the workers' metrics files")
    parser.add_argument("--metrics-from", action="append", default=[], metavar="NAME=URL",
                        help="an exporter whose /metrics text /metrics appends (repeat)")
    args = parser.parse_args(argv)
    from aiohttp import web

    models = dict(spec.split("=", 1) for spec in args.model)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # handler_cancellation: a client that leaves cancels its handler at once, also while
    # the answer is not streamed, so its request is cancelled upstream (routed's finally)
    metrics = MetricsSources(args.metrics_dir, tuple(
        tuple(spec.split("=", 1)) for spec in args.metrics_from))
    web.run_app(make_app(Upstream(args.upstream.rstrip("/"), models), args.read_timeout,
                         metrics=metrics),
                host=args.host, port=args.port, print=None, access_log=None,
                handler_cancellation=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
