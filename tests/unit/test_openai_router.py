"""The one-base-URL router against a stand-in for TorchServe's per-model OpenAI routes:
listing, routing by `model`, the token passed through, streams relayed as they come."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from archive_tools.openai_router import Upstream, make_app, pick_model

TOKEN = "secret"
MODELS = {"alpha": "1.0", "beta": "2.0"}


def fake_torchserve(seen: list[tuple[str, bytes]], gate: asyncio.Event) -> web.Application:
    """Per-model routes as TorchServe + the handler answer them; a bad token is a 401."""

    def authorized(request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {TOKEN}"

    async def models(request: web.Request) -> web.Response:
        if not authorized(request):
            return web.json_response({"code": 400, "message": "Token Authorization failed. "
                                      "Token either incorrect, expired, or not provided "
                                      "correctly"}, status=400)  # TorchServe 0.12's answer
        name = request.match_info["model"]
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        seen.append((request.path, body))
        seen.append(("client-id", request.headers.get("x-inf2serve-client-id", "").encode()))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"first": true}\n\n')
        await gate.wait()  # the second event only once the test has seen the first
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def cancel(request: web.Request) -> web.Response:
        seen.append((request.path, await request.read()))
        seen.append(("cancel-auth", request.headers.get("Authorization", "").encode()))
        return web.json_response({"cancelled": True})

    async def ping(request: web.Request) -> web.Response:
        if not authorized(request):  # TorchServe 0.12 checks the token on /ping too
            return web.json_response({"code": 400, "type": "InvalidKeyException"}, status=400)
        return web.json_response({"status": "Healthy"})

    app = web.Application()
    app.router.add_get("/predictions/{model}/{version}/v1/models", models)
    app.router.add_post("/predictions/{model}/{version}/v1/chat/completions", chat)
    app.router.add_post("/predictions/{model}/{version}/inf2serve/cancel", cancel)
    app.router.add_get("/ping", ping)
    return app


def run(test) -> None:
    async def go() -> None:
        seen: list[tuple[str, bytes]] = []
        gate = asyncio.Event()
        async with TestServer(fake_torchserve(seen, gate)) as upstream:
            router = make_app(Upstream(str(upstream.make_url("")).rstrip("/"), MODELS))
            async with TestClient(TestServer(router, handler_cancellation=True)) as client:
                await test(client, seen, gate)

    asyncio.run(go())


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_models_lists_every_served_model_with_the_clients_token() -> None:
    async def test(client, seen, gate) -> None:
        r = await client.get("/v1/models", headers=AUTH)
        assert r.status == 200
        assert [m["id"] for m in (await r.json())["data"]] == ["alpha", "beta"]
        refused = await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert refused.status == 401  # TorchServe's own check, as OpenAI clients know it
        assert "inf2serve token" in (await refused.json())["error"]["message"]

    run(test)


def test_a_chat_goes_to_the_model_it_names_and_streams_as_it_comes() -> None:
    async def test(client, seen, gate) -> None:
        body = json.dumps({"model": "beta", "messages": [], "stream": True}).encode()
        r = await client.post("/v1/chat/completions", data=body, headers=AUTH)
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
        assert first == b'data: {"first": true}\n\n'  # before the upstream has finished
        gate.set()
        assert (await r.read()) == b"data: [DONE]\n\n"
        assert seen[0] == ("/predictions/beta/2.0/v1/chat/completions", body)  # unchanged
        assert seen[1][0] == "client-id" and len(seen[1][1]) == 32  # named for a cancel
        await asyncio.sleep(0.1)
        assert len(seen) == 2  # it finished: nothing to cancel

    run(test)


def test_a_client_that_leaves_mid_stream_is_cancelled_upstream_with_its_token(caplog) -> None:
    """TorchServe tells a worker nothing of a disconnect; the router, which holds the
    client's connection, tells the model (generation_handler's inf2serve/cancel), and logs
    its answer as text."""
    caplog.set_level(logging.INFO, logger="inf2serve.router")
    async def test(client, seen, gate) -> None:
        r = await client.post("/v1/chat/completions", headers=AUTH,
                              json={"model": "alpha", "messages": [], "stream": True})
        await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
        r.close()  # the client goes away while the upstream still streams
        for _ in range(50):
            if any(path.endswith("/inf2serve/cancel") for path, _ in seen):
                break
            await asyncio.sleep(0.1)
        gate.set()
        client_id = dict(seen)["client-id"].decode()
        assert ("/predictions/alpha/1.0/inf2serve/cancel",
                json.dumps({"client_id": client_id}).encode()) in seen
        assert ("cancel-auth", f"Bearer {TOKEN}".encode()) in seen
        for _ in range(50):
            if "cancel answered" in caplog.text:
                break
            await asyncio.sleep(0.1)
        assert 'cancel answered 200 {"cancelled": true}' in caplog.text, caplog.text

    run(test)


@pytest.mark.parametrize("body, status, param", [
    ({"messages": []}, 400, "model"),  # two models served: the body must name one
    ({"model": "gamma", "messages": []}, 404, "model"),
    ({"model": "x" * 5000, "messages": []}, 404, "model"),
])
def test_a_body_that_names_no_served_model_is_answered_here(body, status, param) -> None:
    async def test(client, seen, gate) -> None:
        r = await client.post("/v1/chat/completions", json=body, headers=AUTH)
        assert r.status == status
        error = (await r.json())["error"]
        assert error["param"] == param and "alpha, beta" in error["message"]
        assert len(error["message"]) < 200 and not seen

    run(test)


def test_one_served_model_needs_no_name() -> None:
    assert pick_model(b'{"messages": []}', {"only": "1.0"}) == ("only", None)
    assert pick_model(b"[1]", {"only": "1.0"})[1]["error"]["code"] == 400


def test_health_is_torchserves_ping() -> None:
    async def test(client, seen, gate) -> None:
        r = await client.get("/health", headers=AUTH)
        assert r.status == 200 and (await r.json()) == {"status": "Healthy"}

    run(test)


# --- answers that must not look complete, and errors in OpenAI's shape ---

CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "alpha",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                      "finish_reason": None}]}


def scripted_torchserve(cancels: list[str]) -> web.Application:
    """TorchServe as it fails: a chat answers as its body's `script` says."""

    async def chat(request: web.Request) -> web.StreamResponse:
        script = (await request.json()).get("script")
        if script in ("no worker", "out of memory"):  # the frontend's / the worker's refusal
            status = 503 if script == "no worker" else 507
            return web.json_response({"code": status, "type": "ServiceUnavailableException",
                                      "message": f"Model \"alpha\" says {script}"},
                                     status=status, headers={"Retry-After": "3"})
        if script == "handler error":  # the handler's own errors are OpenAI's already
            return web.json_response({"error": {"message": "max_tokens: too big", "code": 400,
                                                "type": "invalid_request_error",
                                                "param": "max_tokens"}}, status=400)
        if script == "silent":
            await asyncio.sleep(30)
        sse = script != "cut json"
        out = web.StreamResponse(headers={
            "Content-Type": "text/event-stream" if sse else "application/json"})
        await out.prepare(request)
        if script == "silent stream":
            await out.write(f"data: {json.dumps(CHUNK)}\n\n".encode())
            await asyncio.sleep(30)
        await out.write(f"data: {json.dumps(CHUNK)}\n\n".encode() if sse
                        else b'{"id": "chatcmpl-1", "object": "chat.comp')
        request.transport.close()  # the worker died: TorchServe cuts the chunked answer
        return out

    async def cancel(request: web.Request) -> web.Response:
        cancels.append((await request.json())["client_id"])
        await asyncio.sleep(30)  # a hung TorchServe
        return web.json_response({"cancelled": True})

    async def ping(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"code": 400, "type": "InvalidKeyException", "message":
                                      "Token Authorization failed. Token either incorrect, "
                                      "expired, or not provided correctly"}, status=400)
        return web.json_response({"status": "Healthy"})

    app = web.Application()
    app.router.add_post("/predictions/{model}/{version}/v1/chat/completions", chat)
    app.router.add_post("/predictions/{model}/{version}/inf2serve/cancel", cancel)
    app.router.add_get("/ping", ping)
    return app


