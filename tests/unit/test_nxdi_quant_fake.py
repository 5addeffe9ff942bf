"""The NxD Inference fake's quantization, fp8 KV cache and async mode, rule by rule.

Each rule raises where the real library raises (cited in tests/fakes/nxdi/: NeuronConfig
at construction, the quantized checkpoint's type at save and at trace, the checkpoint at
load) and is lenient where it is (an unknown quantization_type passes NeuronConfig).
Outputs come from the checkpoint with the quantized weights' rounding, so int8/fp8 change
the logits as they would on the device.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

NXDI = Path(__file__).resolve().parents[1] / "fakes" / "nxdi"
RT_VARS = ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES",
           "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS", "NEURON_RT_IO_RING_CACHE_SIZE")
FAKE_PACKAGES = ("neuronx_distributed_inference", "neuronx_distributed")


@pytest.fixture
def nxdi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(NXDI))
    monkeypatch.setenv("INF2SERVE_FAKE_NEURON_DEVICE_DIR", str(tmp_path / "device"))
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("INF2SERVE_FAKE_NEURON_EVENTS", str(events))
    for var in RT_VARS:
        monkeypatch.setenv(var, "")
    yield events
    for name in [m for m in sys.modules if m.split(".")[0] in FAKE_PACKAGES]:
        del sys.modules[name]


def _nc(**kw):
    from neuronx_distributed_inference.models.config import NeuronConfig

    base = {"batch_size": 2, "ctx_batch_size": 1, "tkg_batch_size": 2, "seq_len": 64,
            "max_context_length": 32, "is_continuous_batching": True, "tp_degree": 2,
            "torch_dtype": "float32", "enable_bucketing": True,
            "context_encoding_buckets": [8, 32], "token_generation_buckets": [32, 64]}
    return NeuronConfig(**{**base, **kw})


def _quant(path: Path, **kw) -> dict:
    return {"quantized": True, "quantized_checkpoints_path": str(path),
            "quantization_type": "per_channel_symmetric", "quantization_dtype": "int8",
            "modules_to_not_convert": None, **kw}


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


def _quantized(checkpoint: Path, tmp_path: Path, **kw):
    """Quantize into tmp_path/q (a directory: safetensors), compile, load."""
    (tmp_path / "q").mkdir(parents=True, exist_ok=True)
    model = _model(checkpoint, tmp_path, compile_=False, **_quant(tmp_path / "q", **kw))
    type(model).save_quantized_state_dict(str(checkpoint), model.config)
    model.compile(str(tmp_path / "compiled"))
    model.load(str(tmp_path / "compiled"))
    return model


def _t(rows):
    import torch

    return torch.tensor(rows, dtype=torch.int64)


def _logits(model, prompt: list[int], slot: int = 0):
    return model(_t([prompt]), seq_ids=_t([slot]),
                 position_ids=_t([list(range(len(prompt)))])).logits[0, -1]


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# --- NeuronConfig: what raises at construction, and what does not -------------------------
def test_quantized_needs_a_checkpoint_path(nxdi) -> None:
    with pytest.raises(AssertionError, match="quantized_checkpoints_path is required"):
        _nc(quantized=True)


@pytest.mark.parametrize("dtype,ok", [("int8", True), ("F8E4M3", True), ("f8e5m2", True),
                                      ("int4", False), ("fp8", False)])
def test_quantization_dtype_is_a_quantized_dtype_name(nxdi, tmp_path, dtype, ok) -> None:
    if ok:
        assert _nc(**_quant(tmp_path, quantization_dtype=dtype)).quantization_dtype == dtype
        return
    with pytest.raises(AssertionError, match=f"{dtype} is not a valid QuantizedDtype"):
        _nc(**_quant(tmp_path, quantization_dtype=dtype))


def test_an_unknown_quantization_type_passes_the_config(nxdi, tmp_path) -> None:
    assert _nc(**_quant(tmp_path, quantization_type="bogus")).quantization_type == "bogus"


def test_no_modules_to_not_convert_warns(nxdi, tmp_path) -> None:
    with pytest.warns(UserWarning, match="Assuming all modules will be quantized"):
        _nc(**_quant(tmp_path))


def test_kv_quant_config_from_a_dict_and_its_direct_cast_rule(nxdi) -> None:
    import torch
    from neuronx_distributed.quantization.quantization_config import (
        KVQuantizationConfig,
        QuantizationType,
    )

    nc = _nc(kv_cache_quant=True, kv_quant_config={"quant_dtype": torch.float8_e4m3fn})
    assert isinstance(nc.kv_quant_config, KVQuantizationConfig) and nc.kv_quant_config.direct_cast
    with pytest.raises(AssertionError, match="must be PER_TENSOR_SYMMETRIC"):
        _nc(kv_quant_config={"k_quant_method": QuantizationType.PER_CHANNEL_SYMMETRIC})
    json.dumps(__import__("neuronx_distributed_inference.models.config",
                          fromlist=["to_dict"]).to_dict(nc))  # compile() can save it


# --- the quantized checkpoint: written, refused, read ------------------------------------
@pytest.mark.parametrize("qtype,error,match", [
    ("bogus", ValueError, "is not a valid QuantizationType"),
    ("per_key_symmetric", RuntimeError, "per_key_symmetric not supported"),
])
def test_an_unsupported_type_fails_when_the_checkpoint_is_written(nxdi, tiny_checkpoint, tmp_path,
                                                                  qtype, error, match) -> None:
    model = _model(tiny_checkpoint, tmp_path, compile_=False,
                   **_quant(tmp_path, quantization_type=qtype))
    with pytest.raises(error, match=match):
        type(model).save_quantized_state_dict(str(tiny_checkpoint), model.config)


@pytest.mark.parametrize("qtype,error,match", [
    ("bogus", ValueError, "is not a valid QuantizationType"),
    ("blockwise_symmetric", RuntimeError, "blockwise_symmetric is not supported"),
])
def test_an_unsupported_type_fails_at_trace(nxdi, tiny_checkpoint, tmp_path, qtype, error,
                                            match) -> None:
    model = _model(tiny_checkpoint, tmp_path, compile_=False,
                   **_quant(tmp_path, quantization_type=qtype))
    with pytest.raises(error, match=match):
        model.compile(str(tmp_path / "compiled"))


def test_a_dtype_the_cpu_cannot_quantize_fails_when_written(nxdi, tiny_checkpoint,
                                                            tmp_path) -> None:
    model = _model(tiny_checkpoint, tmp_path, compile_=False,
                   **_quant(tmp_path, quantization_dtype="f4e2m1fn_x4"))
    with pytest.raises(ValueError, match="not supported to quantize model on CPU"):
        type(model).save_quantized_state_dict(str(tiny_checkpoint), model.config)


def test_load_reads_every_weight_from_the_quantized_checkpoint(nxdi, tiny_checkpoint,
                                                               tmp_path) -> None:
    model = _model(tiny_checkpoint, tmp_path, compile_=False, **_quant(tmp_path / "missing"))
    model.compile(str(tmp_path / "compiled"))
    with pytest.raises(FileNotFoundError, match="Quantized checkpoint file not found"):
        model.load(str(tmp_path / "compiled"))


@pytest.mark.parametrize("qtype,scale_shape", [("per_channel_symmetric", (64, 1)),
                                               ("per_tensor_symmetric", (1,))])
def test_int8_weights_and_scales_are_written_symmetric(nxdi, tiny_checkpoint, tmp_path, qtype,
                                                       scale_shape) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    _quantized(tiny_checkpoint, tmp_path, quantization_type=qtype)
    assert [p.name for p in (tmp_path / "q").iterdir()] == ["model.safetensors"]
    sd = load_file(tmp_path / "q" / "model.safetensors")
    w, s = sd["layers.0.self_attn.q_proj.weight"], sd["layers.0.self_attn.q_proj.scale"]
    assert w.dtype == torch.int8 and tuple(s.shape) == scale_shape and s.dtype == torch.float32
    assert sd["lm_head.weight"].dtype == torch.int8 and "lm_head.scale" in sd
    assert sd["embed_tokens.weight"].dtype == torch.float32  # not a Linear
    hf = LlamaForCausalLM.from_pretrained(str(tiny_checkpoint))
    ref = hf.model.layers[0].self_attn.q_proj.weight.detach()
    assert int(w.abs().max()) in (127, 128)  # the absmax row (or tensor) spans the range
    assert torch.allclose(w.float() * s, ref, atol=float(s.max()) / 2 + 1e-7)
    assert not torch.equal(w.float() * s, ref)  # rounded


def test_outputs_carry_the_rounding(nxdi, tiny_checkpoint, tmp_path) -> None:
    import torch

    prompt = [1, 5, 9, 13]
    float_model = _model(tiny_checkpoint, tmp_path / "f")
    int8 = _quantized(tiny_checkpoint, tmp_path / "i8")
    fp8 = _quantized(tiny_checkpoint, tmp_path / "f8", quantization_dtype="f8e4m3")
    ref, a, b = (_logits(m, prompt) for m in (float_model, int8, fp8))
    for q in (a, b):
        assert not torch.equal(q, ref) and torch.allclose(q, ref, atol=0.3)
    assert (a - ref).abs().max() < (b - ref).abs().max()  # e4m3 keeps 3 mantissa bits


def test_per_channel_honours_modules_to_not_convert(nxdi, tiny_checkpoint, tmp_path) -> None:
    import torch
    from safetensors.torch import load_file

    _quantized(tiny_checkpoint, tmp_path, modules_to_not_convert=["lm_head", "mlp"])
    sd = load_file(tmp_path / "q" / "model.safetensors")
    assert sd["lm_head.weight"].dtype == torch.float32 and "lm_head.scale" not in sd
    assert sd["layers.1.mlp.down_proj.weight"].dtype == torch.float32
    assert sd["layers.1.self_attn.o_proj.weight"].dtype == torch.int8


def test_per_tensor_quantizes_every_layer_so_a_skipped_one_mismatches(nxdi, tiny_checkpoint,
                                                                      tmp_path) -> None:
    """The per-tensor quantizer takes no modules_to_not_convert; the trace does."""
    from safetensors.torch import load_file

    with pytest.raises(RuntimeError, match="lm_head is in modules_to_not_convert"):
        _quantized(tiny_checkpoint, tmp_path, quantization_type="per_tensor_symmetric",
                   modules_to_not_convert=["lm_head"])
    assert "lm_head.scale" in load_file(tmp_path / "q" / "model.safetensors")


def test_a_file_path_gets_one_torch_file(nxdi, tiny_checkpoint, tmp_path) -> None:
    import torch

    path = tmp_path / "q.pt"
    model = _model(tiny_checkpoint, tmp_path, compile_=False, **_quant(path))
    type(model).save_quantized_state_dict(str(tiny_checkpoint), model.config)
    assert torch.load(path)["layers.0.mlp.up_proj.weight"].dtype == torch.int8
    model.compile(str(tmp_path / "compiled"))
    model.load(str(tmp_path / "compiled"))
    assert _logits(model, [1, 5]).shape == (1024,)


def test_the_quantized_checkpoint_path_is_not_part_of_the_traced_program(
        nxdi, tiny_checkpoint, tmp_path) -> None:
    """A compiled dir loads with the checkpoint moved elsewhere (an entry's own copy)."""
    import shutil

    model = _quantized(tiny_checkpoint, tmp_path)
    shutil.move(tmp_path / "q", tmp_path / "moved")
    again = _model(tiny_checkpoint, tmp_path, compile_=False, **_quant(tmp_path / "moved"))
    again.load(str(tmp_path / "compiled"))
    assert _logits(again, [1, 5]).equal(_logits(model, [1, 5]))


# --- fp8 KV cache: 2.28 takes the dtype from kv_quant_config ------------------------------
def test_kv_cache_quant_alone_leaves_the_cache_in_torch_dtype(nxdi, tiny_checkpoint,
                                                              tmp_path) -> None:
    import torch

    plain = _model(tiny_checkpoint, tmp_path / "a")
    flag_only = _model(tiny_checkpoint, tmp_path / "b", kv_cache_quant=True)
    fp8 = _model(tiny_checkpoint, tmp_path / "c", kv_cache_quant=True,
                 kv_quant_config={"quant_dtype": torch.float8_e4m3fn})
    prompt = [1, 5, 9, 13, 17]
    outs = []
    for m in (plain, flag_only, fp8):
        first = _logits(m, prompt)
        assert torch.equal(first, _logits(plain, prompt))  # context encoding: fresh K/V
        outs.append(m(_t([[7]]), seq_ids=_t([0]), position_ids=_t([[5]])).logits[0, -1])
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2]) and torch.allclose(outs[0], outs[2], atol=0.2)
    dtypes = [e["kv_cache_dtype"] for e in _events(nxdi) if e["event"] == "load"]
    assert dtypes == ["float32", "float32", "float8_e4m3fn"]


