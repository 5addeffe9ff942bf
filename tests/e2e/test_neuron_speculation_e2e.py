"""Speculative decoding through a real TorchServe, on the transformers-neuronx fake.

Two archives of the same model with on-device sampling: one plain, one packaged with
`inf2serve package --draft-checkpoint` (a noisy copy of the model as the draft, so some
runs are accepted and some drafts rejected). Greedy streams, alone and concurrent, are
the plain archive's; the speculative worker compiled the target, the draft and the fused
graphs.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.e2e.harness import logs, make_config, post, running_server
from tests.e2e.test_neuron_e2e import _env, _events
from tests.unit.test_neuron_speculation import noisy_copy

pytestmark = pytest.mark.e2e

PROMPTS = ["The quick brown fox", "Once upon a time", "a"]
NEW_TOKENS = 24
K = 4


def _handler(root: Path, speculation: bool) -> dict:
    neuron = {"tp_degree": 2, "cores_per_instance": 4, "core_lock_dir": str(root / "core-locks"),
              "on_device_sampling": True, "global_top_k": 64}
    if speculation:
        neuron["speculation"] = {"draft_checkpoint": "draft", "length": K}
    return {"backend": "neuron", "batching": "continuous", "batch_size": 4, "threads": 1,
            "dtype": "float32", "max_length": 256, "max_new_tokens_limit": 64, "neuron": neuron}


def _stream(server, model: str, prompt: str) -> str:
    r = post(server, model, {"prompt": prompt, "max_new_tokens": NEW_TOKENS, "temperature": 0.0})
    assert r.status == 200, r.body
    assert len(r.chunks) >= 2  # streamed
    return r.text


def _concurrent(server, model: str) -> list[str]:
    out: list[str | None] = [None] * len(PROMPTS)

    def run(i: int) -> None:
        out[i] = _stream(server, model, PROMPTS[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out


def test_a_speculative_archive_streams_the_plain_archives_greedy_text(
        tiny_checkpoint, tmp_path_factory) -> None:
    from archive_tools.cli import main
    from archive_tools.package import package

    root = tmp_path_factory.mktemp("neuron-spec-e2e")
    store = root / "model_store"
    frontend = {"minWorkers": 1, "maxWorkers": 1, "deviceType": "neuron"}
    package(make_config(root / "plain.yaml", frontend, _handler(root, False)), tiny_checkpoint,
            "tiny-plain", "no-archive", store)
    draft = noisy_copy(tiny_checkpoint, root / "draft-ckpt", 0.1)
    spec_yaml = make_config(root / "spec.yaml", frontend, _handler(root, True))
    assert main(["package", "--config", str(spec_yaml), "--checkpoint", str(tiny_checkpoint),
                 "--draft-checkpoint", str(draft), "--name", "tiny-spec", "--format",
                 "no-archive", "--out", str(store)]) == 0
    assert (store / "tiny-spec" / "draft" / "model.safetensors").is_file()

    with running_server(store, root / "run", ["tiny-plain", "tiny-spec"],
                        env=_env(root)) as server:
        try:
            plain = [_stream(server, "tiny-plain", p) for p in PROMPTS]
            spec = [_stream(server, "tiny-spec", p) for p in PROMPTS]
            assert spec == plain and any(t.strip() for t in plain)
            assert _concurrent(server, "tiny-spec") == plain
        except AssertionError:
            print(logs(server.run_dir))
            raise
    def where(e: dict) -> str:
        if e.get("program"):
            return e["program"]
        return "/".join(Path(e["checkpoint"]).parts[-2:])  # <archive>/<checkpoint dir>

    compiled = sorted(where(e) for e in _events(root, 4) if e["event"] == "compile")
    assert compiled == ["fused-speculator", "tiny-plain/model", "tiny-spec/draft",
                        "tiny-spec/model"]
