"""The OpenAI API on a real TorchServe: the official client, curl -N, errors in a batch, the
bodies of OpenAI-ecosystem clients (GuideLLM, lm-evaluation-harness, LangChain, LiteLLM), and
the structured-outputs corpus (tests/data/structured) answered by the random demo model.

One TorchServe for the module, serving the tiny demo model. TorchServe's frontend
batch must be 1 under asyncCommunication (see handlers/config.py), so the handler
batches: micro-batches with a 200 ms fill delay put concurrent requests together.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import ArchiveSpec, attach_logs_fixture, build_store, running_server

pytestmark = pytest.mark.e2e
MODEL = "tiny"
GREEDY = {"temperature": 0, "seed": 7, "max_tokens": 16}
# micro-batches of up to 8, started when full or 200 ms after the first arrives
HANDLER = {"batching": "micro", "batch_size": 8, "micro_batch_size": 8, "batch_delay_ms": 200,
           "threads": 1}
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("openai-e2e")
    store = build_store(root, tiny_checkpoint, [ArchiveSpec(MODEL, handler=HANDLER)])
    with running_server(store, root / "run", [MODEL]) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"{server.inference_url}/predictions/{MODEL}/1.0/v1"


@pytest.fixture(scope="module")
def client(server, base_url):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key=server.inference_token, max_retries=0, timeout=60)


def _post(server, url: str, body: dict | bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.inference_token}"}
    if isinstance(body, dict):
        return httpx.post(url, json=body, headers=headers, timeout=60)
    return httpx.post(url, content=body, timeout=60,
                      headers={**headers, "Content-Type": "application/json"})


def test_models_listing_answers_get(server, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


def test_completion_with_the_openai_client(client) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon a time", **GREEDY)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == MODEL
    choice = out.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert 0 < out.usage.completion_tokens <= 16
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_chat_deltas_concatenate_to_the_whole_answer(client) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content
    assert text

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True},
        **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == text
    assert with_choices[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert [c.choices[0].finish_reason for c in with_choices[:-1]] == [None] * \
        (len(with_choices) - 1)
    last = chunks[-1]  # include_usage: empty choices and the usage, before [DONE]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens


def read_lines_as_they_arrive(cmd: list[str]) -> list[tuple[int, float, str]]:
    """(read number, arrival time, line) for each line of a subprocess's stdout, read raw so
    lines that arrive apart are told apart."""
    lines, buf, reads = [], b"", 0
    with subprocess.Popen(cmd, stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        while piece := os.read(proc.stdout.fileno(), 65536):
            reads += 1
            buf += piece
            *complete, buf = buf.split(b"\n")
            now = time.monotonic()
            lines += [(reads, now, raw.decode("utf-8").rstrip("\r")) for raw in complete]
    assert proc.returncode == 0 and not buf
    return lines


def test_curl_sees_sse_events_one_by_one(server, base_url) -> None:
    body = json.dumps({"model": MODEL, "messages": CHAT, "stream": True, "max_tokens": 64,
                       "min_tokens": 64, "temperature": 0})
    lines = read_lines_as_they_arrive(
        ["curl", "-sS", "-N", "-i", "-H", f"Authorization: Bearer {server.inference_token}",
         "-H", "Content-Type: application/json", "-d", body, f"{base_url}/chat/completions"])
    head = [line.lower() for _, _, line in lines if not line.startswith("data:")]
    assert "content-type: text/event-stream" in head, head
    events = [(n, t, line) for n, t, line in lines if line.startswith("data: ")]
    assert events[-1][2] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for _, _, line in events[:-1]]
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert len(payloads) > 10  # about one per token (partial UTF-8 waits for the next)
    # one by one: the first event was read (and timed) before [DONE] was sent
    assert events[0][0] < events[-1][0] and events[0][1] < events[-1][1]


BAD = {
    "missing messages": ({"model": MODEL}, "messages"),
    "n=2": ({"model": MODEL, "messages": CHAT, "n": 2}, "n"),
    "max_tokens=-1": ({"model": MODEL, "messages": CHAT, "max_tokens": -1}, "max_tokens"),
    "bad role": ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
                 "messages[0].role"),
}


def test_invalid_requests_fail_alone_in_a_batch(server, base_url) -> None:
    url = f"{base_url}/chat/completions"
    good = [{"model": MODEL, "messages": CHAT, **GREEDY},
            {"model": MODEL, "messages": CHAT, "stream": True, **GREEDY}]
    bodies = [b for b, _ in BAD.values()] + good
    with ThreadPoolExecutor(len(bodies)) as pool:  # together within batch_delay_ms (200 ms)
        responses = list(pool.map(lambda b: _post(server, url, b), bodies))
    for (name, (_, param)), r in zip(BAD.items(), responses, strict=False):
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == param, name
    plain, streamed = responses[len(BAD):]
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"]
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.endswith("data: [DONE]\n\n")


def test_unknown_endpoint_and_malformed_json(server, base_url) -> None:
    r = _post(server, f"{base_url}/embeddings", {"model": MODEL, "input": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = _post(server, f"{base_url}/completions", b'{"prompt": "x",')
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "malformed JSON" in error["message"]


# --- OpenAI-ecosystem clients: their exact bodies and call order ---
# Each test replays what one client family sends, recorded from its source (cited per body),
# so no client has to be installed here: GuideLLM 0.8.1's openai_http backend,
# lm-evaluation-harness's local-completions / local-chat-completions, LangChain's ChatOpenAI
# and LiteLLM's openai provider (the last two send their body through the `openai` SDK, which
# the tests use too).
TEXT = "Once upon a time there was a cat who liked to sleep in the sun"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(headers={"Authorization": f"Bearer {server.inference_token}"},
                      timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def sse(response: httpx.Response) -> list[dict]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


# --- GuideLLM 0.8.1 (openai_http backend) ---

def test_guidellm_probes_then_streams_exactly_the_requested_tokens(base_url, http) -> None:
    # the target loses a trailing /v1 (guidellm 0.8.1 wheel: guidellm/schemas/backends/
    # openai_http.py:L162-L166), then `GET {target}/health` validates the backend and
    # `GET {target}/v1/models` names the model (guidellm/backends/openai/http.py:L133-L142,
    # L161-L164)
    target = base_url.removesuffix("/v1")
    assert http.get(f"{target}/health").status_code == 200
    model = http.get(f"{target}/v1/models").json()["data"][0]["id"]
    assert model == MODEL
    # chat body (guidellm/backends/openai/request_handlers.py:L1166-L1188), text parts
    chat = {"model": model, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": 12, "stop": None, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}]}]}
    # completions body (guidellm/backends/openai/request_handlers.py:L607-L649)
    completion = {"model": model, "stream": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                  "max_tokens": 12, "stop": None, "ignore_eos": True, "prompt": TEXT}
    for path, body in (("chat/completions", chat), ("completions", completion)):
        r = http.post(f"{base_url}/{path}", json=body)
        assert r.status_code == 200, r.text
        events = sse(r)
        usages = [e["usage"] for e in events]
        assert all(u is not None for u in usages)  # continuous usage: on every chunk
        generated = [u["completion_tokens"] for u in usages]
        assert generated == sorted(generated) and generated[-1] == 12
        assert events[-1]["choices"] == []  # include_usage: the usage-only chunk is last
        finish = [c["finish_reason"] for e in events for c in e["choices"]]
        assert finish[-1] == "length"


# --- lm-evaluation-harness (local-completions, local-chat-completions) ---

def _reference_logprobs(checkpoint: Path, ids: list[int]) -> tuple[list[float], float]:
    """log_softmax of the model computed here, in this process: position i's score of
    token i + 1, and the best score after the last token (greedy's next token)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0]  # [L, vocab]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return ([float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)],
            float(logprobs[-1].max()))