# --- async mode ---------------------------------------------------------------------------
def _ods():
    from neuronx_distributed_inference.models.config import OnDeviceSamplingConfig

    return OnDeviceSamplingConfig(dynamic=True, do_sample=True, global_topk=64)


def _step(model, tokens: list[int], positions: list[int], slots: list[int]) -> list[int]:
    import torch

    out = model(_t([[t] for t in tokens]), seq_ids=_t(slots),
                position_ids=_t([[p] for p in positions]),
                sampling_params=torch.ones(len(slots), 3))
    return [int(x) for x in out.tokens.reshape(-1)]


def test_async_runs_one_step_ahead_on_the_devices_own_tokens(nxdi, tiny_checkpoint, tmp_path,
                                                             monkeypatch) -> None:
    import os

    import torch

    sync = _model(tiny_checkpoint, tmp_path / "s", on_device_sampling_config=_ods())
    model = _model(tiny_checkpoint, tmp_path / "a", on_device_sampling_config=_ods(),
                   async_mode=True)
    assert os.environ["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "2"
    assert os.environ["NEURON_RT_IO_RING_CACHE_SIZE"] == "2"
    assert [e["warmup_call"] for e in _events(nxdi) if e["event"] == "load"] == [
        "forward", "forward_async"]
    a, b = [1, 5, 9, 13], [1, 7, 3]
    want = {}
    for m in (sync, model):
        ta = int(m(_t([a]), seq_ids=_t([0]), position_ids=_t([list(range(4))]),
                   sampling_params=torch.ones(1, 3)).tokens[0])
        tb = int(m(_t([b]), seq_ids=_t([1]), position_ids=_t([list(range(3))]),
                   sampling_params=torch.ones(1, 3)).tokens[0])
        rows, got = [ta, tb], [[ta, tb]]
        for i in range(4):
            if m is model and i >= 2:
                rows = [999, 999]  # not read: the device runs on its own tokens by now
            rows = _step(m, rows, [4 + i, 3 + i], [0, 1])
            got.append(rows)
        want[m is model] = got
        if m is model:
            assert model.prior_outputs is not None  # one step queued ahead
    assert want[True] == want[False]
    assert _step(model, [want[True][-1][0]], [8], [0]) == _step(sync, [want[False][-1][0]], [8],
                                                                 [0])  # other seq_ids: sync
    assert model.prior_outputs is None


def test_async_needs_token_outputs_to_run_ahead(nxdi, tiny_checkpoint, tmp_path) -> None:
    model = _model(tiny_checkpoint, tmp_path, async_mode=True)  # lenient at config time
    t = int(_logits(model, [1, 5, 9]).argmax())
    with pytest.raises(RuntimeError, match="without on-device sampling that is logits"):
        model(_t([[t]]), seq_ids=_t([0]), position_ids=_t([[3]]))


def test_async_runs_in_sync_near_a_bucket_boundary(nxdi, tiny_checkpoint, tmp_path) -> None:
    """Two tokens short of a token-generation bucket (32 here) it stops running ahead."""
    model = _model(tiny_checkpoint, tmp_path, on_device_sampling_config=_ods(), async_mode=True)
    model(_t([[1, 5]]), seq_ids=_t([0]), position_ids=_t([[0, 1]]),
          sampling_params=__import__("torch").ones(1, 3))
    _step(model, [3], [28], [0])
    assert model.prior_outputs is not None
    _step(model, [3], [30], [0])
    assert model.prior_outputs is None and not model.async_should_stop
