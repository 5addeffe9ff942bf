"""The transformers-neuronx fake enforces the real API's rules (so backend tests mean something)."""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import sys
from pathlib import Path

import pytest

FAKES = Path(__file__).resolve().parents[1] / "fakes"
RT_VARS = ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "NEURON_CC_FLAGS")
FAKE_PACKAGES = ("transformers_neuronx", "torch_neuronx")


@pytest.fixture
def checkpoint(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint  # tests/conftest.py: the demo model, built once per session


@pytest.fixture
def tnx(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.setenv("INF2SERVE_FAKE_NEURON_EVENTS", str(tmp_path / "events.jsonl"))
    monkeypatch.setenv("INF2SERVE_FAKE_NEURON_DEVICE_DIR", str(tmp_path / "device"))
    for var in RT_VARS:
        monkeypatch.setenv(var, "")
    yield importlib.import_module("transformers_neuronx")
    for name in [m for m in sys.modules if m.split(".")[0] in FAKE_PACKAGES]:
        del sys.modules[name]  # later tests must not find the fake through sys.modules


def _model(tnx, checkpoint: Path, **kwargs):
    args = {"batch_size": 2, "tp_degree": 2, "amp": "f32", "n_positions": 64}
    return tnx.LlamaForSampling.from_pretrained(str(checkpoint), **{**args, **kwargs})


def _events(tmp_path: Path) -> list[str]:
    path = tmp_path / "events.jsonl"
    return [json.loads(line)["event"] for line in path.read_text().splitlines()] \
        if path.exists() else []


def test_unknown_argument_names_are_rejected(tnx, checkpoint: Path) -> None:
    with pytest.raises(TypeError):
        _model(tnx, checkpoint, n_position=64)
    with pytest.raises(AssertionError, match="Unexpected NeuronConfig"):
        tnx.NeuronConfig(continuous_batch=True)


def test_heads_must_divide_by_tp(tnx, checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="not divisible by tp_degree 3"):
        _model(tnx, checkpoint, tp_degree=3)


def test_kv_heads_must_shard(tnx, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 4,
        "hidden_size": 48, "num_hidden_layers": 1, "vocab_size": 32, "intermediate_size": 8}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="4 K/V heads cannot be split evenly over tp_degree 3"):
        _model(tnx, tmp_path, tp_degree=3)


def test_lifecycle_rules(tnx, checkpoint: Path, tmp_path: Path) -> None:
    model = _model(tnx, checkpoint)
    with pytest.raises(AssertionError, match="not been successfully compiled"):
        model.save(str(tmp_path / "neff"))
    with pytest.raises(RuntimeError, match="to_neuron"):
        model.forward(__import__("torch").zeros(2, 3, dtype=__import__("torch").long))
    model.to_neuron()
    with pytest.raises(RuntimeError, match="before to_neuron"):
        model.load(str(tmp_path))
    model.save(str(tmp_path / "neff"))
    assert _events(tmp_path) == ["compile"]

    again = _model(tnx, checkpoint)
    again.load(str(tmp_path / "neff"))
    again.to_neuron()
    assert _events(tmp_path) == ["compile", "load"]

    other = _model(tnx, checkpoint, batch_size=4)  # other shapes: other NEFF names
    other.load(str(tmp_path / "neff"))
    with pytest.raises(FileNotFoundError, match="matching NEFF"):
        other.to_neuron()


def test_compiled_batch_and_positions_are_fixed(tnx, checkpoint: Path) -> None:
    import torch

    model = _model(tnx, checkpoint)
    model.to_neuron()
    with pytest.raises(ValueError, match="not compiled for batch_size : 3"):
        model.forward(torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="beyond n_positions 64"):
        model.forward(torch.ones(2, 65, dtype=torch.long))
    logits = model.forward(torch.ones(2, 4, dtype=torch.long))
    assert tuple(logits.shape) == (2, 1024)
    with pytest.raises(ValueError, match="expected 1 token at 4"):
        model.forward(torch.ones(2, 1, dtype=torch.long), torch.tensor([7], dtype=torch.int32))


def test_continuous_batching_rules(tnx, checkpoint: Path) -> None:
    import torch

    cb = tnx.NeuronConfig(continuous_batching=tnx.ContinuousBatchingConfig(
        batch_size_for_shared_caches=2))
    model = _model(tnx, checkpoint, neuron_config=cb, context_length_estimate=[8])
    model.to_neuron()
    ids = torch.ones(1, 9, dtype=torch.long)
    with pytest.raises(AssertionError, match="invalid input prompt length"):
        model.forward(ids, torch.arange(9, dtype=torch.int32)[None], torch.tensor([0]))
    with pytest.raises(ValueError, match=r"seq_ids \[2\]"):
        model.forward(ids[:, :4], torch.arange(4, dtype=torch.int32)[None], torch.tensor([2]))
    model.forward(ids[:, :4], torch.arange(4, dtype=torch.int32)[None], torch.tensor([1]))
    with pytest.raises(ValueError, match="seq 0"):  # never prefilled
        model.forward(ids[:, :1], torch.tensor([[0]], dtype=torch.int32), torch.tensor([0]))


def test_streamer_gets_batch_by_one_tensors(tnx, checkpoint: Path) -> None:
    import torch

    class Recorder:
        def __init__(self) -> None:
            self.shapes, self.ended = [], False

        def put(self, t) -> None:
            self.shapes.append(tuple(t.shape))

        def end(self) -> None:
            self.ended = True

    model = _model(tnx, checkpoint)
    model.to_neuron()
    rec = Recorder()
    out = model.sample(torch.ones(2, 4, dtype=torch.long), sequence_length=10, top_k=1,
                       eos_token_override=-1, streamer=rec)
    assert rec.shapes == [(2, 1)] * 6 and rec.ended and tuple(out.shape) == (2, 10)
    with pytest.raises(ValueError, match="top_k"):
        model.sample(torch.ones(2, 4, dtype=torch.long), sequence_length=8, top_k=0)


def test_runtime_needs_enough_free_cores(tnx, checkpoint: Path, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "40")
    with pytest.raises(RuntimeError, match="1 visible NeuronCores"):
        _model(tnx, checkpoint).to_neuron()
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "42-43")
    (tmp_path / "device").mkdir(exist_ok=True)
    fd = os.open(tmp_path / "device" / "nc43.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another "process" owns core 43
    try:
        with pytest.raises(RuntimeError, match="NeuronCore 43 is already in use"):
            _model(tnx, checkpoint).to_neuron()
    finally:
        os.close(fd)
