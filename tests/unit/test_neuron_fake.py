"""The transformers-neuronx fake raises where the real library raises, and only there.

Each test names the real lines it mirrors, at
aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/ (the source the issue
and the fake cite). Backend tests mean something only if these hold.
"""

from __future__ import annotations

import fcntl
import importlib
import inspect
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest

FAKES = Path(__file__).resolve().parents[1] / "fakes"
RT_VARS = ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "NEURON_CC_FLAGS")
FAKE_PACKAGES = ("transformers_neuronx", "torch_neuronx")


@pytest.fixture
def checkpoint(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint  # tests/conftest.py: the demo model (4 heads, 2 K/V heads)


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


def _continuous(tnx, checkpoint: Path, batch: int = 2, **kwargs):
    cb = tnx.NeuronConfig(continuous_batching=tnx.ContinuousBatchingConfig(
        batch_size_for_shared_caches=batch))
    model = _model(tnx, checkpoint, batch_size=batch, neuron_config=cb,
                   context_length_estimate=[8, 16], **kwargs)
    model.to_neuron()
    return model


def _events(tmp_path: Path) -> list[dict]:
    path = tmp_path / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _t(rows, dtype="int64"):
    import torch

    return torch.tensor(rows, dtype=getattr(torch, dtype))


def _hf_next_logits(checkpoint: Path, tokens: list[int]):
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(checkpoint)).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1]


# --- issue item 1: dtypes of a continuous token-generation call ---------------------------
def test_token_generation_needs_cache_ids_of_the_input_ids_dtype(tnx, checkpoint) -> None:
    """base.py:L576-L585 allocates full_cache_ids with input_ids.dtype and scatter_s cache_ids
    into it: int32 cache ids with int64 token ids raise torch's own scatter error."""
    model = _continuous(tnx, checkpoint)
    model.forward(_t([[5, 6, 7]]), _t([[0, 1, 2]]), _t([0]))
    with pytest.raises(RuntimeError, match=r"scatter\(\): Expected self.dtype to be equal to "
                                           r"src.dtype"):
        model.forward(_t([[9]]), _t([[3]], "int32"), _t([0], "int32"))
    model.forward(_t([[9]], "int32"), _t([[3]], "int32"), _t([0], "int32"))  # one dtype: fine
    model.forward(_t([[9]]), _t([[4]]), _t([0]))


# --- issue item 2: which path a call takes, and what it writes ----------------------------
def test_context_encoding_needs_two_tokens_from_cache_id_zero(tnx, checkpoint) -> None:
    """base.py:L502-L549: more than one token from cache id 0 is context encoding (prompt at
    most the largest bucket, L507-L508); more than one token from a later cache id is
    speculation, which asserts a speculative graph was compiled (L546-L547)."""
    model = _continuous(tnx, checkpoint)
    with pytest.raises(AssertionError, match=r"invalid input prompt length \(17 <= 16\)"):
        model.forward(_t([list(range(17))]), _t([list(range(17))]), _t([0]))
    with pytest.raises(AssertionError, match=r"invalid batch size for speculative forward"):
        model.forward(_t([[5, 6]]), _t([[3, 4]]), _t([0]))
    assert tuple(model.forward(_t([[5, 6]]), _t([[0, 1]]), _t([1])).shape) == (1, 1024)


def test_one_token_call_writes_position_zero_of_every_other_row(tnx, checkpoint) -> None:
    """A 1-token call is token generation (base.py:L502-L503 needs n_active_tokens > 1), padded
    to every compiled row with token 0 at cache id 0 (base.py:L575-L587), and the kernel writes
    each row at its cache id (layers/attention.py:L276-L296): the running row 0 changes."""
    import torch

    prompt = [5, 6, 7]
    model = _continuous(tnx, checkpoint)
    first = model.forward(_t([prompt]), _t([[0, 1, 2]]), _t([0]))
    assert torch.allclose(first[0], _hf_next_logits(checkpoint, prompt), atol=1e-4)
    model.forward(_t([[9]]), _t([[0]]), _t([1]))  # a 1-token "prompt" for row 1
    after = model.forward(_t([[11]]), _t([[3]]), _t([0]))
    intact = _hf_next_logits(checkpoint, [*prompt, 11])
    corrupt = _hf_next_logits(checkpoint, [0, 6, 7, 11])
    assert torch.allclose(after[0], corrupt, atol=1e-4)
    assert not torch.allclose(after[0], intact, atol=1e-2)


