"""The generation handler through a real TorchServe: streaming, batching, bad input, faults."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.e2e.harness import (
    ArchiveSpec,
    attach_logs_fixture,
    build_store,
    logged,
    post,
    running_server,
)

pytestmark = pytest.mark.e2e

FAULTY_ENTRY = '''
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "runtime"))

from handlers.backends import load_backend  # noqa: E402
from handlers.torchserve.generation_handler import GenerationHandler  # noqa: E402
from handlers.engine.start import load_tokenizer  # noqa: E402


class FaultyHandler(GenerationHandler):
    """Injected by the test: prefill raises for any micro-batch holding a prompt with FAIL."""

    def make_backend(self, config, model_dir):
        backend = load_backend(config.handler, model_dir)
        tok = load_tokenizer(model_dir / config.handler.checkpoint)
        real = backend.prefill

        def prefill(slots, prompts, params):
            if any("FAIL" in tok.decode(p) for p in prompts):
                raise RuntimeError("injected failure")
            return real(slots, prompts, params)

        backend.prefill = prefill
        return backend
'''

MICRO = {"batching": "micro", "batch_size": 8, "micro_batch_size": 4, "batch_delay_ms": 100,
         "threads": 1}
SPECS = [
    ArchiveSpec("tiny-micro", handler=MICRO),
    ArchiveSpec("tiny-cont", handler={"batching": "continuous", "batch_size": 8, "threads": 1}),
    ArchiveSpec("tiny-faulty", handler=MICRO, fmt="no-archive", entry_source=FAULTY_ENTRY),
    ArchiveSpec("tiny-tight", handler={"batching": "continuous", "batch_size": 1, "max_queue": 1,
                                       "max_new_tokens_limit": 500, "threads": 1},
                fmt="zip-store"),
]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("gen-e2e")
    store = build_store(root, tiny_checkpoint, SPECS)
    with running_server(store, root / "run", [s.name for s in SPECS]) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


def concurrently(fn, args_list):
    barrier = threading.Barrier(len(args_list))

    def go(args):
        barrier.wait()
        return fn(*args)

    with ThreadPoolExecutor(len(args_list)) as pool:
        return list(pool.map(go, args_list))


def test_stream_arrives_in_chunks_at_distinct_times(server):
    r = post(server, "tiny-cont", {"prompt": "Once upon a time", "max_new_tokens": 48,
                                   "min_new_tokens": 48})
    assert r.status == 200, r.body
    assert r.headers["content-type"].startswith("text/plain")
    assert r.headers.get("transfer-encoding") == "chunked"
    times = sorted({t for t, _ in r.chunks})
    assert len(r.chunks) >= 2 and len(times) >= 2  # streamed, not one buffered body
    assert "Once upon a time" not in r.text  # the prompt is not echoed


@pytest.mark.parametrize("model", ["tiny-micro", "tiny-cont"])
def test_16_concurrent_streams_each_get_their_own_token_count(server, model):
    counts = [4, 64, 9, 33, 17, 64, 5, 48, 12, 25, 64, 4, 40, 7, 56, 20]

    def one(i, n):
        return post(server, model, {"prompt": f"Request {i} says", "max_new_tokens": n,
                                    "min_new_tokens": n, "stream_format": "ndjson"})

    results = concurrently(one, list(enumerate(counts)))
    for n, r in zip(counts, results, strict=True):
        assert r.status == 200, r.body
        lines = r.ndjson()
        final = lines[-1]
        assert final["finish_reason"] == "length"
        assert final["completion_tokens"] == n
        assert all("text" in line for line in lines)


def test_a_batch_of_valid_and_invalid_requests(server):
    bad = [{"prompt": "x", "max_new_tokens": 0}, {"prompt": ""},
           {"prompt": "x", "temperature": -1}, {"prompt": "x", "top_p": 2}]
    good = [{"prompt": f"Good {i}", "max_new_tokens": 24, "min_new_tokens": 24,
             "stream_format": "ndjson"} for i in range(4)]
    fields = ["max_new_tokens", "prompt", "temperature", "top_p"]
    results = concurrently(lambda b: post(server, "tiny-micro", b), [(b,) for b in bad + good])
    for r, field in zip(results[:4], fields, strict=True):
        assert r.status == 400, r.body
        err = r.json()["error"]
        assert err["field"] == field and field in r.text
    for r in results[4:]:
        assert r.status == 200 and r.ndjson()[-1]["completion_tokens"] == 24


def test_other_bad_bodies_get_400_naming_the_field(server):
    r = post(server, "tiny-cont", b'{"prompt": "unterminated',
             headers={"Content-Type": "application/json"})
    assert r.status == 400 and r.json()["error"]["field"] == "body"
    r = post(server, "tiny-cont", b"\xff\xfe\xfd", headers={"Content-Type": "text/plain"})
    assert r.status == 400 and "UTF-8" in r.text
    r = post(server, "tiny-cont", {"prompt": "x", "max_new_token": 3})
    assert r.status == 400 and "max_new_tokens" in r.json()["error"]["message"]
    r = post(server, "tiny-cont", {"prompt": "word " * 2100})
    assert r.status == 400 and r.json()["error"]["field"] == "prompt"


def test_greedy_matches_in_process_generate(server, tiny_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The quick brown fox"
    r = post(server, "tiny-cont", {"prompt": prompt, "max_new_tokens": 20, "min_new_tokens": 20,
                                   "stream": False, "details": True})
    assert r.status == 200, r.body
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    want = out[0, ids.shape[1]:].tolist()
    body = r.json()
    assert body["token_ids"] == want
    assert body["text"] == tok.decode(want, skip_special_tokens=True)


def test_a_finished_row_closes_its_stream_before_the_batch_ends(server):
    def one(n):
        return post(server, "tiny-cont", {"prompt": "Hi", "max_new_tokens": n,
                                          "min_new_tokens": n})

    long, short = concurrently(one, [(200,), (3,)])
    assert long.status == short.status == 200
    assert short.ended < long.chunks[-1][0]


def test_failure_in_one_micro_batch_fails_only_it(server):
    r = post(server, "tiny-faulty", {"prompt": "please FAIL now", "max_new_tokens": 8},
             timeout=60)
    assert r.status == 500, r.body
    assert "generation failed (prefill)" in r.json()["error"]["message"]
    assert logged(server.run_dir, "injected failure")  # the details stay in the worker log
    assert r.ended - r.started < 30  # answered, not left to the response timeout
    r = post(server, "tiny-faulty", {"prompt": "fine", "max_new_tokens": 8, "min_new_tokens": 8,
                                     "stream_format": "ndjson"})
    assert r.status == 200 and r.ndjson()[-1]["completion_tokens"] == 8


def test_stop_strings_plain_text_and_non_streaming(server):
    r = post(server, "tiny-cont", b"Once upon a time", headers={"Content-Type": "text/plain"})
    assert r.status == 200 and r.text
    full = post(server, "tiny-cont", {"prompt": "Hello", "max_new_tokens": 30, "stream": False})
    text = full.json()["text"]
    stop = text[5:8]
    cut = post(server, "tiny-cont", {"prompt": "Hello", "max_new_tokens": 30, "stream": False,
                                     "stop": [stop]}).json()
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == text[:text.index(stop)]


def stream_in_background(server, model, body):
    """Start a streaming request; returns (thread, result holder, first-chunk event)."""
    import httpx

    first = threading.Event()
    out: dict = {}

    def run():
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", f"{server.inference_url}/predictions/{model}", json=body,
                headers={"Authorization": f"Bearer {server.inference_token}"}) as r:
            out["status"] = r.status_code
            times = []
            for chunk in r.iter_raw():
                if chunk:
                    times.append(time.monotonic())
                    first.set()
            out["times"] = times
        first.set()

    t = threading.Thread(target=run)
    t.start()
    return t, out, first


def test_continuous_newcomer_starts_before_the_running_request_ends(server):
    t, long_out, first = stream_in_background(
        server, "tiny-cont", {"prompt": "Long", "max_new_tokens": 250, "min_new_tokens": 250})
    assert first.wait(60)
    short = post(server, "tiny-cont", {"prompt": "Short", "max_new_tokens": 4,
                                       "min_new_tokens": 4})
    t.join(120)
    assert short.status == 200 and long_out["status"] == 200
    # the newcomer joined the running batch: its first token came before the long one ended
    assert short.chunks[0][0] < long_out["times"][-1]


def test_greedy_newcomer_joining_a_running_batch_matches_generate(server, tiny_checkpoint):
    """The newcomer is prefilled inside the running request's decode step (one forward)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t, long_out, first = stream_in_background(
        server, "tiny-cont", {"prompt": "Long", "max_new_tokens": 200, "min_new_tokens": 200})
    assert first.wait(60)
    prompt = "Once upon a time there was a robot"
    r = post(server, "tiny-cont", {"prompt": prompt, "max_new_tokens": 16, "min_new_tokens": 16,
                                   "stream": False, "details": True})
    t.join(120)
    assert r.status == 200 and long_out["status"] == 200, r.body
    assert r.chunks[-1][0] < long_out["times"][-1]  # it ran while the long one ran
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert r.json()["token_ids"] == out[0, ids.shape[1]:].tolist()


