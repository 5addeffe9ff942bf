"""An int8 nxdi archive through a real TorchServe, on the NxD Inference fake.

The worker quantizes the checkpoint once (NxD Inference's save_quantized_state_dict, into
the compile-cache entry), compiles, loads from the quantized checkpoint, and streams greedy
text equal to plain transformers' with every linear layer rounded as NxD Inference's
per-channel int8 rounds it, with async mode and on-device sampling on. One server start.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.harness import ArchiveSpec, build_store, logs, post, running_server
from tests.e2e.test_neuron_e2e import NEW_TOKENS, PROMPTS, _events, _transformers_text

pytestmark = pytest.mark.e2e

NXDI = Path(__file__).resolve().parents[1] / "fakes" / "nxdi"


def _int8_per_channel(weight):
    """Symmetric per-output-channel int8 as neuronx-distributed's observer computes it
    (absmax / 127.5; aws-neuron/neuronx-distributed@73ab227:src/neuronx_distributed/
    quantization/observer.py, torch's MinMaxObserver), dequantized."""
    import torch

    scale = weight.abs().amax(dim=1, keepdim=True) / 127.5
    return torch.clamp(torch.round(weight / scale), -128, 127) * scale


def _int8_text(checkpoint: Path, prompt: str) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    model = LlamaForCausalLM.from_pretrained(str(checkpoint)).eval()
    for module in model.modules():  # every Linear, lm_head included
        if type(module) is torch.nn.Linear:
            module.weight.data = _int8_per_channel(module.weight.data.float())
    ids = list(tok(prompt)["input_ids"])
    new: list[int] = []
    with torch.no_grad():
        while len(new) < NEW_TOKENS and (not new or new[-1] != model.config.eos_token_id):
            new.append(int(model(torch.tensor([ids + new])).logits[0, -1].argmax()))
    return tok.decode(new, skip_special_tokens=True)


def test_streams_greedy_text_of_the_int8_checkpoint(tiny_checkpoint, tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("nxdi-quant-e2e")
    spec = ArchiveSpec(
        "tiny-nxdi-int8", {"minWorkers": 1, "maxWorkers": 1, "deviceType": "neuron"},
        {"backend": "nxdi", "batching": "continuous", "batch_size": 4, "threads": 1,
         "dtype": "float32",
         "neuron": {"tp_degree": 2, "cores_per_instance": 4, "context_length_estimate": [16, 64],
                    "core_lock_dir": str(root / "core-locks"), "on_device_sampling": True,
                    "quantization": {"weights": "int8"}},
         "nxdi": {"async_mode": True}},
        fmt="no-archive")
    store = build_store(root, tiny_checkpoint, [spec])
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(NXDI), os.environ.get("PYTHONPATH")])),
           "INF2SERVE_FAKE_NEURON_EVENTS": str(root / "events.jsonl"),
           "INF2SERVE_FAKE_NEURON_DEVICE_DIR": str(root / "device")}
    texts = []
    with running_server(store, root / "run", [spec.name], env=env) as server:
        try:
            for prompt in PROMPTS:
                r = post(server, spec.name, {"prompt": prompt, "max_new_tokens": NEW_TOKENS,
                                             "temperature": 0.0})
                assert r.status == 200, r.body
                assert len(r.chunks) >= 2  # streamed
                assert r.text == _int8_text(tiny_checkpoint, prompt)
                texts.append(r.text)
        except AssertionError:
            print(logs(server.run_dir))
            raise
    # the rounding shows: the unquantized checkpoint answers these prompts otherwise
    assert texts != [_transformers_text(tiny_checkpoint, p) for p in PROMPTS]
    events = _events(root, 3)
    assert [e["event"] for e in events] == ["quantize", "compile", "load"]
    assert events[2]["warmup_call"] == "forward_async"
    entries = [p for p in (store / spec.name / "neuron_cache").iterdir()
               if (p / "metadata.json").exists()]
    assert len(entries) == 1
    assert (entries[0] / "artifacts" / "quantized" / "v1" / "model.safetensors").is_file()
