"""The transformers-neuronx fake's quantization and on-device sampling: it raises where the
real library raises, is lenient where it is, and computes what the device computes.

Each test names the real lines it mirrors, at
aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

FAKES = Path(__file__).resolve().parents[1] / "fakes"
RT_VARS = ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "NEURON_CC_FLAGS")
FAKE_PACKAGES = ("transformers_neuronx", "torch_neuronx")
PROMPT = [5, 6, 7, 8]


@pytest.fixture
def checkpoint(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint  # tests/conftest.py: the demo model


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


def _model(tnx, checkpoint: Path, batch: int = 2, compile: bool = True, **config):
    nc = tnx.NeuronConfig(continuous_batching=tnx.ContinuousBatchingConfig(max_num_seqs=batch),
                          **config)
    model = tnx.LlamaForSampling.from_pretrained(
        str(checkpoint), batch_size=batch, tp_degree=2, amp="f32", n_positions=64,
        context_length_estimate=[8, 16], neuron_config=nc)
    if compile:
        model.to_neuron()
    return model


def _kv(**kwargs):
    from transformers_neuronx.config import KVCacheQuantizationConfig  # not at the top level

    return KVCacheQuantizationConfig(**kwargs)


def _t(rows, dtype="int64"):
    import torch

    return torch.tensor(rows, dtype=getattr(torch, dtype))


def _sampling(tnx, batch: int = 2, **kwargs):
    """The on-device sampling config inf2serve builds (handlers/backends/neuron_backend.py)."""
    args = {"do_sample": True, "dynamic": True, "per_batch_line": True, "global_top_k": 64,
            "top_k": [1] * batch, "top_p": [1.0] * batch, "temperature": [1.0] * batch}
    return tnx.GenerationConfig(**{**args, **kwargs})


def _prefill(model, prompt=PROMPT, slot: int = 0):
    return model.forward(_t([prompt]), _t([list(range(len(prompt)))]), _t([slot]))


def _int8(weight):
    """Per-output-channel absmax int8, dequantized: written from quantize.py:L71-L86, apart
    from the fake's own code."""
    import torch

    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    return torch.clamp(torch.round(w / scale), -128, 127) * scale


def _hf_logits(checkpoint: Path, tokens: list[int], transform=None):
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(checkpoint)).eval()
    if transform is not None:
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                         layer.mlp.down_proj):
                proj.weight.data = transform(proj.weight.data)
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1]


# --- QuantizationConfig / KVCacheQuantizationConfig (config.py:L29-L71) --------------------
def test_quantization_config_signature_defaults_and_refusals(tnx) -> None:
    """config.py:L32-L52: s8 / vector_dynamic / f16 by default; other dtypes and methods raise
    NotImplementedError in the constructor; dequant_dtype is not checked."""
    from transformers_neuronx.config import QuantizationConfig

    q = QuantizationConfig()
    assert (q.quant_dtype, q.dequant_dtype, q.quantize_method, q.quantize_attn,
            q.no_quantize_list) == ("s8", "f16", "vector_dynamic", True, [])
    assert QuantizationConfig(no_quantize_list=["model.layers.3"]).is_unit_scale(3)
    assert not QuantizationConfig(no_quantize_list=["model.layers.3"]).is_unit_scale(1)
    with pytest.raises(NotImplementedError, match=r"^int8 is not implemented\. +Available "
                                                  r"options are s8,f8e4m3fn$"):
        QuantizationConfig(quant_dtype="int8")
    with pytest.raises(NotImplementedError, match=r"^per_tensor is not implemented\. +Available "
                                                  r"options are vector_dynamic,direct_cast$"):
        QuantizationConfig(quantize_method="per_tensor")
    assert QuantizationConfig(dequant_dtype="float16").dequant_dtype == "float16"  # lenient