def test_full_queue_answers_503_with_retry_after(server):
    body = {"prompt": "Busy", "max_new_tokens": 500, "min_new_tokens": 500}
    t1, out1, first = stream_in_background(server, "tiny-tight", body)
    assert first.wait(60)  # the only slot is busy
    t2, out2, _ = stream_in_background(server, "tiny-tight", body)  # the only queue place
    time.sleep(0.2)
    deadline = time.monotonic() + 10
    rejected = None
    while time.monotonic() < deadline:
        r = post(server, "tiny-tight", {"prompt": "x", "max_new_tokens": 2})
        if r.status == 503:
            rejected = r
            break
    t1.join(120)
    t2.join(120)
    assert rejected is not None, "queue never reported full"
    assert rejected.headers.get("retry-after") == "1"
    assert "max_queue" in rejected.json()["error"]["message"]
    assert out1["status"] == out2["status"] == 200  # the admitted ones were not dropped


def test_form_encoded_body_gets_the_fix_and_custom_metrics_are_exported(server):
    import httpx

    # `curl -d '{...}'` without a Content-Type: TorchServe parses a form and drops the body
    r = post(server, "tiny-cont", b'{"prompt": "Hi", "max_new_tokens": 3}',
             headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status == 400
    err = r.json()["error"]
    assert err["field"] == "body" and "Content-Type: application/json" in err["message"]
    post(server, "tiny-cont", {"prompt": "Hi", "max_new_tokens": 3})
    want = [f'{name}{{ModelName="tiny-cont"' for name in
            ("TimeToFirstToken_count", "GeneratedTokens", "EngineQueueTime_count")]
    for _ in range(50):  # the worker emits metrics every 0.5 s
        metrics = httpx.get(f"{server.metrics_url}/metrics", timeout=10).text.replace(" ", "")
        if all(w in metrics for w in want):
            break
        time.sleep(0.2)
    assert [w for w in want if w not in metrics] == []
