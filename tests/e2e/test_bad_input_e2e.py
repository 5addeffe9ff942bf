"""Every kind of bad input of tests/unit/test_bad_input.py through a real TorchServe, all at
once, beside good streams: each bad one gets its own 4xx JSON naming the field, the good
ones all succeed.

Bodies over TorchServe's max_request_size (6,553,500 bytes by default) never reach the
handler: the frontend's HttpObjectAggregator answers 413 itself, with an empty body,
and closes the connection (ServerInitializer.java:58-63). That is what these tests
expect of the 20 MB bodies (docs/request-api.md, "Bad input").
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.harness import ArchiveSpec, attach_logs_fixture, build_store, running_server
from tests.unit.test_bad_input import GOOD, NATIVE_BAD, OPENAI_BAD

pytestmark = pytest.mark.e2e
MODEL = "tiny"
# the unit tests' limits: max_length 64, so "hi " * 600 does not fit
SPECS = [ArchiveSpec(MODEL, handler={"batching": "continuous", "batch_size": 4, "threads": 1,
                                     "max_length": 64, "max_new_tokens_limit": 32,
                                     "defaults": {"max_new_tokens": 8}})]
FRONTEND_LIMIT = 6_553_500  # ConfigManager.java: max_request_size's default


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input-e2e")
    store = build_store(root, tiny_checkpoint, SPECS)
    with running_server(store, root / "run", [MODEL]) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


def send(server, data: bytes, content_type: str, url_path: str) -> httpx.Response:
    path = f"/predictions/{MODEL}" + (f"/1.0/{url_path}" if url_path else "")
    headers = {"Authorization": f"Bearer {server.inference_token}",
               "Content-Type": content_type}
    try:
        return httpx.post(f"{server.inference_url}{path}", content=data, headers=headers,
                          timeout=120)
    except httpx.RemoteProtocolError as exc:  # what a client sees if the close wins the race
        return httpx.Response(499, text=str(exc))


def test_bad_input_of_both_apis_beside_good_streams(server):
    bad = [(name, data, ct, "", field) for name, data, ct, field in NATIVE_BAD] + \
          [(name, data, "application/json", path, param)
           for name, data, path, param in OPENAI_BAD]
    good = [(data, "application/json", path) for data, path in GOOD] * 3
    with ThreadPoolExecutor(8) as pool:
        good_out = [pool.submit(send, server, *g) for g in good]
        bad_out = [pool.submit(send, server, data, ct, path) for _, data, ct, path, _ in bad]
        good_r = [f.result() for f in good_out]
        bad_r = [f.result() for f in bad_out]
    for r in good_r:
        assert r.status_code == 200, r.text
    for (name, data, _, _, field), r in zip(bad, bad_r, strict=True):
        if len(data) > FRONTEND_LIMIT:  # the frontend's own answer: 413, no body
            assert (r.status_code, r.content) == (413, b""), (name, r.status_code, r.text)
            continue
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
        assert r.headers["content-type"] == "application/json", name
        error = r.json()["error"]
        assert error.get("field", error.get("param")) == field, (name, error)
    # the worker survived all of it and still answers
    r = send(server, json.dumps({"prompt": "hi", "max_new_tokens": 2}).encode(),
             "application/json", "")
    assert r.status_code == 200