def test_kv_cache_quantization_config_signature_and_refusals(tnx) -> None:
    """config.py:L59-L71: s8 / bf16 / direct_cast by default; s8, f16, bf16, f8e4m3fn only;
    direct_cast is the only method."""
    from transformers_neuronx.config import KVCacheQuantizationConfig

    kv = KVCacheQuantizationConfig()
    assert (kv.quant_dtype, kv.dequant_dtype, kv.quantize_method) == ("s8", "bf16", "direct_cast")
    for dtype in ("s8", "f16", "bf16", "f8e4m3fn"):
        KVCacheQuantizationConfig(quant_dtype=dtype)
    with pytest.raises(NotImplementedError, match="^fp8 is not implemented. Available options "
                                                  "are s8,f16,bf16,f8e4m3fn$"):
        KVCacheQuantizationConfig(quant_dtype="fp8")
    with pytest.raises(NotImplementedError, match="^vector_dynamic is not implemented.  "
                                                  "Available options are direct_cast$"):
        KVCacheQuantizationConfig(quantize_method="vector_dynamic")


# --- weights, quantized at every load (decoder.py:L1581-L1683, quantize.py) ----------------
def test_int8_weights_carry_per_channel_rounding(tnx, checkpoint) -> None:
    """s8 vector_dynamic: absmax/127 per output channel, round, clamp (quantize.py:L71-L86), on
    every attention and MLP weight; logits are those of the rounded weights, close to the
    checkpoint's but not equal."""
    import torch

    plain = _prefill(_model(tnx, checkpoint))[0]
    q = tnx.QuantizationConfig(dequant_dtype="f32")
    quant = _prefill(_model(tnx, checkpoint, quant=q))[0]
    assert torch.allclose(quant, _hf_logits(checkpoint, PROMPT, _int8), atol=1e-4)
    assert not torch.allclose(quant, plain, atol=1e-3)
    assert torch.allclose(quant, plain, atol=0.5)
    # s8 ignores no_quantize_list: only fp8 reads it (quantize.py:L87-L90)
    skip = tnx.QuantizationConfig(dequant_dtype="f32", no_quantize_list=["model.layers.0"])
    assert torch.equal(_prefill(_model(tnx, checkpoint, quant=skip))[0], quant)


def test_fp8_weights_scale_to_240_and_unit_scale_listed_layers(tnx, checkpoint) -> None:
    """f8e4m3fn: absmax/240 per channel, cast to float8_e4m3fn (quantize.py:L87-L101,
    constants.py:L36-L38); a layer in no_quantize_list gets unit scales on its MLP weights
    (llama/model.py:L124-L128, decoder.py:L1672-L1683), attention is scaled regardless."""
    import torch

    def fp8(w):
        scale = w.float().abs().amax(dim=1, keepdim=True) / 240.0
        return (w.float() / scale).to(torch.float8_e4m3fn).float() * scale

    q = tnx.QuantizationConfig(quant_dtype="f8e4m3fn", dequant_dtype="f32")
    got = _prefill(_model(tnx, checkpoint, quant=q))[0]
    assert torch.allclose(got, _hf_logits(checkpoint, PROMPT, fp8), atol=1e-4)
    unit = tnx.QuantizationConfig(quant_dtype="f8e4m3fn", dequant_dtype="f32",
                                  no_quantize_list=["model.layers.0"])
    assert not torch.allclose(_prefill(_model(tnx, checkpoint, quant=unit))[0], got, atol=1e-5)


def test_weight_quantization_refusals(tnx, checkpoint) -> None:
    """direct_cast casts with the dtype's name, which torch reads as a device (quantize.py:
    L106-L110); 'self_attn' in no_quantize_list asserts while attention is quantized
    (decoder.py:L1591-L1593). Both at load_weights, i.e. at to_neuron."""
    cast = tnx.QuantizationConfig(quantize_method="direct_cast")
    model = _model(tnx, checkpoint, compile=False, quant=cast)  # the constructor accepts it
    with pytest.warns(UserWarning, match="direct casting is enabled with dtype s8"), \
            pytest.raises(RuntimeError, match="Invalid device string: 's8'"):
        model.to_neuron()
    attn = tnx.QuantizationConfig(dequant_dtype="f32", no_quantize_list=["self_attn"])
    with pytest.raises(AssertionError, match="self attn quantization not allowed for this model"):
        _model(tnx, checkpoint, quant=attn)
    mlp_only = tnx.QuantizationConfig(dequant_dtype="f32", quantize_attn=False,
                                      no_quantize_list=["self_attn"])
    _model(tnx, checkpoint, quant=mlp_only)  # no attention quantized: no assert