def run_scripted(test, read_timeout_s: float = 30) -> None:
    async def go() -> None:
        cancels: list[str] = []
        async with TestServer(scripted_torchserve(cancels)) as upstream:
            router = make_app(Upstream(str(upstream.make_url("")).rstrip("/"), MODELS),
                              read_timeout_s)
            async with TestClient(TestServer(router, handler_cancellation=True)) as client:
                await test(client, cancels)

    asyncio.run(go())


def openai_client(client: TestClient):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=TOKEN, max_retries=0,
                       timeout=10)


ASK = [{"role": "user", "content": "hi"}]


def test_a_stream_torchserve_cuts_is_an_error_for_the_openai_client() -> None:
    """Issue 36: the router ended a cut stream cleanly, and the client saw a short answer."""
    import openai

    async def test(client, cancels) -> None:
        stream = await openai_client(client).chat.completions.create(
            model="alpha", messages=ASK, stream=True, extra_body={"script": "cut sse"})
        got = []
        with pytest.raises(openai.APIError) as info:
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content)
        assert got == ["Hi"] and "ended the stream early" in str(info.value)
        r = await client.post("/v1/chat/completions", headers=AUTH,
                              json={"model": "alpha", "messages": ASK, "stream": True,
                                    "script": "cut sse"})
        wire = b""
        with pytest.raises(aiohttp.ClientPayloadError):  # no chunked terminator
            async for part in r.content.iter_any():
                wire += part
        last = json.loads(wire.split(b"\n\n")[-2][len(b"data: "):])
        assert last["error"]["code"] == 502 and b"[DONE]" not in wire

    run_scripted(test)


