"""NeuronBackend on the transformers-neuronx fake: the tokens the checkpoint gives, cached starts.

The fake decides each forward() the way the real library does and keeps a KV row per
compiled slot, so a call that would overwrite another sequence's cache on Inf2 changes
that sequence's tokens here (tests/unit/test_neuron_fake.py shows the rules).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from handlers.errors import ConfigError, GenerationError, NeuronUnavailableError, RequestError
from tests.unit.fakes import one_each

PROMPTS = [[1, 50, 60, 70, 80], [1, 90, 100, 110, 120, 130, 140, 150]]


@pytest.fixture
def checkpoint(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint  # tests/conftest.py: the demo model, built once per session



def _config(tmp_path: Path, batching: str = "continuous", batch_size: int = 2, **neuron):
    settings = {"tp_degree": 2, "cores_per_instance": 4,
                "cache_dir": str(tmp_path / "cache"), "core_lock_dir": str(tmp_path / "locks"),
                **neuron}
    return parse_config({"handler": {"backend": "neuron", "batching": batching,
                                     "batch_size": batch_size, "max_length": 128,
                                     "dtype": "float32",
                                     "max_new_tokens_limit": 64,
                                     "defaults": {"max_new_tokens": 16},
                                     "neuron": settings}}).handler


def _backend(checkpoint: Path, tmp_path: Path, batching: str = "continuous", batch_size: int = 2,
             **neuron):
    from handlers.backends.neuron_backend import NeuronBackend

    return NeuronBackend(checkpoint, _config(tmp_path, batching, batch_size, **neuron), tmp_path)


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


_REFERENCE: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def _reference(checkpoint: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the checkpoint by plain transformers (no cache), on any 4.x/5.x."""
    import torch
    from transformers import LlamaForCausalLM

    key = (str(checkpoint), tuple(prompt), n)
    if key not in _REFERENCE:
        hf = LlamaForCausalLM.from_pretrained(str(checkpoint)).eval()
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        _REFERENCE[key] = ids[len(prompt):]
    return _REFERENCE[key]


def _greedy(backend, slot: int, prompt: list[int], n: int) -> list[int]:
    out = backend.prefill([slot], [prompt], [SamplingParams()])
    out += [one_each(backend.decode([slot]))[0] for _ in range(n - 1)]
    backend.release([slot])
    return out


def test_continuous_matches_the_checkpoint_and_admits_mid_decode(checkpoint, tmp_path,
                                                                 fake_sdk) -> None:
    """Regression (issue 11 item 1): int32 cache ids with int64 token ids made every decode
    raise in the real _prepare_for_continuous_batching (base.py:L576-L585)."""
    b = _backend(checkpoint, tmp_path)
    assert b.start.compiled and b.eos_token_ids == frozenset({2})
    a = b.prefill([0], [PROMPTS[0]], [SamplingParams()])
    a += one_each(b.decode([0]))
    c = b.prefill([1], [PROMPTS[1]], [SamplingParams()])  # joins while slot 0 runs
    for _ in range(5):
        x, y = one_each(b.decode([0, 1]))
        a.append(x)
        c.append(y)
    assert a == _reference(checkpoint, PROMPTS[0], 7)
    assert c == _reference(checkpoint, PROMPTS[1], 6)
    b.release([0, 1])
    b.close()


@pytest.mark.skipif(int(__import__("transformers").__version__.split(".")[0]) < 5,
                    reason="handlers/backends/torch_backend.py needs transformers 5 (issue 11)")
def test_greedy_equals_the_torch_backend(checkpoint, tmp_path, fake_sdk) -> None:
    from handlers.backends.torch_backend import TorchBackend

    cfg = parse_config({"handler": {"batch_size": 1, "max_length": 128,
                                    "max_new_tokens_limit": 64}}).handler
    ref = TorchBackend(checkpoint, cfg)
    b = _backend(checkpoint, tmp_path)
    for prompt in ([67], PROMPTS[1]):
        assert _greedy(b, 0, prompt, 8) == _greedy(ref, 0, prompt, 8)
    b.close()


@pytest.mark.parametrize("length", [1, 2, 7, 8, 9, 16])
def test_continuous_prefills_every_length_the_buckets_allow(checkpoint, tmp_path, fake_sdk,
                                                            length) -> None:
    """Buckets [8, 16]: 1 and 2 tokens, bucket-1, bucket, bucket+1 (the next bucket), the
    largest; a 1-token prompt runs context encoding, not token generation."""
    b = _backend(checkpoint, tmp_path, context_length_estimate=[8, 16])
    prompt = [1 + (7 * i) % 500 for i in range(length)]
    assert _greedy(b, 1, prompt, 4) == _reference(checkpoint, prompt, 4)
    b.close()