# --- the KV cache (decoder.py:L1327-L1330, hlo.py:L1691-L1701) -----------------------------
def test_kv_cache_is_a_scale_less_cast(tnx, checkpoint) -> None:
    """Context encoding attends to fresh K/V; token generation reads the cached positions back
    through the cache dtype (llama/hlo.py:L614-L626): s8 without scales loses most of them,
    bf16 little."""
    import torch

    def decode(**config):
        model = _model(tnx, checkpoint, **config)
        first = _prefill(model)[0]
        return first, model.forward(_t([[9]]), _t([[len(PROMPT)]]), _t([0]))[0]

    plain_first, plain = decode()
    for dtype, near in (("s8", False), ("bf16", True)):
        kv = _kv(quant_dtype=dtype, dequant_dtype="f32")
        first, after = decode(kv_cache_quant=kv)
        assert torch.equal(first, plain_first)
        assert not torch.equal(after, plain)
        assert torch.allclose(after, plain, atol=0.05) == near


# --- on-device generation (layers/generation.py, decoder.py:L1065-L1114) -------------------
def test_on_device_generation_returns_token_ids_per_line(tnx, checkpoint) -> None:
    """forward returns the graph's token ids, not logits (base.py:L712-L713): [n, 1] int32
    (decoder.py:L365), decode rows in seq_ids order (base.py:L627-L639); greedy lines
    (top_k 1) are the argmax of the logits."""
    import torch

    plain = _model(tnx, checkpoint)
    model = _model(tnx, checkpoint, on_device_generation=_sampling(tnx))
    assert model.neuron_config.on_device_generation.vocab_size == 1024  # llama/model.py:L54-L55
    first = _prefill(model, slot=1)
    assert first.dtype == torch.int32 and tuple(first.shape) == (1, 1)
    assert int(first) == int(_prefill(plain, slot=1)[0].argmax())
    _prefill(model, [11, 12, 13], slot=0)
    _prefill(plain, [11, 12, 13], slot=0)
    both = model.forward(_t([[3], [4]]), _t([[4], [3]]), _t([1, 0]))
    logits = plain.forward(_t([[3], [4]]), _t([[4], [3]]), _t([1, 0]))
    assert tuple(both.shape) == (2, 1)
    assert both[:, 0].tolist() == logits.argmax(dim=-1).tolist()


def test_each_line_samples_with_its_seq_ids_parameters(tnx, checkpoint) -> None:
    """Under continuous batching a line's top_k/top_p/temperature are index_select-ed by its
    seq id (layers/generation.py:L107-L113), after the global top-k (L55-L56)."""
    import torch

    model = _model(tnx, checkpoint, batch=3, on_device_generation=_sampling(tnx, 3))
    plain = _model(tnx, checkpoint, batch=3)
    model.update_generation_config(_sampling(tnx, 3, top_k=[1, 4, 1], top_p=[1.0, 0.9, 1.0],
                                             temperature=[1.0, 0.5, 1.0]))
    _prefill(model, slot=2)
    logits = _prefill(plain, slot=2)[0]
    assert model.sampled[-1] == (2, 1, 1.0, 1.0)
    top4 = set(torch.topk(logits, 4).indices.tolist())
    for _ in range(20):
        token = int(_prefill(model, slot=1))
        assert token in top4
    assert model.sampled[-1] == (1, 4, 0.9, 0.5)