def test_a_token_twice_at_cache_ids_zero_is_a_one_token_context(tnx, checkpoint) -> None:
    """Context encoding takes logits at last_token_id = the max cache id (base.py:L443), masks
    by index (hlo.py:L3140-L3148) and writes only its own row: [t, t] at [0, 0] returns the
    logits of [t] and leaves the running row alone, with or without right padding."""
    import torch

    for buckets in ([8, 16], [2, 16]):  # padded to 8 (cache ids renumbered), or exactly 2
        cb = tnx.NeuronConfig(continuous_batching=tnx.ContinuousBatchingConfig(max_num_seqs=2))
        model = _model(tnx, checkpoint, neuron_config=cb, context_length_estimate=buckets)
        model.to_neuron()
        model.forward(_t([[5, 6, 7]]), _t([[0, 1, 2]]), _t([0]))
        one = model.forward(_t([[9, 9]]), _t([[0, 0]]), _t([1]))
        assert torch.allclose(one[0], _hf_next_logits(checkpoint, [9]), atol=1e-4)
        both = model.forward(_t([[11], [12]]), _t([[3], [1]]), _t([0, 1]))
        assert torch.allclose(both[0], _hf_next_logits(checkpoint, [5, 6, 7, 11]), atol=1e-4)
        assert torch.allclose(both[1], _hf_next_logits(checkpoint, [9, 12]), atol=1e-4)


def test_token_generation_returns_logits_in_seq_ids_order(tnx, checkpoint) -> None:
    """_postprocess (base.py:L630-L637) returns logits[seq_ids] for a token-generation call."""
    import torch

    model = _continuous(tnx, checkpoint)
    model.forward(_t([[5, 6, 7]]), _t([[0, 1, 2]]), _t([0]))
    model.forward(_t([[8, 9]]), _t([[0, 1]]), _t([1]))
    out = model.forward(_t([[12], [11]]), _t([[2], [3]]), _t([1, 0]))
    assert torch.allclose(out[0], _hf_next_logits(checkpoint, [8, 9, 12]), atol=1e-4)
    assert torch.allclose(out[1], _hf_next_logits(checkpoint, [5, 6, 7, 11]), atol=1e-4)
    assert out.is_contiguous()  # rows copied out of the transposed view (base.py:L636-L637)
    ordered = model.forward(_t([[11], [12]]), _t([[3], [2]]), _t([0, 1]))
    # seq ids 0..n-1: the device's [vocab, 1, rows] cast and viewed transposed (L715-L720)
    assert ordered.stride() == (1, 2) and ordered.dtype == torch.float32
    assert torch.equal(ordered, out.flip(0))


def test_positions_end_at_n_positions(tnx, checkpoint) -> None:
    """find_bucket_id (decoder.py:L2169-L2170) finds no token graph past n_positions."""
    model = _continuous(tnx, checkpoint)
    model.forward(_t([[5, 6]]), _t([[0, 1]]), _t([0]))
    model.forward(_t([[9]]), _t([[63]]), _t([0]))
    with pytest.raises(StopIteration):
        model.forward(_t([[9]]), _t([[64]]), _t([0]))