def test_one_token_joiners_leave_a_running_request_alone(checkpoint, tmp_path, fake_sdk) -> None:
    """Regression (issue 11 item 2): a 1-token prompt went down token generation, which writes
    every compiled row at cache id 0 (base.py:L575-L587, layers/attention.py:L276-L296)."""
    b = _backend(checkpoint, tmp_path, batch_size=3)
    alone = _greedy(b, 0, PROMPTS[0], 7)
    running = b.prefill([0], [PROMPTS[0]], [SamplingParams()])
    running += one_each(b.decode([0]))
    joiner = b.prefill([1], [[67]], [SamplingParams()])  # "a": one token in the demo tokenizer
    for _ in range(3):
        x, y = one_each(b.decode([0, 1]))
        running.append(x)
        joiner.append(y)
    second = b.prefill([2], [[43]], [SamplingParams()])
    for _ in range(2):
        x, y, z = one_each(b.decode([0, 1, 2]))
        running.append(x)
        joiner.append(y)
        second.append(z)
    assert running == alone == _reference(checkpoint, PROMPTS[0], 7)
    assert joiner == _reference(checkpoint, [67], 6)
    assert second == _reference(checkpoint, [43], 3)
    b.close()


def test_decode_names_seq_ids_from_zero_so_logits_come_back_as_a_view(checkpoint, tmp_path,
                                                                        fake_sdk) -> None:
    """Slots 2 and 1 running, 0 free: the decode names seq ids 0..2, the free line as the
    SDK pads it (token 0 at cache id 0, base.py:L575-L585), and gets the transposed view
    back (L634-L635), not rows gathered through it; each running slot's tokens are its
    own, in the order asked, and the free line's pick is dropped."""
    b = _backend(checkpoint, tmp_path, batch_size=3)
    calls = []
    forward = b._runner.model.forward

    def spy(ids, cache_ids, seq_ids):
        out = forward(ids, cache_ids, seq_ids)
        calls.append((seq_ids.tolist(), ids[:, 0].tolist(), cache_ids[:, 0].tolist(),
                      out.stride()))
        return out

    b._runner.model.forward = spy
    first = b.prefill([2], [PROMPTS[0]], [SamplingParams()])
    second = b.prefill([1], [[67]], [SamplingParams()])
    for _ in range(3):
        x, y = one_each(b.decode([2, 1]))
        first.append(x)
        second.append(y)
    seq_ids, ids, cache_ids, stride = calls[2]
    assert seq_ids == [0, 1, 2] and ids[0] == 0 and cache_ids[0] == 0 and stride == (1, 3)
    assert first == _reference(checkpoint, PROMPTS[0], 4)
    assert second == _reference(checkpoint, [67], 4)
    b.close()


@pytest.mark.parametrize(("dtype", "batching", "neuron", "want"), [
    ("bfloat16", "continuous", {}, "bfloat16"), ("float16", "continuous", {}, "float16"),
    ("float32", "continuous", {}, None), ("bfloat16", "micro", {}, None),
    ("bfloat16", "continuous", {"on_device_sampling": True}, None)])
def test_host_sampled_logits_stay_in_the_models_dtype(tmp_path, fake_sdk, dtype, batching,
                                                      neuron, want) -> None:
    """cast_logits_dtype is the model's bf16/fp16 where our sampler reads the logits (the
    device's are in that dtype already, so no value changes); float32 elsewhere: micro's
    sample() draws on them in their own dtype. The SDK's NeuronConfig takes it."""
    from handlers.backends.neuron_backend import build_neuron_config, host_logits_dtype

    cfg = parse_config({"handler": {"backend": "neuron", "batching": batching,
                                    "batch_size": 2, "max_length": 128, "dtype": dtype,
                                    "max_new_tokens_limit": 64, "neuron": neuron}}).handler
    assert host_logits_dtype(cfg) == want
    nc = build_neuron_config({"continuous_batching": 2}, 2, cast_logits_dtype=want)
    assert nc.cast_logits_dtype == (want or "float32")


