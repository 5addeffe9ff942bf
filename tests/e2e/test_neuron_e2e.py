"""The neuron backend through a real TorchServe, on the transformers-neuronx fake.

PYTHONPATH puts tests/fakes first, so the workers import the fake SDK (it computes
with the real checkpoint on CPU and logs every compile/load to an events file).
Checks: streamed text equals the torch backend's; a 1-token prompt joining a running
request leaves its text unchanged; a restart on the same archive compiles nothing and
loads from the archive's compile cache; two workers started together compile once and
run on disjoint NEURON_RT_VISIBLE_CORES; int8 weights with on-device sampling stream the
int8 model's greedy text and refuse what the device cannot do.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.harness import ArchiveSpec, build_store, logs, post, running_server

pytestmark = pytest.mark.e2e

FAKES = Path(__file__).resolve().parents[1] / "fakes"
PROMPTS = ["The quick brown fox", "Once upon a time"]
NEW_TOKENS = 24
# the torch backend needs transformers 5; under the 4.x the Neuron SDKs ship, the neuron
# archive is compared with plain transformers only
TORCH_BACKEND = int(__import__("transformers").__version__.split(".")[0]) >= 5


def _neuron_spec(name: str, root: Path, workers: int = 1) -> ArchiveSpec:
    return ArchiveSpec(
        name, {"minWorkers": workers, "maxWorkers": workers, "deviceType": "neuron"},
        {"backend": "neuron", "batching": "continuous", "batch_size": 4, "threads": 1,
         "dtype": "float32",
         "neuron": {"tp_degree": 2, "cores_per_instance": 4,
                    "core_lock_dir": str(root / "core-locks")}},
        fmt="no-archive")  # a folder: its neuron_cache/ persists across restarts


def _env(root: Path, compile_s: float = 0.0) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(FAKES),
                                                        os.environ.get("PYTHONPATH")])),
            "INF2SERVE_FAKE_NEURON_EVENTS": str(root / "events.jsonl"),
            "INF2SERVE_FAKE_NEURON_DEVICE_DIR": str(root / "device"),
            "INF2SERVE_FAKE_NEURON_COMPILE_S": str(compile_s)}


def _events(root: Path, want: int = 0, timeout_s: float = 120) -> list[dict]:
    """The fake's event log, waiting until it has `want` lines (workers start in parallel)."""
    path, deadline = root / "events.jsonl", time.monotonic() + timeout_s
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= want or time.monotonic() > deadline:
            return [json.loads(x) for x in lines]
        time.sleep(0.2)


def _generate(server, model: str) -> list[str]:
    out = []
    for prompt in PROMPTS:
        r = post(server, model, {"prompt": prompt, "max_new_tokens": NEW_TOKENS,
                                 "temperature": 0.0})
        assert r.status == 200, r.body
        assert len(r.chunks) >= 2  # streamed
        out.append(r.text)
    return out


def _int8(weight):
    """Per-output-channel absmax int8, dequantized (transformers-neuronx@1ade6d7:
    src/transformers_neuronx/quantize.py:L71-L86)."""
    import torch

    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    return torch.clamp(torch.round(weight / scale), -128, 127) * scale


