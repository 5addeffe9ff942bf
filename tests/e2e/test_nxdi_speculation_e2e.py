"""Fused speculation on the nxdi backend through a real TorchServe, on the NxD Inference fake.

Two archives of the tiny model, one with handler.neuron.speculation (the draft, a noisy
copy of the model, packaged with --draft-checkpoint): the speculative archive streams the
same greedy text as the plain one and as plain transformers, several tokens arriving per
step; one compile each, and the speculative one's load shards the draft too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from archive_tools.package import package
from tests.e2e.harness import logs, make_config, post, running_server
from tests.e2e.test_neuron_e2e import PROMPTS, _events, _transformers_text
from tests.e2e.test_nxdi_e2e import _env
from tests.unit.test_nxdi_speculation import noisy_copy

pytestmark = pytest.mark.e2e

K = 3


def _handler(root: Path, speculation: bool) -> dict:
    neuron = {"tp_degree": 2, "cores_per_instance": 4, "context_length_estimate": [16, 64],
              "core_lock_dir": str(root / "core-locks"), "on_device_sampling": True,
              "global_top_k": 64}
    if speculation:
        neuron["speculation"] = {"draft_checkpoint": "draft", "length": K}
    return {"backend": "nxdi", "batching": "continuous", "batch_size": 4, "threads": 1,
            "dtype": "float32", "max_length": 128, "max_new_tokens_limit": 64,
            "neuron": neuron}


def _stream(server, model: str, prompt: str, n: int) -> tuple[str, int]:
    r = post(server, model, {"prompt": prompt, "max_new_tokens": n, "temperature": 0.0})
    assert r.status == 200, r.body
    return r.text, len(r.chunks)


def test_speculative_archive_streams_the_plain_greedy_text(tiny_checkpoint,
                                                           tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("nxdi-spec-e2e")
    draft = noisy_copy(tiny_checkpoint, root / "draft-src", 0.1)
    store = root / "model_store"
    store.mkdir()
    frontend = {"minWorkers": 1, "maxWorkers": 1, "deviceType": "neuron"}
    for name, spec in (("tiny-plain", False), ("tiny-spec", True)):
        cfg = make_config(root / f"{name}.yaml", frontend, _handler(root, spec))
        package(cfg, tiny_checkpoint, name, "no-archive", store, force=True,
                draft_checkpoint=draft if spec else None)
    assert (store / "tiny-spec" / "draft" / "config.json").is_file()
    with running_server(store, root / "run", ["tiny-plain", "tiny-spec"],
                        env=_env(root)) as server:
        try:
            for prompt in PROMPTS:
                plain, _ = _stream(server, "tiny-plain", prompt, 24)
                spec, chunks = _stream(server, "tiny-spec", prompt, 24)
                assert spec == plain == _transformers_text(tiny_checkpoint, prompt)
                assert chunks >= 2  # streamed
                # max_new_tokens ending wherever the accepted runs put it
                assert _stream(server, "tiny-spec", prompt, 7)[0] == _stream(
                    server, "tiny-plain", prompt, 7)[0]
        except AssertionError:
            print(logs(server.run_dir))
            raise
    events = _events(root, 4)
    assert sorted(e["event"] for e in events) == ["compile", "compile", "load", "load"]
    drafts = {e["directory"].split("/neuron_cache/")[0].rsplit("/", 1)[-1]: e.get("draft")
              for e in events if e["event"] == "load"}
    assert drafts["tiny-plain"] is None  # TorchServe serves a copy of the folder: its draft/
    assert drafts["tiny-spec"].endswith("/tiny-spec/draft")