def test_every_model_call_runs_under_inference_mode(checkpoint, tmp_path, fake_sdk) -> None:
    """Regression (issue 11 item 3): forward()/sample() ran with autograd on."""
    b = _backend(checkpoint, tmp_path)
    eos_held = SamplingParams(min_new_tokens=3)  # the sampler edits the logits in place
    _greedy(b, 0, PROMPTS[0], 3)
    b.prefill([1], [[67]], [eos_held])
    one_each(b.decode([1]))
    assert b.model.inference_modes and all(b.model.inference_modes)
    b.close()
    m = _backend(checkpoint, tmp_path / "micro", "micro")
    m.prefill([0, 1], PROMPTS, [SamplingParams()] * 2)
    one_each(m.decode([0, 1]))
    m.release([0, 1])
    assert m.model.inference_modes and all(m.model.inference_modes)
    m.close()


def test_compilation_worker_count_reaches_neuron_config(checkpoint, tmp_path, fake_sdk) -> None:
    """handler.neuron.compilation_worker_count -> NeuronConfig (config.py:L239); 0 -> the SDK's
    default (None: every graph at once, base.py:L57-L58)."""
    _backend(checkpoint, tmp_path).close()  # the default, 1
    _backend(checkpoint, tmp_path / "all", compilation_worker_count=0).close()
    assert [e["compilation_worker_count"] for e in _events(fake_sdk)] == [1, None]


def test_keywords_the_sdk_would_swallow_are_refused(checkpoint, tmp_path, fake_sdk,
                                                    monkeypatch) -> None:
    """The real __init__ and sample() take **kwargs (llama/model.py:L32-L34, L405-L407): a
    name the class lacks would be ignored, so the backend checks its own."""
    import transformers_neuronx.llama.model as llama

    original = llama.LlamaForSampling.__init__

    def old_init(self, config, *, n_positions=2048, batch_size=1, amp="f32", neuron_config=None,
                 **kwargs):  # an SDK without tp_degree / context_length_estimate
        original(self, config, n_positions=n_positions, batch_size=batch_size, amp=amp,
                 neuron_config=neuron_config, **kwargs)

    monkeypatch.setattr(llama.LlamaForSampling, "__init__", old_init)
    with pytest.raises(ConfigError, match=r"takes no \['context_length_estimate', 'tp_degree'\]"):
        _backend(checkpoint, tmp_path)
    monkeypatch.setattr(llama.LlamaForSampling, "__init__", original)

    def old_sample(self, input_ids, sequence_length, start_ids=None, top_k=50, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(llama.LlamaForSampling, "sample", old_sample)
    with pytest.raises(ConfigError, match=r"sample\(\) takes no \['eos_token_override'"):
        _backend(checkpoint, tmp_path, "micro")


def test_micro_streams_through_sample(checkpoint, tmp_path, fake_sdk) -> None:
    b = _backend(checkpoint, tmp_path, "micro")
    b.warmup()
    first = b.prefill([0, 1], PROMPTS, [SamplingParams(), SamplingParams()])
    rows = [[first[0]], [first[1]]]
    for _ in range(4):
        x, y = one_each(b.decode([0, 1]))
        rows[0].append(x)
        rows[1].append(y)
    b.release([0])
    rows[1].append(one_each(b.decode([1]))[0])
    b.release([1])  # the last slot: stops the sample() thread
    assert rows[0] == _reference(checkpoint, PROMPTS[0], 5)
    assert rows[1] == _reference(checkpoint, PROMPTS[1], 6)
    assert b.prefill([0], [PROMPTS[0]], [SamplingParams()]) == rows[0][:1]  # next batch
    b.close()


def test_second_start_loads_from_cache_and_frees_cores(checkpoint, tmp_path, fake_sdk) -> None:
    first = _backend(checkpoint, tmp_path)
    first.close()
    second = _backend(checkpoint, tmp_path)
    assert not second.start.compiled and second.start.entry == first.start.entry
    assert [e["event"] for e in _events(fake_sdk)] == ["compile", "load"]
    assert [e["visible_cores"] for e in _events(fake_sdk)] == [[0, 1], [0, 1]]
    second.warmup()
    second.close()


def test_two_workers_get_disjoint_cores(checkpoint, tmp_path, fake_sdk) -> None:
    import os

    one = _backend(checkpoint, tmp_path)
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "0-1"
    two = _backend(checkpoint, tmp_path)
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "2-3"
    with pytest.raises(ConfigError, match="at most 2 worker"):
        _backend(checkpoint, tmp_path)
    one.close()
    two.close()


def test_seeded_sampling_is_reproducible_per_request(checkpoint, tmp_path, fake_sdk) -> None:
    b = _backend(checkpoint, tmp_path)
    p = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7)

    def run(slot: int) -> list[int]:
        out = b.prefill([slot], [PROMPTS[0]], [p])
        out += [one_each(b.decode([slot]))[0] for _ in range(6)]
        b.release([slot])
        return out

    assert run(0) == run(1)
    b.close()