def test_lm_eval_loglikelihood_matches_the_models_log_softmax(base_url, http, tokenizer,
                                                             tiny_checkpoint) -> None:
    context, continuation = "The capital of France", " is Paris"
    ctx_ids = tokenizer(context)["input_ids"]
    ids = ctx_ids + tokenizer(continuation, add_special_tokens=False)["input_ids"]
    # loglikelihood payload, tokenized requests of batch_size 1 (EleutherAI/lm-evaluation-
    # harness@0064c3a:lm_eval/models/openai_completions.py:L87-L96)
    body = {"model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    r = http.post(f"{base_url}/completions", json=body)
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ids) + 1  # the prompt, then one token
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    reference, greedy = _reference_logprobs(tiny_checkpoint, ids)
    assert logprobs["token_logprobs"][1:-1] == pytest.approx(reference, abs=1e-4)
    assert logprobs["token_logprobs"][-1] == pytest.approx(greedy, abs=1e-4)
    # how lm-eval reads it (openai_completions.py:L98-L122): the continuation's sum, and
    # whether each of its tokens was the top one
    ctxlen = len(ctx_ids)
    assert sum(logprobs["token_logprobs"][ctxlen:-1]) == pytest.approx(
        sum(reference[ctxlen - 1:]), abs=1e-3)
    tops = logprobs["top_logprobs"][ctxlen:-1]
    assert len(tops) == len(ids) - ctxlen and all(isinstance(t, dict) and t for t in tops)
    # max_tokens 0 with echo (vLLM's way of scoring a prompt alone): the prompt's logprobs
    r0 = http.post(f"{base_url}/completions", json={**body, "max_tokens": 0})
    assert r0.status_code == 200, r0.text
    choice = r0.json()["choices"][0]
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(reference, abs=1e-4)
    assert r0.json()["usage"]["completion_tokens"] == 0
    assert choice["text"] == tokenizer.decode(ids)


