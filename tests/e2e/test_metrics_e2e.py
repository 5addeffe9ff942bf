"""A real Prometheus scraping a real server: the one scrape target (the router's /metrics)
carries every model's metrics under vLLM's names, TorchServe's own and the device's (the
fake neuron-monitor of tests/fakes/neuron_tools), and what the client received is what
Prometheus counted.

One TorchServe serves the demo model (torch, CPU) and a synthetic model with speculative
decoding; a known load goes to both (native API and the router's OpenAI base URL, answers
ending by length, stop string, deadline and a client that leaves), then through
Prometheus' HTTP API: generation tokens equal the completion_tokens clients were told,
time-to-first-token counts equal the requests, finish reasons match, and every query of
every panel of deploy/grafana/inf2serve.json returns data. The alert rules are loaded and
quiet.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml

from archive_tools.ports import free_port
from tests.e2e.harness import ArchiveSpec, attach_logs_fixture, build_store, post, running_server
from tests.unit.test_monitoring_rules import RULES, panel_queries

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("prometheus") is None,
                       reason="needs Debian's prometheus: make install-prometheus"),
]
FAKE_TOOLS = Path(__file__).resolve().parents[1] / "fakes" / "neuron_tools" / "bin"
DEMO, SPEC = "tiny-llama", "spec"
SPEC_HANDLER = {"backend": "synthetic", "batch_size": 4, "threads": 1, "warmup": False,
                "max_new_tokens_limit": 512,
                "synthetic": {"decode_step_ms": 20, "prefill_ms": [5], "speculation_length": 3,
                              "draft_step_ms": 1}}
WINDOW = "2m"  # Grafana's $__rate_interval, filled in: the whole test's scrapes


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("metrics")
    no_weights = root / "no-weights"  # the synthetic backend reads config and tokenizer only
    no_weights.mkdir()
    for f in tiny_checkpoint.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, no_weights / f.name)
    build_store(root, tiny_checkpoint, [ArchiveSpec(DEMO)])
    store = build_store(root, no_weights, [ArchiveSpec(SPEC, handler=SPEC_HANDLER)])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{FAKE_TOOLS}{os.pathsep}{os.environ['PATH']}")
        with running_server(store, root / "run", [DEMO, SPEC], openai_port=0,
                            neuron_monitor=True) as srv:
            yield srv


_attach_logs = attach_logs_fixture()


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory: pytest.TempPathFactory):
    """Debian's prometheus scraping the router's /metrics every second, the alert rules
    loaded; its URL."""
    root = tmp_path_factory.mktemp("prometheus")
    target = server.scrape_url.removeprefix("http://").removesuffix("/metrics")
    (root / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "inf2serve", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [target]}]}]}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(root / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            ["prometheus", f"--config.file={root / 'prometheus.yml'}",
             f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        until(lambda: _ready(url), "Prometheus ready", 60)
        # its first scrape comes seconds after it is ready (target discovery is throttled):
        # a load that ended before it would leave one sample per series, and rate() none
        until(lambda: query(url, "up"), "Prometheus's first scrape", 60)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def until(check, what: str, timeout_s: float = 60):
    """Poll `check` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


