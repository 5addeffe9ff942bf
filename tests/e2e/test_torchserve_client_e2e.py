"""TorchServe's own LLM streaming client, unmodified, against a real TorchServe; and what one
request costs in ts_log.log.

TorchServe's example client (pytorch/serve examples/large_models/utils/
test_llm_streaming_response.py) posts {"prompt", "max_tokens"} (no `stream_format`, no
`stream`) with `requests.post(..., stream=True)` and, for each `iter_content(chunk_size=None)`
piece, which urllib3 yields per HTTP chunk, does `json.loads(chunk).get("text", "")`.
`requests` is not a dependency here, so `read_like_torchserve_client` reads the stream the
same way with aiohttp, whose `iter_chunks` marks where each HTTP chunk ends.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import ArchiveSpec, attach_logs_fixture, build_store, running_server

pytestmark = pytest.mark.e2e
MODEL = "tiny-ts-client"
SPECS = [ArchiveSpec(MODEL, handler={"batching": "continuous", "batch_size": 16,
                                     "max_queue": 64, "threads": 1})]
PROMPTS = [f"Story {i}: once upon a time" for i in range(16)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("ts-client-e2e")
    store = build_store(root, tiny_checkpoint, SPECS)
    with running_server(store, root / "run", [MODEL]) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


async def read_like_torchserve_client(session, url: str, token: str,
                                      payload: dict) -> tuple[int, str, list[dict]]:
    """(status, combined text, parsed chunks): each whole HTTP chunk json.loads'ed and its
    "text" appended, as the example's `_extract_text` does."""
    import aiohttp

    headers = {"Authorization": f"Bearer {token}"}
    chunks, text = [], ""
    async with session.post(url, json=payload, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=120)) as r:
        piece = b""
        async for data, end_of_http_chunk in r.content.iter_chunks():
            piece += data
            if not end_of_http_chunk:
                continue
            if piece:  # `if chunk:` in the example
                obj = json.loads(piece)  # one HTTP chunk = one JSON object, or this raises
                chunks.append(obj)
                text += obj.get("text", "")
            piece = b""
        assert piece == b"", f"a chunk that never ended: {piece!r}"
        return r.status, text, chunks


def answer(server, prompt: str) -> str:
    """The non-streamed answer, asked alone."""
    r = httpx.post(f"{server.inference_url}/predictions/{MODEL}", timeout=120,
                   headers={"Authorization": f"Bearer {server.inference_token}"},
                   json={"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": False})
    assert r.status_code == 200, r.text
    return r.json()["text"]


def test_16_concurrent_torchserve_client_streams_match_the_whole_answers(server) -> None:
    import aiohttp

    expected = [answer(server, p) for p in PROMPTS]
    url = f"{server.inference_url}/predictions/{MODEL}"

    async def run() -> list[tuple[int, str, list[dict]]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(
                read_like_torchserve_client(session, url, server.inference_token,
                                            {"prompt": p, "max_tokens": MAX_TOKENS})
                for p in PROMPTS))

    results = asyncio.run(run())
    for prompt, want, (status, text, chunks) in zip(PROMPTS, expected, results, strict=True):
        assert status == 200, (prompt, chunks)
        assert text and text == want, prompt
        assert len(chunks) >= 2, "streamed, not one buffered body"
        assert chunks[-1]["finish_reason"] == "length"
        assert chunks[-1]["completion_tokens"] == MAX_TOKENS


def test_curl_users_still_get_raw_text(server) -> None:
    r = httpx.post(f"{server.inference_url}/predictions/{MODEL}", timeout=120,
                   headers={"Authorization": f"Bearer {server.inference_token}"},
                   json={"prompt": PROMPTS[0], "max_new_tokens": MAX_TOKENS})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text == answer(server, PROMPTS[0])


def test_a_json_string_body_is_a_prompt(server) -> None:
    r = httpx.post(f"{server.inference_url}/predictions/{MODEL}", timeout=120,
                   headers={"Authorization": f"Bearer {server.inference_token}",
                            "Content-Type": "application/json"}, content=b'"Once upon a time"')
    assert r.status_code == 200 and r.text, r.text


def test_max_tokens_and_max_new_tokens_that_differ_are_a_400(server) -> None:
    r = httpx.post(f"{server.inference_url}/predictions/{MODEL}", timeout=120,
                   headers={"Authorization": f"Bearer {server.inference_token}"},
                   json={"prompt": "x", "max_tokens": 3, "max_new_tokens": 4})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["field"] == "max_tokens" and "max_new_tokens" in error["message"]


def test_ts_log_writes_each_line_once_and_little_per_request(server) -> None:
    """TorchServe's stock log4j2.xml routes the frontend's logger to ts_log twice (~5.5 KB per
    request); `serve` starts it with archive_tools/ts_logs.py's config instead."""
    log = server.run_dir / "logs" / "ts_log.log"
    before = log.stat().st_size
    for i in range(20):
        r = httpx.post(f"{server.inference_url}/predictions/{MODEL}", timeout=120,
                       headers={"Authorization": f"Bearer {server.inference_token}"},
                       json={"prompt": f"Request {i}", "max_new_tokens": 8})
        assert r.status_code == 200
    asyncio.run(asyncio.sleep(1.5))  # the handler's metrics go out every 0.5 s
    grown = log.stat().st_size - before
    assert grown < 20 * 2048, f"ts_log grew {grown} bytes for 20 requests"
    lines = log.read_text(errors="replace").splitlines()
    twice = [a for a, b in zip(lines, lines[1:], strict=False) if a == b]
    assert not twice, f"{len(twice)} lines written twice, e.g. {twice[0]}"
    # the start-up banner stays (in the day's rolled file, where midnight UTC fell between)
    assert any("Python executable:" in text for text in _with_rolled(log))


def _with_rolled(log: Path) -> list[str]:
    """The log's text, and that of the files log4j rolled it into at midnight UTC
    (archive_tools/ts_logs.py: `<name>.%d{dd-MMM}.log.gz`)."""
    texts = [log.read_text(errors="replace")]
    for rolled in sorted(log.parent.glob(f"{log.stem}.*.log.gz")):
        texts.append(gzip.decompress(rolled.read_bytes()).decode(errors="replace"))
    return texts
