"""The NxD Inference fake raises where the real library raises, and is lenient where it is.

Each rule is cited in tests/fakes/nxdi/neuronx_distributed_inference/ (source:
aws-neuron/neuronx-distributed-inference@cd3abf3, Neuron SDK 2.28). Outputs are compared
with plain transformers, so rules that silently corrupt a sequence on Inf2 (unsorted
seq_ids in a full batch, a 1-token context) show as wrong tokens here.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

NXDI = Path(__file__).resolve().parents[1] / "fakes" / "nxdi"
RT_VARS = ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES")


@pytest.fixture
def nxdi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(NXDI))
    monkeypatch.setenv("INF2SERVE_FAKE_NEURON_DEVICE_DIR", str(tmp_path / "device"))
    for var in RT_VARS:
        monkeypatch.setenv(var, "")
    yield
    for name in [m for m in sys.modules
                 if m.split(".")[0] in ("neuronx_distributed_inference", "neuronx_distributed")]:
        del sys.modules[name]


def _nc(**kw):
    from neuronx_distributed_inference.models.config import NeuronConfig

    base = {"batch_size": 2, "ctx_batch_size": 1, "tkg_batch_size": 2, "seq_len": 64,
            "max_context_length": 32, "is_continuous_batching": True, "tp_degree": 2,
            "torch_dtype": "float32", "enable_bucketing": True,
            "context_encoding_buckets": [8, 32], "token_generation_buckets": [32, 64]}
    return NeuronConfig(**{**base, **kw})


def _model(checkpoint: Path, tmp_path: Path, compile_: bool = True, **kw):
    from neuronx_distributed_inference.models.llama.modeling_llama import (
        LlamaInferenceConfig,
        NeuronLlamaForCausalLM,
    )
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    cfg = LlamaInferenceConfig(_nc(**kw), load_config=load_pretrained_config(str(checkpoint)))
    model = NeuronLlamaForCausalLM(str(checkpoint), cfg)
    if compile_:
        model.compile(str(tmp_path / "compiled"))
        model.load(str(tmp_path / "compiled"))
    return model


def _t(rows):
    import torch

    return torch.tensor(rows, dtype=torch.int64)


def _reference(checkpoint: Path, prompt: list[int], n: int) -> list[int]:
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(checkpoint)).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _prefill(model, slot: int, prompt: list[int], positions: list[int] | None = None) -> int:
    out = model(_t([prompt]), seq_ids=_t([slot]),
                position_ids=_t([positions or list(range(len(prompt)))]))
    return int(out.logits[0, -1].argmax())


@pytest.mark.parametrize("kw,error,match", [
    ({"max_context_length": 65}, AssertionError, "max_context_length cannot be more"),
    ({"context_encoding_buckets": [8, 48]}, AssertionError, "Context bucket 48 should be <= 32"),
    ({"token_generation_buckets": [32, 128]}, AssertionError, "bucket 128 should be <= 64"),
    ({"cast_type": "fp8"}, ValueError, "cast_type must be one of"),
    ({"torch_dtype": "float64"}, AssertionError, "Unsupported dtype"),
    ({"tp_degree": 2, "cp_degree": 4}, ValueError, "evenly divisible by CP"),
])
def test_neuron_config_rules(nxdi, kw, error, match) -> None:
    with pytest.raises(error, match=match):
        _nc(**kw)


def test_neuron_config_logs_unknown_keywords_and_sorts_buckets(nxdi, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        nc = _nc(no_such_field=3, context_encoding_buckets=[32, 8])
    assert "Unexpected keyword arguments: {'no_such_field': 3}" in caplog.text
    assert not hasattr(nc, "no_such_field") and nc.context_encoding_buckets == [8, 32]


def test_inference_config_needs_the_llama_fields(nxdi, tiny_checkpoint) -> None:
    from neuronx_distributed_inference.models.llama.modeling_llama import LlamaInferenceConfig

    with pytest.raises(AssertionError, match="Config must define"):
        LlamaInferenceConfig(_nc())  # no load_config: no hidden_size, vocab_size, ...


def test_compile_writes_neuron_config_and_model_then_loads_from_the_compiled_dir(
        nxdi, tiny_checkpoint, tmp_path) -> None:
    from neuronx_distributed_inference.models.llama.modeling_llama import NeuronLlamaForCausalLM

    model = _model(tiny_checkpoint, tmp_path, compile_=False)
    with pytest.raises(ValueError, match="model.pt does not exist"):  # load before compile
        model.load(str(tmp_path / "compiled"))
    model.compile(str(tmp_path / "compiled"))
    saved = json.loads((tmp_path / "compiled" / "neuron_config.json").read_text())
    assert saved["neuron_config"]["tp_degree"] == 2 and saved["hidden_size"] == 64
    assert (tmp_path / "compiled" / "model.pt").is_file()
    # a compiled dir is a model path of its own: its neuron_config.json is the config
    again = NeuronLlamaForCausalLM(str(tmp_path / "compiled"))
    assert again.neuron_config.context_encoding_buckets == [8, 32] and again.is_compiled


def test_forward_before_load_raises(nxdi, tiny_checkpoint, tmp_path) -> None:
    model = _model(tiny_checkpoint, tmp_path, compile_=False)
    with pytest.raises(RuntimeError, match="Forward called before load"):
        _prefill(model, 0, [1, 5, 9])


def test_a_program_traced_for_another_config_is_refused(nxdi, tiny_checkpoint, tmp_path) -> None:
    _model(tiny_checkpoint, tmp_path)
    other = _model(tiny_checkpoint, tmp_path, compile_=False, batch_size=4, tkg_batch_size=4)
    with pytest.raises(RuntimeError, match="traced for another config"):
        other.load(str(tmp_path / "compiled"))


def test_continuous_batching_compiles_one_context_row(nxdi, tiny_checkpoint, tmp_path) -> None:
    model = _model(tiny_checkpoint, tmp_path, compile_=False, ctx_batch_size=2)
    with pytest.raises(AssertionError, match="only supports single seq_id"):
        model.compile(str(tmp_path / "compiled"))
    assert (tmp_path / "compiled" / "neuron_config.json").is_file()  # written before tracing


def test_load_needs_tp_degree_visible_cores_held_exclusively(nxdi, tiny_checkpoint, tmp_path,
                                                             monkeypatch) -> None:
    model = _model(tiny_checkpoint, tmp_path, compile_=False, tp_degree=4)
    model.compile(str(tmp_path / "compiled"))
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    with pytest.raises(RuntimeError, match="2 visible NeuronCores"):
        model.load(str(tmp_path / "compiled"))


def test_prompts_longer_than_the_largest_bucket_raise(nxdi, tiny_checkpoint, tmp_path) -> None:
    model = _model(tiny_checkpoint, tmp_path)
    with pytest.raises(ValueError, match="exceeds largest bucket"):
        _prefill(model, 0, list(range(1, 34)))
    _prefill(model, 0, list(range(1, 33)))  # exactly the largest bucket fits


def test_token_generation_past_the_largest_bucket_raises(nxdi, tiny_checkpoint, tmp_path) -> None:
    model = _model(tiny_checkpoint, tmp_path)
    _prefill(model, 0, [1, 5, 9])
    with pytest.raises(ValueError, match="exceeds largest bucket"):
        model(_t([[5]]), seq_ids=_t([0]), position_ids=_t([[65]]))


@pytest.mark.parametrize("seq_ids,error", [([2], IndexError), ([5], IndexError)])
def test_seq_ids_outside_the_cache_raise(nxdi, tiny_checkpoint, tmp_path, seq_ids, error) -> None:
    model = _model(tiny_checkpoint, tmp_path)
    with pytest.raises(error):
        _prefill(model, seq_ids[0], [1, 5, 9])
    _prefill(model, 0, [1, 5, 9])
    with pytest.raises(error):  # a padded decode index_selects its rows by seq_id
        model(_t([[7]]), seq_ids=_t(seq_ids), position_ids=_t([[3]]))


def test_wrong_shapes_raise(nxdi, tiny_checkpoint, tmp_path) -> None:
    model = _model(tiny_checkpoint, tmp_path)
    with pytest.raises(RuntimeError, match="traced graphs take"):
        model(_t([[1, 5, 9]]), seq_ids=_t([0, 1]), position_ids=_t([[0, 1, 2]]))
    with pytest.raises(RuntimeError, match="traced graphs take"):
        model(_t([[1, 5, 9]]), seq_ids=_t([[0]]), position_ids=_t([[0, 1, 2]]))


def test_a_one_token_context_returns_the_pads_logits(nxdi, tiny_checkpoint, tmp_path) -> None:
    """Positions pad with 1 and the first maximal position is gathered: for one token that
    is the first pad. The backend's workaround (fill the largest bucket, positions 0) gives
    the token's own logits."""
    import torch
    from transformers import LlamaForCausalLM

    model = _model(tiny_checkpoint, tmp_path)
    with torch.no_grad():
        want = LlamaForCausalLM.from_pretrained(str(tiny_checkpoint)).eval()(
            _t([[67]])).logits[0, -1]
    naive = model(_t([[67]]), seq_ids=_t([0]), position_ids=_t([[0]])).logits[0, -1]
    assert not torch.allclose(naive, want, atol=1e-4)
    padded = model(_t([[67] * 32]), seq_ids=_t([0]), position_ids=_t([[0] * 32])).logits[0, -1]
    assert torch.allclose(padded, want, atol=1e-4)