# --- issue item 3: the fake sees the caller's grad mode -----------------------------------
def test_forward_records_inference_mode(tnx, checkpoint) -> None:
    """The real forward has no grad guard of its own (llama/model.py:L290-L303) and embeds on
    CPU with trainable weights (L280-L282); the fake records the mode for backend tests."""
    import torch

    model = _continuous(tnx, checkpoint)
    model.forward(_t([[5, 6]]), _t([[0, 1]]), _t([0]))
    with torch.inference_mode():
        model.forward(_t([[7]]), _t([[2]]), _t([0]))
    assert model.inference_modes == [False, True]


# --- issue item 9: signatures, leniency and lifecycle --------------------------------------
def test_sample_takes_cache_ids_third_and_ignores_unknown_keywords(tnx, checkpoint) -> None:
    """LlamaForSampling.sample(input_ids, sequence_length, cache_ids=None, start_ids=None, ...,
    **kwargs) (llama/model.py:L405-L407)."""
    model = _model(tnx, checkpoint)
    assert list(inspect.signature(model.sample).parameters)[:4] == [
        "input_ids", "sequence_length", "cache_ids", "start_ids"]
    model.to_neuron()
    out = model.sample(_t([[5, 6, 7], [8, 9, 10]]), 6, None, None, top_k=1, bogus=True)
    assert tuple(out.shape) == (2, 6)
    with pytest.raises(ValueError, match="top_k has to be a strictly positive int"):
        model.sample(_t([[5, 6, 7], [8, 9, 10]]), 8, top_k=0)  # sampling.py:L183-L185


def test_continuous_batching_config_is_keyword_only(tnx) -> None:
    """ContinuousBatchingConfig(**kwargs): max_num_seqs, else batch_size_for_shared_caches
    (config.py:L78-L87)."""
    assert tnx.ContinuousBatchingConfig(max_num_seqs=3).batch_size_for_shared_caches == 3
    assert tnx.ContinuousBatchingConfig(batch_size_for_shared_caches=4).max_num_seqs == 4
    with pytest.raises(TypeError):
        tnx.ContinuousBatchingConfig(4)
    with pytest.raises(KeyError, match="batch_size_for_shared_caches"):
        tnx.ContinuousBatchingConfig()
    with pytest.raises(AssertionError, match="unexpected key word arguments"):
        tnx.ContinuousBatchingConfig(max_num_seqs=2, batch_size=2)


def test_neuron_config_keywords_and_asserts(tnx) -> None:
    """NeuronConfig asserts unknown keywords away (config.py:L315-L317), forces right padding
    under continuous batching (L272-L275) and takes compilation_worker_count (L239)."""
    with pytest.raises(AssertionError, match="Unexpected NeuronConfig keyword arguments"):
        tnx.NeuronConfig(continuous_batch=True)
    with pytest.raises(AssertionError, match="cast_logits_dtype"):
        tnx.NeuronConfig(cast_logits_dtype="float64")
    assert tnx.NeuronConfig(compilation_worker_count=2).compilation_worker_count == 2
    cb = tnx.NeuronConfig(padding_side="left",
                          continuous_batching=tnx.ContinuousBatchingConfig(max_num_seqs=2))
    assert cb.padding_side == "right" and cb.use_2d_cache_ids


def test_constructor_swallows_unknown_keywords(tnx, checkpoint) -> None:
    """LlamaForSampling.__init__(..., **kwargs) ignores what it does not know
    (llama/model.py:L32-L34): a misspelt n_positions leaves the default 2048."""
    model = tnx.LlamaForSampling.from_pretrained(str(checkpoint), batch_size=2, n_position=64)
    assert model.token_buckets == [128, 256, 512, 1024, 2048]