def test_prompt_limits(checkpoint, tmp_path, fake_sdk) -> None:
    b = _backend(checkpoint, tmp_path, context_length_estimate=[16, 32])
    with pytest.raises(RequestError, match="largest prefill bucket 32"):
        b.prefill([0], [[1] * 33], [SamplingParams()])
    with pytest.raises(RequestError, match="expected 1 to 127"):
        b.prefill([0], [[1] * 128], [SamplingParams()])
    b.close()
    with pytest.raises(ConfigError, match="no bucket of 2 or more tokens"):
        _backend(checkpoint, tmp_path, context_length_estimate=[1])


def test_missing_sdk_names_the_install(checkpoint, tmp_path, fake_sdk, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers_neuronx", None)
    with pytest.raises(NeuronUnavailableError, match="pip.repos.neuron.amazonaws.com"):
        _backend(checkpoint, tmp_path)
    monkeypatch.delitem(sys.modules, "transformers_neuronx")
    _backend(checkpoint, tmp_path).close()  # the failed start released its cores


def test_unknown_model_class(checkpoint, tmp_path, fake_sdk) -> None:
    with pytest.raises(ConfigError, match="model_class_name"):
        _backend(checkpoint, tmp_path, model_class_name="llama.model.LlamaForSamplin")


@pytest.mark.skipif(int(__import__("transformers").__version__.split(".")[0]) < 5,
                    reason="handlers/backends/torch_backend.py needs transformers 5 (issue 11)")
def test_continuous_logprobs_and_penalties_equal_the_torch_backends(checkpoint, tmp_path,
                                                                   fake_sdk) -> None:
    """Continuous batching samples on the host: the same RowSampler as torch's."""
    from handlers.backends.torch_backend import TorchBackend

    cfg = parse_config({"handler": {"batch_size": 1, "max_length": 128,
                                    "max_new_tokens_limit": 64}}).handler
    p = SamplingParams(logprobs=2, repetition_penalty=1.5, frequency_penalty=0.5)
    runs = []
    for b in (TorchBackend(checkpoint, cfg), _backend(checkpoint, tmp_path)):
        tokens = b.prefill([0], [PROMPTS[1]], [p])
        logprobs = [b.token_logprobs(0)]
        for _ in range(5):
            tokens += one_each(b.decode([0]))
            logprobs.append(b.token_logprobs(0))
        b.release([0])
        runs.append((tokens, logprobs))
    (want, want_lp), (got, got_lp) = runs
    assert got == want
    assert [lp for lp, _ in got_lp] == pytest.approx([lp for lp, _ in want_lp], abs=1e-4)


def test_micro_refuses_a_batch_that_samples_differently(checkpoint, tmp_path, fake_sdk) -> None:
    """sample() takes one parameter set per call (transformers-neuronx@1ade6d7:
    src/transformers_neuronx/sampling.py:L311-L373): the scheduler groups requests so, and
    a mixed batch reaching the backend is an error, never a greedy request sampled."""
    from handlers.backends import capabilities_for

    b = _backend(checkpoint, tmp_path, "micro")
    assert b.capabilities == capabilities_for(_config(tmp_path, "micro"))
    assert b.capabilities.shared_sampling
    hot = SamplingParams(temperature=1.0)
    for params in ([SamplingParams(), hot], [SamplingParams(temperature=1.0, seed=1)] * 2):
        with pytest.raises(GenerationError, match="sample differently"):
            b.prefill([0, 1], PROMPTS, params)
    b.close()


def test_micro_seeded_request_reproduces_and_greedy_rows_stay_greedy(checkpoint, tmp_path,
                                                                    fake_sdk) -> None:
    b = _backend(checkpoint, tmp_path, "micro")
    seeded = SamplingParams(temperature=1.0, seed=11)

    def run(slots: list[int], params: list[SamplingParams], n: int = 5) -> list[list[int]]:
        rows = [[t] for t in b.prefill(slots, PROMPTS[:len(slots)], params)]
        for _ in range(n):
            for row, t in zip(rows, one_each(b.decode(slots)), strict=True):
                row.append(t)
        b.release(slots)
        return rows

    first = run([0], [seeded])
    run([0, 1], [SamplingParams(temperature=1.0)] * 2)  # moves the global RNG on
    assert run([1], [seeded]) == first
    greedy = run([0, 1], [SamplingParams(), SamplingParams(seed=5, top_k=3)])
    assert greedy[0] == _reference(checkpoint, PROMPTS[0], 6)
    assert greedy[1] == _reference(checkpoint, PROMPTS[1], 6)
    b.close()