def test_lm_eval_generate_until_bodies(base_url, http, tokenizer) -> None:
    ids = tokenizer(TEXT)["input_ids"]
    # generate_until (openai_completions.py:L70-L86): stop from `until` plus the EOS text
    body = {"prompt": [ids], "model": MODEL, "max_tokens": 16, "temperature": 0,
            "stop": ["\n\n", tokenizer.eos_token], "seed": 1234}
    r = http.post(f"{base_url}/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    # local-chat-completions (openai_completions.py:L175-L208): stop cut to 4
    chat = {"messages": [{"role": "user", "content": TEXT}], "model": MODEL, "max_tokens": 16,
            "temperature": 0, "stop": ["\n\n", "Q:", "</s>", "<|im_end|>"], "seed": 1234}
    r = http.post(f"{base_url}/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["choices"][0]["message"]["content"], str)
    # lm-eval probes {base_url}/tokenizer_info to choose a tokenizer (lm_eval/utils.py
    # check_remote_tokenizer_support); a 404 makes it use the Hugging Face one
    assert http.get(f"{base_url.removesuffix('/v1')}/tokenizer_info").status_code == 404


# --- LangChain ChatOpenAI (langchain-openai 1.7.4) and LiteLLM, through the openai SDK ---

def test_langchain_chat_openai_bodies(client) -> None:
    # ChatOpenAI(model=..., temperature=0, max_tokens=16, logprobs=True, top_logprobs=2):
    # _default_params drops unset fields, max_tokens goes out as max_completion_tokens and
    # messages as {"content", "role"} (langchain_openai/chat_models/base_url.py:L1564-L1595,
    # L2035-L2064, L3845-L3857)
    messages = [{"content": "You are terse.", "role": "system"},
                {"content": TEXT, "role": "user"}]
    out = client.chat.completions.create(model=MODEL, stream=False, temperature=0.0,
                                         max_completion_tokens=16, logprobs=True,
                                         top_logprobs=2, messages=messages)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy
    # .stream(): the same body with stream true and no stream_options for a custom base_url URL
    # (base_url.py:L1435-L1454)
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, temperature=0.0,
                                                 max_completion_tokens=16,
                                                 messages=messages))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(model=MODEL, stream=False, temperature=0.0,
                                           max_completion_tokens=16, messages=messages)
    assert text == plain.choices[0].message.content == out.choices[0].message.content