def test_heads_tp_does_not_divide_are_padded_and_kv_heads_replicated(tnx, checkpoint,
                                                                      tmp_path) -> None:
    """Q heads are padded to a multiple of tp silently (utils.py:L325-L399); K/V heads tp does
    not divide are replicated with a warning (decoder.py:L171-L176)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = _model(tnx, checkpoint, tp_degree=3)  # 4 heads, 2 K/V heads
    assert any("KV head replication will be enabled" in str(w.message) for w in seen)
    assert model.neuron_config.group_query_attention == tnx.GQA.REPLICATED_HEADS
    mha = tmp_path / "mha"
    shutil.copytree(checkpoint, mha)
    config = json.loads((mha / "config.json").read_text())
    (mha / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = _model(tnx, mha, tp_degree=3)  # MHA: padded, no warning
    assert model.neuron_config.group_query_attention is None


def test_shard_over_batch_falls_back_with_a_warning(tnx, checkpoint) -> None:
    """decoder.py:L127-L140: a batch tp does not divide turns shard-over-batch off."""
    nc = tnx.NeuronConfig(group_query_attention="shard-over-batch")
    with pytest.warns(UserWarning, match="Cannot enable"):
        _model(tnx, checkpoint, tp_degree=2, batch_size=3, neuron_config=nc)
    assert nc.group_query_attention == tnx.GQA.SHARD_OVER_HEADS


def test_from_pretrained_asserts(tnx, checkpoint) -> None:
    """module.py:L398-L422: the shared-cache batch is the batch; buckets fit n_positions."""
    cb = tnx.NeuronConfig(continuous_batching=tnx.ContinuousBatchingConfig(max_num_seqs=3))
    with pytest.raises(AssertionError, match=r"invalid batch_size_for_shared_caches \(3\), 2"):
        _model(tnx, checkpoint, neuron_config=cb)
    with pytest.raises(AssertionError, match="cannot be more than max n_positions 64"):
        _model(tnx, checkpoint, context_length_estimate=[128])


def test_lifecycle_rules(tnx, checkpoint: Path, tmp_path: Path) -> None:
    """save() before to_neuron() has no program (base.py:L39-L46, decoder.py:L1062-L1063);
    forward() before it embeds with an uninitialized weight (llama/model.py:L280-L282);
    load() only records a directory (base.py:L50-L52); a NEFF that is not there fails
    to_neuron() (base.py:L775-L785)."""
    model = _model(tnx, checkpoint)
    with pytest.raises(AttributeError, match="get_kernels"):
        model.save(str(tmp_path / "neff"))
    with pytest.raises(ValueError, match="uninitialized parameter"):
        model.forward(_t([[1, 2, 3], [4, 5, 6]]))
    model.to_neuron()
    model.load(str(tmp_path))  # lenient: nothing happens until the next to_neuron()
    model.save(str(tmp_path / "neff"))
    assert [e["event"] for e in _events(tmp_path)] == ["compile"]

    again = _model(tnx, checkpoint)
    again.load(str(tmp_path / "neff"))
    again.to_neuron()
    assert [e["event"] for e in _events(tmp_path)] == ["compile", "load"]

    other = _model(tnx, checkpoint, batch_size=4)  # other shapes: other NEFF names
    other.load(str(tmp_path / "neff"))
    with pytest.raises(FileNotFoundError, match="matching NEFF"):
        other.to_neuron()


def test_compilation_worker_count(tnx, checkpoint, tmp_path) -> None:
    """compile() runs ProcessPoolExecutor(compilation_worker_count) (base.py:L55-L64, L88):
    None means one worker per graph, 0 is refused by the executor."""
    _model(tnx, checkpoint, neuron_config=tnx.NeuronConfig(compilation_worker_count=1)
           ).to_neuron()
    assert _events(tmp_path)[-1]["compilation_worker_count"] == 1
    with pytest.raises(ValueError, match="max_workers must be greater than 0"):
        _model(tnx, checkpoint, neuron_config=tnx.NeuronConfig(compilation_worker_count=0)
               ).to_neuron()


def test_static_batch_and_sample_rules(tnx, checkpoint) -> None:
    """sample() checks the compiled batch (llama/model.py:L416-L419); a static context of an
    uncompiled batch has no graph (base.py:L274)."""
    model = _model(tnx, checkpoint)
    model.to_neuron()
    with pytest.raises(ValueError, match="not compiled for batch_size : 3"):
        model.sample(_t([[1, 2]] * 3), sequence_length=8)
    with pytest.raises(KeyError):
        model.forward(_t([[1, 2, 3]] * 3))
    logits = model.forward(_t([[1, 2, 3, 4]] * 2))
    assert tuple(logits.shape) == (2, 1024)


def test_streamer_gets_batch_by_one_tensors(tnx, checkpoint: Path) -> None:
    """sample_loop_llama puts each [batch, 1] step, then end() (sampling.py:L360-L378)."""
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
    out = model.sample(_t([[1, 2, 3, 4]] * 2), sequence_length=10, top_k=1,
                       eos_token_override=-1, streamer=rec)
    assert rec.shapes == [(2, 1)] * 6 and rec.ended and tuple(out.shape) == (2, 10)


# --- the checkpoint loader (module.py:L434-L460) -------------------------------------------
def _logits_of(tnx, checkpoint: Path):
    model = _model(tnx, checkpoint)
    model.to_neuron()
    return model.forward(_t([[5, 6, 7]] * 2))


def test_loader_reads_every_layout_the_real_one_reads(tnx, checkpoint, tmp_path) -> None:
    """Split pytorch_model.bin/ with key_to_filename.json (module.py:L218-L225) and the sharded
    pytorch_model.bin.index.json (L186-L197) load like model.safetensors."""
    import torch
    from safetensors.torch import load_file

    from archive_tools.prepare import prepare

    want = _logits_of(tnx, checkpoint)
    split = prepare(checkpoint, tmp_path / "split", legacy_split=True, show_progress=False)
    assert torch.equal(_logits_of(tnx, split), want)
    sharded = tmp_path / "bin-index"
    shutil.copytree(checkpoint, sharded)
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    keys = sorted(tensors)
    halves = {"pytorch_model-1.bin": keys[::2], "pytorch_model-2.bin": keys[1::2]}
    for name, part in halves.items():
        torch.save({k: tensors[k] for k in part}, sharded / name)
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: n for n, part in halves.items() for k in part}}))
    assert torch.equal(_logits_of(tnx, sharded), want)


def test_loader_rejects_what_the_real_one_rejects(tnx, checkpoint, tmp_path) -> None:
    """No weights: FileNotFoundError (module.py:L460); a split dir needs key_to_filename.json
    (L222-L224); pytorch_model.bin loads exact names, so a missing lm_head stays uninitialized
    (L118-L127) while the lazy formats tie it to the embedding (L142-L159)."""
    import torch
    from safetensors.torch import load_file, save_file

    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="Can not find model.safetensors"):
        _model(tnx, bare)
    (bare / "pytorch_model.bin").mkdir()
    with pytest.raises(FileNotFoundError, match="key_to_filename.json"):
        _model(tnx, bare)
    (bare / "pytorch_model.bin").rmdir()
    tensors = load_file(str(checkpoint / "model.safetensors"))
    del tensors["lm_head.weight"]
    torch.save(tensors, bare / "pytorch_model.bin")
    model = _model(tnx, bare)
    with pytest.raises(ValueError, match="uninitialized parameter"):
        model.to_neuron()
    (bare / "pytorch_model.bin").unlink()
    save_file(tensors, str(bare / "model.safetensors"))
    _model(tnx, bare).to_neuron()  # lm_head tied to embed_tokens


def test_rotary_theta_is_read_as_the_real_library_reads_it(tnx, checkpoint, tmp_path) -> None:
    """LlamaConfig reads getattr(config, "rope_theta", 10000) (llama/config.py:L43): a theta kept
    only under rope_parameters (transformers 5) is not seen."""
    import torch

    moved = tmp_path / "theta"
    shutil.copytree(checkpoint, moved)
    config = json.loads((moved / "config.json").read_text())
    config.pop("rope_theta", None)
    config["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    (moved / "config.json").write_text(json.dumps(config))
    assert torch.allclose(_logits_of(tnx, moved), _logits_of(tnx, checkpoint), atol=1e-5)


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
