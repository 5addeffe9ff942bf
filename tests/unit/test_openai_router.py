"""The one-base-URL router against a stand-in for TorchServe's per-model OpenAI routes:
listing, routing by `model`, the token passed through, streams relayed as they come."""

from __future__ import annotations

import asyncio
import json

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


def test_a_client_that_leaves_mid_stream_is_cancelled_upstream_with_its_token() -> None:
    """TorchServe tells a worker nothing of a disconnect; the router, which holds the
    client's connection, tells the model (generation_handler's inf2serve/cancel)."""
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