def test_an_unsorted_full_batch_mixes_cache_lines_a_padded_one_does_not(
        nxdi, tiny_checkpoint, tmp_path) -> None:
    """A full batch runs rows as cache lines 0..n-1 whatever seq_ids say; a smaller one is
    padded and sorted by seq_id (vLLM's plugin sorts: 'MANDATORY for contiguous kv cache')."""
    model = _model(tiny_checkpoint, tmp_path)
    a, b = [1, 5, 9, 13], [1, 7, 3]
    ra, rb = _reference(tiny_checkpoint, a, 2), _reference(tiny_checkpoint, b, 2)
    ta, tb = _prefill(model, 0, a), _prefill(model, 1, b)
    out = model(_t([[tb], [ta]]), seq_ids=_t([1, 0]), position_ids=_t([[len(b)], [len(a)]]))
    assert [int(x) for x in out.logits[:, -1].argmax(-1)] != [rb[1], ra[1]]
    model = _model(tiny_checkpoint, tmp_path, batch_size=3, tkg_batch_size=3)
    ta, tb = _prefill(model, 0, a), _prefill(model, 1, b)
    out = model(_t([[tb], [ta]]), seq_ids=_t([1, 0]), position_ids=_t([[len(b)], [len(a)]]))
    assert [int(x) for x in out.logits[:, -1].argmax(-1)] == [rb[1], ra[1]]