def test_a_whole_answer_torchserve_cuts_is_a_502() -> None:
    import openai

    async def test(client, cancels) -> None:
        with pytest.raises(openai.InternalServerError) as info:
            await openai_client(client).chat.completions.create(
                model="alpha", messages=ASK, extra_body={"script": "cut json"})
        assert info.value.status_code == 502
        assert info.value.body["message"].startswith("TorchServe did not answer")

    run_scripted(test)


def test_a_silent_torchserve_bounds_the_relay() -> None:
    """A hung TorchServe: a whole answer is a 504, a stream ends as a failed one."""
    async def test(client, cancels) -> None:
        body = {"model": "alpha", "messages": ASK}
        r = await client.post("/v1/chat/completions", headers=AUTH,
                              json={**body, "script": "silent"})
        assert r.status == 504 and (await r.json())["error"]["code"] == 504
        r = await client.post("/v1/chat/completions", headers=AUTH,
                              json={**body, "stream": True, "script": "silent stream"})
        wire = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async for part in r.content.iter_any():
                wire += part
        assert b'"code": 504' in wire and b"[DONE]" not in wire
        for _ in range(50):  # it may still run upstream: cancelled
            if len(cancels) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(cancels) == 2

    run_scripted(test, read_timeout_s=0.3)


def test_pending_cancels_are_bounded_in_time_and_number(monkeypatch, caplog) -> None:
    from archive_tools import openai_router

    monkeypatch.setattr(openai_router, "CANCEL_TIMEOUT_S", 0.3)
    monkeypatch.setattr(openai_router, "MAX_PENDING_CANCELS", 1)

    async def test(client, cancels) -> None:
        for _ in range(2):  # two clients leave while TorchServe hangs
            r = await client.post("/v1/chat/completions", headers=AUTH, json={
                "model": "alpha", "messages": ASK, "stream": True, "script": "silent stream"})
            await r.content.readuntil(b"\n\n")
            r.close()
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        assert len(cancels) == 1  # the second found one waiting already: dropped
        assert "the cancel failed" in caplog.text  # the first gave up after 0.3 s

    run_scripted(test)
    assert "cancels already wait on TorchServe" in caplog.text


@pytest.mark.parametrize("script, status, words", [
    ("no worker", 503, "no worker of the model is ready"),
    ("out of memory", 507, "ran out of memory"),
    ("handler error", 400, "max_tokens: too big"),
])
def test_torchserve_errors_reach_the_client_in_openais_shape(script, status, words) -> None:
    async def test(client, cancels) -> None:
        r = await client.post("/v1/chat/completions", headers=AUTH,
                              json={"model": "alpha", "messages": ASK, "script": script})
        assert r.status == status and r.headers["Content-Type"].startswith("application/json")
        body = (await r.json())["error"]
        assert set(body) == {"message", "type", "param", "code"} and words in body["message"]
        if status == 503:
            assert r.headers["Retry-After"] == "3"

    run_scripted(test)


def test_the_token_is_checked_before_the_served_models_are_named() -> None:
    async def test(client, cancels) -> None:
        for body in ({"model": "gamma", "messages": ASK}, {"messages": ASK}):
            r = await client.post("/v1/chat/completions", json=body,
                                  headers={"Authorization": "Bearer wrong"})
            assert r.status == 401 and "alpha" not in await r.text()
        r = await client.get("/v1/models/gamma", headers={"Authorization": "Bearer wrong"})
        assert r.status == 401 and "inf2serve token" in (await r.json())["error"]["message"]
        r = await client.get("/v1/models/gamma", headers=AUTH)
        assert r.status == 404

    run_scripted(test)


@pytest.mark.parametrize("method, path, body, status, words", [
    ("POST", "/v1/chat/completions", b'{"model": "alpha",', 400, "malformed JSON"),
    ("POST", "/v1/chat/completions", b'{"model": "\xff"}', 400, "not valid UTF-8 (byte 11)"),
    ("POST", "/v1/chat/completions", b"", 400, "empty request body"),
    ("POST", "/v1/chat/completions", b"[1]", 400, "got a JSON array"),
    ("POST", "/v1/embeddings", b"{}", 404, "/v1/chat/completions"),
    ("GET", "/v1/chat/completions", b"", 405, "GET is not allowed"),
    ("POST", "/v1/completions", b"x" * 6_553_501, 413, "6553500 bytes"),
])
def test_the_routers_own_errors_are_openais_json(method, path, body, status, words) -> None:
    """Issue 37: these were plain text, or a generic `expected a JSON object body`."""
    async def test(client, cancels) -> None:
        r = await client.request(method, path, data=body, headers=AUTH)
        assert r.status == status and r.headers["Content-Type"].startswith("application/json")
        error = (await r.json())["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
        assert words in error["message"] and error["type"]

    run_scripted(test)