def query(prometheus: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, (expr, r.text)
    return r.json()["data"]["result"]


def by(result: list[dict], *labels: str) -> dict:
    return {tuple(s["metric"].get(label, "") for label in labels): float(s["value"][1])
            for s in result}


class Load:
    """What the clients sent and were told, per model."""

    def __init__(self) -> None:
        self.requests: Counter = Counter()
        self.completion_tokens: Counter = Counter()
        self.reasons: dict[str, Counter] = {DEMO: Counter(), SPEC: Counter()}

    def told(self, model: str, finish_reason: str, completion_tokens: int) -> None:
        self.requests[model] += 1
        self.reasons[model][finish_reason] += 1
        self.completion_tokens[model] += completion_tokens


def native(server, load: Load, model: str, body: dict) -> dict:
    r = post(server, model, {**body, "stream": False})
    assert r.status == 200, r.body
    answer = r.json()
    load.told(model, answer["finish_reason"], answer["completion_tokens"])
    return answer


def openai_chat(server, load: Load, model: str, content: str, max_tokens: int) -> None:
    r = httpx.post(f"{server.openai_url}/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {server.inference_token}"},
                   json={"model": model, "max_tokens": max_tokens, "temperature": 0,
                         "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    answer = r.json()
    load.told(model, answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"])


def openai_streamed(server, load: Load, model: str, prompt: str, max_tokens: int) -> None:
    usage, reason = None, None
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{server.openai_url}/completions",
            headers={"Authorization": f"Bearer {server.inference_token}"},
            json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                  "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    reason = choice.get("finish_reason") or reason
    load.told(model, reason, usage["completion_tokens"])


def leave_mid_stream(server, load: Load, model: str) -> None:
    """A chat UI's stop button: the router cancels the request at the model ("abort")."""
    body = {"model": model, "max_tokens": 400, "min_tokens": 400, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{server.openai_url}/chat/completions", json=body,
            headers={"Authorization": f"Bearer {server.inference_token}"}) as r:
        assert r.status_code == 200
        next(r.iter_raw())
    load.requests[model] += 1
    load.reasons[model]["abort"] += 1


@pytest.fixture(scope="module")
def load(server, prometheus) -> Load:
    """The known load; returns once Prometheus has scraped all of it."""
    out = Load()
    first = native(server, out, DEMO, {"prompt": "Once upon a time", "max_new_tokens": 12})
    for i, n in enumerate((6, 9, 11)):
        native(server, out, DEMO, {"prompt": f"Request {i} reads", "max_new_tokens": n})
    # greedy: the same prompt gives the same text, so a piece of it is a stop string it meets
    text = first["text"]
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1)
                if text[i:i + 2].strip())
    native(server, out, DEMO, {"prompt": "Once upon a time", "max_new_tokens": 12,
                               "stop": [stop]})
    openai_chat(server, out, DEMO, "Hello there", 7)
    openai_streamed(server, out, DEMO, "The weather today", 5)
    for i in range(3):
        native(server, out, SPEC, {"prompt": f"Speculate {i}", "max_new_tokens": 40})
    # a deadline that passes while it generates: the text it has, finish_reason "timeout"
    native(server, out, SPEC, {"prompt": "Long one", "max_new_tokens": 500, "timeout": 0.3})
    openai_chat(server, out, SPEC, "Hello there", 16)
    leave_mid_stream(server, out, SPEC)
    assert out.reasons[DEMO]["stop"] == 1 and out.reasons[SPEC]["timeout"] == 1
    # every request's end counted at the model, and scraped
    until(lambda: sum(by(query(prometheus, "sum(vllm:request_success_total)")).values())
          == sum(out.requests.values()), "Prometheus to scrape every request's end", 60)
    return out


def test_generation_tokens_are_what_the_clients_were_told(prometheus, load: Load) -> None:
    got = by(query(prometheus, "sum by (model_name) (vllm:generation_tokens_total)"),
             "model_name")
    assert got[(DEMO,)] == load.completion_tokens[DEMO]
    # the client that left was told no count: the tokens it was streamed come on top
    assert got[(SPEC,)] > load.completion_tokens[SPEC]


def test_time_to_first_token_counts_every_request(prometheus, load: Load) -> None:
    got = by(query(prometheus,
                   "sum by (model_name) (vllm:time_to_first_token_seconds_count)"), "model_name")
    assert got == {(DEMO,): load.requests[DEMO], (SPEC,): load.requests[SPEC]}
    e2e = by(query(prometheus, "sum by (model_name) (vllm:e2e_request_latency_seconds_count)"),
             "model_name")
    assert e2e == got


def test_finish_reasons_match(prometheus, load: Load) -> None:
    got = by(query(prometheus, "sum by (model_name, finished_reason) "
                               "(vllm:request_success_total) > 0"),
             "model_name", "finished_reason")
    told = {(model, reason): n for model, reasons in load.reasons.items()
            for reason, n in reasons.items()}
    assert got == told


def test_speculation_is_counted(prometheus, load: Load) -> None:
    drafts = by(query(prometheus, "sum by (model_name) (vllm:spec_decode_num_drafts_total)"),
                "model_name")
    assert set(drafts) == {(SPEC,)} and drafts[(SPEC,)] > 0  # the demo model has no draft
    rate = query(prometheus, "sum(vllm:spec_decode_num_accepted_tokens_total) / "
                             "sum(vllm:spec_decode_num_draft_tokens_total)")
    assert 0 < float(rate[0]["value"][1]) <= 1


def test_every_dashboard_panel_returns_data(prometheus, load: Load) -> None:
    empty = []
    for title, expr in panel_queries():
        expr = expr.replace("[1m]", f"[{WINDOW}]")
        if not query(prometheus, expr):
            empty.append(f"{title}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_one_target_carries_torchserve_and_the_device(server, prometheus, load) -> None:
    up = by(query(prometheus, "inf2serve_upstream_up"), "upstream")
    assert up == {("torchserve",): 1.0, ("neuron-monitor",): 1.0}
    targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]
    assert [t["health"] for t in targets["activeTargets"]] == ["up"]  # one target
    # the handler's old names, for one more release, through the same target
    assert query(prometheus, 'GeneratedTokens{ModelName="tiny-llama"}')
    assert query(prometheus, "neuroncore_utilization_ratio")


def test_the_alert_rules_are_loaded_and_quiet(prometheus, load: Load) -> None:
    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert len(rules) == 5 and all(r["health"] == "ok" for r in rules.values())
    firing = httpx.get(f"{prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    assert firing == []