def test_generation_config_rules_at_compile(tnx, checkpoint) -> None:
    """validate_generation_configs (decoder.py:L1074-L1105) at to_neuron (L343-L346): lists the
    batch's length under per_batch_line, no lists without it; global_top_k needs dynamic
    (layers/generation.py:L47-L48, L139-L140); a greedy config is not checked for it."""
    with pytest.raises(AssertionError, match="must be of same size as bach_size"):
        _model(tnx, checkpoint, on_device_generation=_sampling(tnx, top_k=[1, 1, 1]))
    with pytest.raises(AssertionError, match="cannot be of type list when per_batch_line = False"):
        _model(tnx, checkpoint, on_device_generation=_sampling(tnx, per_batch_line=False))
    with pytest.raises(AssertionError, match="Dynamic on device generation must be enabled"):
        _model(tnx, checkpoint, on_device_generation=_sampling(tnx, dynamic=False))
    greedy = tnx.GenerationConfig(global_top_k=8)  # neither dynamic nor do_sample: argmax
    _model(tnx, checkpoint, on_device_generation=greedy)
    scalars = tnx.GenerationConfig(do_sample=True, dynamic=True, per_batch_line=True, top_k=1)
    model = _model(tnx, checkpoint, on_device_generation=scalars)
    assert model.neuron_config.on_device_generation.top_k == [1, 1]  # broadcast (L1075-L1076)


def test_update_generation_config_rules(tnx, checkpoint) -> None:
    """update_generation_config validates against the compiled config (decoder.py:L1107-L1108,
    L1067-L1070) and writes the dynamic tensors, which exist only with dynamic=True
    (L368-L377; AttributeError otherwise, inferred)."""
    model = _model(tnx, checkpoint, on_device_generation=_sampling(tnx))
    with pytest.raises(AssertionError, match="while current generation config has "
                                             "per_batch_line = True"):
        model.update_generation_config(tnx.GenerationConfig(do_sample=True, dynamic=True))
    with pytest.raises(AssertionError, match="must be of same size as bach_size"):
        model.update_generation_config(_sampling(tnx, top_k=[1]))
    static = tnx.GenerationConfig(do_sample=True, per_batch_line=True, top_k=2)
    fixed = _model(tnx, checkpoint, batch=2, on_device_generation=static, compile=False)
    with pytest.raises(AttributeError, match="has no attribute 'top_k'"):
        fixed.update_generation_config(tnx.GenerationConfig(per_batch_line=True))
    assert tnx.GenerationConfig(top_p=[1, 0]).top_p == [1.0, 0.0]  # config.py:L125
    assert tnx.GenerationConfig() == tnx.GenerationConfig()  # config.py:L133-L136


def test_features_name_other_neffs(tnx, checkpoint, tmp_path) -> None:
    """Quantized weights, a quantized cache and on-device generation build other graphs, so
    other NEFF names (base.py:L775-L785); no_quantize_list changes scale values only."""
    q = tnx.QuantizationConfig(quant_dtype="f8e4m3fn", dequant_dtype="f32")
    quant = _model(tnx, checkpoint, quant=q)
    quant.save(str(tmp_path / "quant"))
    listed = tnx.QuantizationConfig(quant_dtype="f8e4m3fn", dequant_dtype="f32",
                                    no_quantize_list=["model.layers.1"])
    again = _model(tnx, checkpoint, compile=False, quant=listed)
    again.load(str(tmp_path / "quant"))
    again.to_neuron()
    others = [{}, {"quant": tnx.QuantizationConfig(dequant_dtype="f32")},
              {"kv_cache_quant": _kv(dequant_dtype="f32")},
              {"on_device_generation": _sampling(tnx)}]
    for config in others:
        other = _model(tnx, checkpoint, compile=False, **config)
        other.load(str(tmp_path / "quant"))
        with pytest.raises(FileNotFoundError, match="matching NEFF"):
            other.to_neuron()