def test_litellm_openai_provider_bodies(client) -> None:
    # litellm.completion(model="openai/tiny-llama", api_base=..., ...) sends {"model",
    # "messages", **optional_params} through chat.completions.create(**data)
    # (BerriAI/litellm@21ba936:litellm/llms/openai/openai.py
    # make_sync_openai_chat_completion_request)
    messages = [{"role": "user", "content": TEXT}]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 16
    assert all(c.usage is None for c in chunks[:-1])  # OpenAI: null until the last chunk
    # penalties pass through LiteLLM unchanged; a strong repetition penalty changes a greedy
    # answer that repeats itself, and never makes it longer than asked
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                           temperature=0)
    penalized = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                               temperature=0, frequency_penalty=2.0,
                                               presence_penalty=2.0)
    assert penalized.usage.completion_tokens <= 24
    assert plain.choices[0].message.content != penalized.choices[0].message.content


# --- what clients see on errors ---

def test_errors_reach_openai_clients_in_their_shape(server, base_url, client) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user",
                                                                  "content": "hi"}])
    assert MODEL in info.value.message and info.value.body["param"] == "model"
    r = httpx.get(f"{base_url}/nothing-here", timeout=30,
                  headers={"Authorization": f"Bearer {server.inference_token}"})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param",
                                                                "code"}
    # decided by TorchServe before the handler runs (docs/openai.md)
    bad_key = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        bad_key.models.list()
    assert "InvalidKeyException" in str(info.value.body)
    other = openai.OpenAI(base_url=base_url.replace(f"/{MODEL}/", "/nobody/"),
                          api_key=server.inference_token, max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        other.models.list()
    assert "ModelNotFoundException" in str(info.value.body)
    huge = httpx.post(f"{base_url}/completions", content=b"x" * 6_600_000, timeout=60,
                      headers={"Authorization": f"Bearer {server.inference_token}"})
    assert huge.status_code == 413 and huge.content == b""


# --- structured outputs: the corpus through the random demo model ---

#: sampled and short: the random model rarely closes a free string within 48 tokens, so most
#: answers are cut ("length"); those must still be a prefix the grammar allows
STRUCTURED = {"temperature": 1.0, "seed": 3, "max_tokens": 48}


def _structured(client, i: int, schema: dict) -> tuple[str, str]:
    """(finish_reason, text) of one corpus schema's strict answer; odd ones streamed."""
    from tests.structured_walk import json_schema_answer

    return json_schema_answer(client, MODEL, schema, "Answer as JSON.", i % 2 == 1,
                              **STRUCTURED)


def test_every_corpus_schema_answers_a_valid_json_or_a_prefix_of_one(client,
                                                                     tokenizer) -> None:
    """Each of the corpus' 69 schemas as a strict json_schema response_format (half
    streamed) to the random demo model: an answer that ends with "stop" parses and
    validates; one cut by max_tokens ("length") is a prefix the schema's grammar accepts,
    token by token (read again from its text with the grammar's own byte-level tokenizer):
    unmasked, the random model's first token alone would break that."""
    import jsonschema

    from handlers.structured.compiler import GrammarCompiler, grammar_tokenizer
    from tests.structured_walk import corpus, schema_spec

    schemas = [e["schema"] for e in corpus()["schemas"]]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda a: _structured(client, *a), enumerate(schemas)))
    compiler = GrammarCompiler(lambda: grammar_tokenizer(tokenizer, len(tokenizer),
                                                         [tokenizer.eos_token_id]))
    ll_tokenizer = compiler.tokenizer()
    for i, (schema, (reason, text)) in enumerate(zip(schemas, answers, strict=True)):
        assert reason in ("stop", "length"), (i, reason)
        assert text, (i, reason)
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
        tokens = ll_tokenizer.greedy_tokenize(text)
        matcher = compiler.compile(schema_spec(schema)).matcher()
        assert matcher.validate_tokens(tokens) == len(tokens), (i, reason, text)
