"""Every kind of answer through a real TorchServe: whole, with its status and headers, and gone.

TorchServe 0.12's async frontend keeps a request in its in-flight map until a
message for it says `ts_stream_next: false`; the handler ends every answer that
way (handlers/torchserve/generation_handler.py, StreamWriter). These tests read the answers
with httpx, curl and the `openai` client, and count the frontend's live request
objects (org.pytorch.serve.job.RestJob) with the JDK's jcmd: an answer the
frontend forgot is garbage, one it keeps is not.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Callable

import httpx
import pytest

from tests.e2e.harness import ArchiveSpec, attach_logs_fixture, build_store, running_server

pytestmark = pytest.mark.e2e
TINY, TIGHT = "tiny", "tiny-tight"
SPECS = [
    ArchiveSpec(TINY, handler={"batching": "continuous", "batch_size": 4, "threads": 1}),
    # one slot, one queue place: a third request is refused with 503
    ArchiveSpec(TIGHT, handler={"batching": "continuous", "batch_size": 1, "max_queue": 1,
                                "max_new_tokens_limit": 500, "threads": 1}),
]
SHORT = {"max_new_tokens": 4, "min_new_tokens": 4}


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("answers-e2e")
    store = build_store(root, tiny_checkpoint, SPECS)
    with running_server(store, root / "run", [s.name for s in SPECS]) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


def call(server, path: str, body: dict | bytes | None = None, method: str = "POST"
         ) -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.inference_token}"}
    kwargs: dict = {"json": body} if isinstance(body, dict) else {"content": body}
    if isinstance(body, bytes):
        headers["Content-Type"] = "application/json"
    return httpx.request(method, f"{server.inference_url}{path}", headers=headers, timeout=120,
                         **kwargs)


def openai_client(server, model: str = TINY):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.inference_url}/predictions/{model}/1.0/v1",
                  api_key=server.inference_token, max_retries=0, timeout=60)


def test_non_streamed_success_reads_as_an_ordinary_json_response(server):
    r = call(server, f"/predictions/{TINY}", {"prompt": "Hello", "stream": False, **SHORT})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.headers["transfer-encoding"] == "chunked"  # one chunk, then the end
    assert r.json()["completion_tokens"] == 4 and r.json()["finish_reason"] == "length"

    out = openai_client(server).completions.create(model=TINY, prompt="Hello", max_tokens=4)
    assert out.object == "text_completion" and out.usage.completion_tokens == 4

    # SageMaker's path: /invocations reaches the only-or-named model with the native contract
    r = call(server, f"/invocations?model_name={TINY}", {"prompt": "Hi", "stream": False,
                                                         **SHORT})
    assert r.status_code == 200 and r.json()["completion_tokens"] == 4
    r = call(server, f"/predictions/{TINY}/1.0/v1/models", method="GET")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == TINY


def test_curl_reads_a_non_streamed_answer_whole(server):
    body = json.dumps({"prompt": "Hello", "stream": False, **SHORT})
    out = subprocess.run(
        ["curl", "-sS", "-i", "-H", f"Authorization: Bearer {server.inference_token}",
         "-H", "Content-Type: application/json", "-d", body,
         f"{server.inference_url}/predictions/{TINY}"],
        capture_output=True, timeout=120, check=True).stdout.decode()
    head, _, payload = out.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200")
    assert "content-type: application/json" in head.lower()
    assert json.loads(payload)["completion_tokens"] == 4


def test_bad_requests_answer_400_through_every_path(server):
    from openai import BadRequestError

    for path in (f"/predictions/{TINY}", f"/invocations?model_name={TINY}"):
        r = call(server, path, {"prompt": "x", "temperature": -1})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json"
        assert r.headers["content-length"] == str(len(r.content))  # complete, not chunked
        assert r.json()["error"]["field"] == "temperature"
    with pytest.raises(BadRequestError) as err:
        openai_client(server).completions.create(model=TINY, prompt="x", max_tokens=-1)
    assert err.value.status_code == 400 and err.value.body["param"] == "max_tokens"
    r = call(server, f"/predictions/{TINY}/1.0/v1/completions", b'{"prompt": ')
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]


def hold_the_tight_model(server) -> list[threading.Thread]:
    """Occupy TIGHT's slot and its queue place with long streams; returns their threads."""
    started = threading.Event()

    def long_stream():
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", f"{server.inference_url}/predictions/{TIGHT}",
                json={"prompt": "Busy", "max_new_tokens": 500, "min_new_tokens": 500},
                headers={"Authorization": f"Bearer {server.inference_token}"}) as r:
            for _ in r.iter_raw():
                started.set()

    first = threading.Thread(target=long_stream)
    first.start()
    assert started.wait(60)  # the slot is busy
    second = threading.Thread(target=long_stream)
    second.start()
    # queued before anyone probes: a probe that overtook it would take the queue place
    # itself, wait there and answer 200, and the second stream would get the 503
    wait_for(server, "WaitingRequests", lambda got: 1 in got.values(), TIGHT)
    return [first, second]


def until_refused(send: Callable[[], httpx.Response | Exception], tries: int = 50):
    """Send until the queue place is taken (the second stream may still be on its way)."""
    for _ in range(tries):
        out = send()
        if getattr(out, "status_code", None) == 503:
            return out
    raise AssertionError(f"no 503 in {tries} tries; last: {out!r}")