def _transformers_text(checkpoint: Path, prompt: str, int8: bool = False) -> str:
    """Greedy text by plain transformers: what the handler streams (deltas join to decode());
    int8: with every layer's attention and MLP weights rounded as transformers-neuronx does."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    model = LlamaForCausalLM.from_pretrained(str(checkpoint)).eval()
    for layer in model.model.layers if int8 else []:
        a, m = layer.self_attn, layer.mlp
        for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                     m.down_proj):
            proj.weight.data = _int8(proj.weight.data.float())
    ids = list(tok(prompt)["input_ids"])
    new: list[int] = []
    with torch.no_grad():
        while len(new) < NEW_TOKENS and (not new or new[-1] != model.config.eos_token_id):
            new.append(int(model(torch.tensor([ids + new])).logits[0, -1].argmax()))
    return tok.decode(new, skip_special_tokens=True)


def _joined_by_one_token_prompts(server, model: str, attempts: int = 5) -> tuple[str, str]:
    """A long greedy request's text alone, and with 1-token prompts ("a") joining it.

    Whether the joiners land while the long request runs is up to the machine's timing, so
    an attempt where they did not is repeated; every attempt's text must equal the lone one.
    """
    body = {"prompt": PROMPTS[1], "max_new_tokens": 40, "min_new_tokens": 40,
            "temperature": 0.0}
    alone = post(server, model, body)
    assert alone.status == 200, alone.body
    for _ in range(attempts):
        long_text, overlapped = _long_request_with_joiners(server, model, body)
        assert long_text == alone.text
        if overlapped:
            return alone.text, long_text
    raise AssertionError(f"the joiners never overlapped the long request in {attempts} tries")


def _long_request_with_joiners(server, model: str, body: dict) -> tuple[str, bool]:
    """Streams `body`; once its first chunk is in, two 1-token prompts are sent at once."""
    import httpx

    started, out = threading.Event(), {"chunks": []}

    def run() -> None:
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", f"{server.inference_url}/predictions/{model}", json=body,
                headers={"Authorization": f"Bearer {server.inference_token}"}) as r:
            for chunk in r.iter_raw():
                out["chunks"].append(chunk)
                started.set()
            out["status"], out["ended"] = r.status_code, time.monotonic()
        started.set()

    def join(i: int) -> None:
        joiners[i] = post(server, model, {"prompt": "a", "max_new_tokens": 4,
                                          "temperature": 0.0})

    runner, joiners = threading.Thread(target=run), [None, None]
    runner.start()
    assert started.wait(60)
    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(joiners))]
    for t in threads:
        t.start()
    for t in [*threads, runner]:
        t.join(120)
    assert out["status"] == 200 and all(j is not None and j.status == 200 for j in joiners)
    overlapped = all(j.chunks[0][0] < out["ended"] for j in joiners)
    return b"".join(out["chunks"]).decode(), overlapped


def test_restart_loads_from_the_compile_cache(tiny_checkpoint, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("neuron-e2e")
    specs = [_neuron_spec("tiny-neuron", root)]
    if TORCH_BACKEND:
        specs.append(ArchiveSpec("tiny-torch", {}, {"batching": "continuous", "batch_size": 4,
                                                    "threads": 1}))
    store = build_store(root, tiny_checkpoint, specs)
    with running_server(store, root / "run1", [s.name for s in specs], env=_env(root)) as server:
        try:
            first = _generate(server, "tiny-neuron")
            assert first == [_transformers_text(tiny_checkpoint, p) for p in PROMPTS]
            if TORCH_BACKEND:
                assert first == _generate(server, "tiny-torch")  # same model, same greedy text
            assert any(t.strip() for t in first)
            alone, joined = _joined_by_one_token_prompts(server, "tiny-neuron")
            assert joined == alone
        except AssertionError:
            print(logs(server.run_dir))
            raise
    events = _events(root, 1)
    assert [e["event"] for e in events] == ["compile"]
    assert events[0]["visible_cores"] == [0, 1]
    entries = [p for p in (store / "tiny-neuron" / "neuron_cache").iterdir()
               if (p / "metadata.json").exists()]
    assert len(entries) == 1

    with running_server(store, root / "run2", ["tiny-neuron"], env=_env(root)) as server:
        assert _generate(server, "tiny-neuron") == first
    events = _events(root, 2)
    assert [e["event"] for e in events] == ["compile", "load"]  # nothing compiled again
    assert events[1]["directory"] == str((entries[0] / "artifacts").resolve())


def test_two_workers_compile_once_on_disjoint_cores(tiny_checkpoint, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("neuron-e2e-2w")
    store = build_store(root, tiny_checkpoint, [_neuron_spec("tiny-neuron-2w", root, 2)])
    with running_server(store, root / "run", ["tiny-neuron-2w"],
                        env=_env(root, compile_s=3.0)) as server:
        events = _events(root, 2)
        try:
            assert sorted(e["event"] for e in events) == ["compile", "load"]
            assert sorted(tuple(e["visible_cores"]) for e in events) == [(0, 1), (2, 3)]
            assert len({e["pid"] for e in events}) == 2
            assert all(r for r in _generate(server, "tiny-neuron-2w"))
        except AssertionError:
            print(logs(server.run_dir))
            raise


def test_micro_batches_honour_each_requests_sampling(tiny_checkpoint, tmp_path_factory) -> None:
    """transformers-neuronx's sample() takes one parameter set per call: a greedy request
    and a temperature-1 request arriving together (inside one batch delay) must each get
    what they get alone, and what sample() cannot honour is a 400 naming the field in
    both APIs."""
    import httpx

    root = tmp_path_factory.mktemp("neuron-e2e-micro")
    spec = _neuron_spec("tiny-neuron-micro", root)
    spec.handler.update(batching="micro", micro_batch_size=4, batch_delay_ms=400)
    store = build_store(root, tiny_checkpoint, [spec])
    greedy = {"prompt": PROMPTS[0], "max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    hot = {"prompt": PROMPTS[1], "max_new_tokens": NEW_TOKENS, "temperature": 1.0, "seed": 5,
           "stream": False, "details": True}  # the answer with its token ids
    with running_server(store, root / "run", [spec.name], env=_env(root)) as server:
        try:
            together: list = [None, None]

            def send(i: int, body: dict) -> None:
                together[i] = post(server, spec.name, body)

            threads = [threading.Thread(target=send, args=(i, b))
                       for i, b in enumerate((greedy, hot))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert [r.status for r in together] == [200, 200], [r.body for r in together]
            assert together[0].text == _transformers_text(tiny_checkpoint, PROMPTS[0])
            alone = post(server, spec.name, hot)
            assert alone.status == 200
            # the seeded draw ran as it does alone
            assert json.loads(together[1].text) == json.loads(alone.text)
            assert post(server, spec.name, greedy).text == together[0].text

            refused = post(server, spec.name, {"prompt": "hi", "min_new_tokens": 2})
            assert refused.status == 400
            assert json.loads(refused.text)["error"]["field"] == "min_new_tokens"
            url = f"{server.inference_url}/predictions/{spec.name}/1.0/v1/completions"
            r = httpx.post(url, json={"prompt": "hi", "min_tokens": 2}, timeout=60,
                           headers={"Authorization": f"Bearer {server.inference_token}"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
            assert "handler.batching micro" in r.json()["error"]["message"]
        except AssertionError:
            print(logs(server.run_dir))
            raise


def test_int8_weights_with_on_device_sampling(tiny_checkpoint, tmp_path_factory) -> None:
    """handler.neuron.quantization.weights int8 and on_device_sampling: a greedy request
    streams the int8 model's greedy text (token ids from the device), a sampled one within
    global_top_k answers, and a seed is a 400 naming the field in both APIs."""
    import httpx

    root = tmp_path_factory.mktemp("neuron-e2e-int8")
    spec = _neuron_spec("tiny-neuron-int8", root)
    spec.handler["neuron"].update(quantization={"weights": "int8"}, on_device_sampling=True,
                                  global_top_k=64)
    store = build_store(root, tiny_checkpoint, [spec])
    with running_server(store, root / "run", [spec.name], env=_env(root)) as server:
        try:
            greedy = post(server, spec.name, {"prompt": PROMPTS[0],
                                              "max_new_tokens": NEW_TOKENS, "temperature": 0.0})
            assert greedy.status == 200, greedy.body
            assert len(greedy.chunks) >= 2  # streamed
            assert greedy.text == _transformers_text(tiny_checkpoint, PROMPTS[0], int8=True)
            hot = post(server, spec.name, {"prompt": PROMPTS[1], "max_new_tokens": 8,
                                           "temperature": 0.8, "top_k": 20})
            assert hot.status == 200, hot.body
            refused = post(server, spec.name, {"prompt": "hi", "temperature": 0.8, "seed": 3})
            assert refused.status == 400
            error = json.loads(refused.text)["error"]
            assert error["field"] == "seed"
            assert "handler.neuron.on_device_sampling" in error["message"]
            url = f"{server.inference_url}/predictions/{spec.name}/1.0/v1/completions"
            r = httpx.post(url, json={"prompt": "hi", "temperature": 0.8, "seed": 3}, timeout=60,
                           headers={"Authorization": f"Bearer {server.inference_token}"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
        except AssertionError:
            print(logs(server.run_dir))
            raise
    assert [e["event"] for e in _events(root, 1)] == ["compile"]