@pytest.mark.parametrize("row,match", [([300, 1.0, 1.0], "top-k must be -1"),
                                       ([2.5, 1.0, 1.0], "decimal parts"),
                                       ([5, 0.0, 1.0], "top-p must be in the range"),
                                       ([5, 1.0, -1.0], "Temperature must be greater"),
                                       ([0, 1.0, 0.0], "Please set top_k to 1")])
def test_on_device_sampling_params_are_validated(nxdi, tiny_checkpoint, tmp_path, row,
                                                 match) -> None:
    import torch
    from neuronx_distributed_inference.models.config import OnDeviceSamplingConfig

    model = _model(tiny_checkpoint, tmp_path, on_device_sampling_config=OnDeviceSamplingConfig(
        dynamic=True, do_sample=True))
    with pytest.raises(ValueError, match=match):
        model(_t([[1, 5]]), seq_ids=_t([0]), position_ids=_t([[0, 1]]),
              sampling_params=torch.tensor([row]))
    with pytest.raises(ValueError, match="shape"):
        model(_t([[1, 5]]), seq_ids=_t([0]), position_ids=_t([[0, 1]]),
              sampling_params=torch.tensor([[1.0, 1.0]]))
    greedy = model(_t([[1, 5]]), seq_ids=_t([0]), position_ids=_t([[0, 1]]),
                   sampling_params=torch.tensor([[1.0, 1.0, 1.0]]))
    assert greedy.logits is None  # token ids, not logits
    assert int(greedy.hidden_states[0]) == _reference(tiny_checkpoint, [1, 5], 1)[0]