def test_a_full_queue_answers_503_with_retry_after_through_both_apis(server):
    """Each API probes during its own hold: a 500-token stream of the tiny model lasts
    about 2 s, and the queue place frees when the first one ends."""
    from openai import APIStatusError

    threads = hold_the_tight_model(server)
    try:
        r = until_refused(lambda: call(server, f"/predictions/{TIGHT}",
                                       {"prompt": "x", "stream": False, **SHORT}))
        assert r.headers["retry-after"] == "1" and r.headers["content-type"] == \
            "application/json"
        assert "max_queue" in r.json()["error"]["message"]
    finally:
        for t in threads:
            t.join(120)

    client = openai_client(server, TIGHT)  # built before the hold: probes go out at once

    def openai_call():
        try:
            return client.completions.create(model=TIGHT, prompt="x", max_tokens=4)
        except APIStatusError as exc:
            return exc

    threads = hold_the_tight_model(server)
    try:
        exc = until_refused(openai_call)
        assert exc.response.headers["retry-after"] == "1"
        assert exc.body["type"] == "overloaded_error"
    finally:
        for t in threads:
            t.join(120)


def live_requests(pid: int) -> int:
    """Live org.pytorch.serve.job.RestJob objects in the frontend (a full GC runs first)."""
    out = subprocess.run(["jcmd", str(pid), "GC.class_histogram"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[-1] == "org.pytorch.serve.job.RestJob":
            return int(parts[1])
    return 0


@pytest.mark.skipif(shutil.which("jcmd") is None,
                    reason="needs the JDK's jcmd to count the frontend's live request objects")
def test_answered_requests_leave_the_frontend(server):
    from openai import BadRequestError

    client = openai_client(server)
    native = f"/predictions/{TINY}"

    def bad_openai():
        with pytest.raises(BadRequestError):
            client.completions.create(model=TINY, prompt="x", max_tokens=-1)

    kinds = [
        lambda: call(server, native, {"prompt": "a", "stream": False, **SHORT}),
        lambda: call(server, native, {"prompt": "a", **SHORT}),
        lambda: call(server, native, {"prompt": "a", "top_p": 2}),
        lambda: call(server, f"/invocations?model_name={TINY}", {"prompt": "a",
                                                                 "stream": False, **SHORT}),
        lambda: client.completions.create(model=TINY, prompt="a", max_tokens=4),
        lambda: list(client.completions.create(model=TINY, prompt="a", max_tokens=4,
                                               stream=True)),
        bad_openai,
        lambda: client.models.list(),
    ]
    rounds = 20
    before = live_requests(server.pid)
    for _ in range(rounds):
        for kind in kinds:
            kind()
    after = live_requests(server.pid)
    # before the fix every answer but the streamed ones stayed: 6 x 20 = 120 more
    assert after - before < 5, (before, after)


def scrape(server) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample on the metrics port."""
    import re

    out = []
    for line in httpx.get(f"{server.metrics_url}/metrics", timeout=10).text.splitlines():
        m = re.fullmatch(r"(\w+)\{(.*)\}\s+(\S+)", line.strip())
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def wait_for(server, name: str, ok: Callable[[dict], bool], model: str = TINY) -> dict:
    """The samples of `name` for `model` as {le, else WorkerId, else "": value}, once they
    satisfy `ok` (the worker emits metrics every 0.5 s)."""
    import time

    got: dict = {}
    for _ in range(100):
        got = {labels.get("le", labels.get("WorkerId", "")): value
               for n, labels, value in scrape(server)
               if n == name and labels.get("ModelName") == model}
        if got and ok(got):
            return got
        time.sleep(0.2)
    raise AssertionError(f"{name} for {model}: {got or 'absent'}")


def test_prometheus_shows_ttft_in_finite_buckets_and_load_gauges(server):
    call(server, f"/predictions/{TINY}", {"prompt": "Hi", "stream": False, **SHORT})
    count = wait_for(server, "TimeToFirstToken_count", lambda got: got[""] >= 1)[""]
    for _ in range(3):
        call(server, f"/predictions/{TINY}", {"prompt": "Hi", "stream": False, **SHORT})
    wait_for(server, "TimeToFirstToken_count", lambda got: got[""] >= count + 3)
    for name in ("TimeToFirstToken_bucket", "EngineQueueTime_bucket"):
        buckets = wait_for(server, name, lambda got: True)
        finite = {float(le): v for le, v in buckets.items() if le != "+Inf"}
        assert min(finite) == 1 and max(finite) == 60_000, buckets
        assert finite[60_000] == buckets["+Inf"] >= 3  # every observation in a finite bucket
    ttft = wait_for(server, "TimeToFirstToken_bucket", lambda got: True)
    assert ttft["1"] < ttft["+Inf"]  # a prefill takes more than a millisecond

    # the load gauges follow long streams on the tight model's one slot and queue place
    threads = hold_the_tight_model(server)
    try:
        busy = wait_for(server, "BusySlots", lambda got: 1 in got.values(), TIGHT)
        assert list(busy) != [""]  # labelled with the worker
        wait_for(server, "WaitingRequests", lambda got: 1 in got.values(), TIGHT)
    finally:
        for t in threads:
            t.join(120)
    wait_for(server, "BusySlots", lambda got: set(got.values()) == {0}, TIGHT)
    wait_for(server, "WaitingRequests", lambda got: set(got.values()) == {0}, TIGHT)
