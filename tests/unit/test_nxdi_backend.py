"""NxdiBackend on the NxD Inference fake: the checkpoint's tokens, joins and leaves, cached starts.

The fake (tests/fakes/nxdi) keeps one KV-cache line per seq_id and writes where the real
graphs write, so a call that would corrupt another sequence on Inf2 changes its tokens
here (tests/unit/test_nxdi_fake.py shows the rules).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handlers.backends.base import SamplingParams, SlotError
from handlers.backends.nxdi_backend import capabilities as nxdi_capabilities
from handlers.config import parse_config
from handlers.errors import (
    CacheError,
    ConfigError,
    NeuronUnavailableError,
    RequestError,
)
from tests.unit.fakes import one_each

RT_VARS = ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "NEURON_CC_FLAGS",
           "NEURON_COMPILE_CACHE_URL", "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS",
           "NEURON_RT_IO_RING_CACHE_SIZE", "XLA_HANDLE_SPECIAL_SCALAR", "UNSAFE_FP8FNCAST")
PROMPTS = [[1, 50, 60, 70, 80], [1, 90, 100, 110, 120, 130, 140, 150]]
TRANSFORMERS_5 = int(__import__("transformers").__version__.split(".")[0]) >= 5



def _config(tmp_path: Path, batch_size: int = 2, nxdi: dict | None = None, **neuron):
    settings = {"tp_degree": 2, "cores_per_instance": 4,
                "cache_dir": str(tmp_path / "cache"), "core_lock_dir": str(tmp_path / "locks"),
                **neuron}
    return parse_config({"handler": {"backend": "nxdi", "batch_size": batch_size,
                                     "max_length": 128, "max_new_tokens_limit": 64,
                                     "dtype": "float32",
                                     "defaults": {"max_new_tokens": 16},
                                     "neuron": settings, "nxdi": nxdi or {}}}).handler


def _backend(checkpoint: Path, tmp_path: Path, **kw):
    from handlers.backends.nxdi_backend import NxdiBackend

    return NxdiBackend(checkpoint, _config(tmp_path, **kw), tmp_path)


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


_REFERENCE: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def _reference(checkpoint: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the checkpoint by plain transformers (no cache)."""
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


def test_joins_and_leaves_keep_every_sequence_on_the_checkpoints_tokens(
        tiny_checkpoint, tmp_path, fake_nxdi) -> None:
    b = _backend(tiny_checkpoint, tmp_path, batch_size=3)
    assert b.start.compiled and b.eos_token_ids == frozenset({2})
    a = b.prefill([2], [PROMPTS[0]], [SamplingParams()])
    a += one_each(b.decode([2]))
    c = b.prefill([0], [PROMPTS[1]], [SamplingParams()])  # joins while slot 2 runs
    d = b.prefill([1], [[5]], [SamplingParams()])  # a 1-token prompt joins too
    for _ in range(3):
        x, y, z = one_each(b.decode([2, 0, 1]))  # not sorted: the backend sorts for the device
        a.append(x)
        c.append(y)
        d.append(z)
    b.release([0])  # c leaves mid-generation
    for _ in range(3):
        x, z = one_each(b.decode([1, 2]))[::-1]
        a.append(x)
        d.append(z)
    assert a == _reference(tiny_checkpoint, PROMPTS[0], 8)
    assert c == _reference(tiny_checkpoint, PROMPTS[1], 4)
    assert d == _reference(tiny_checkpoint, [5], 7)
    b.close()


@pytest.mark.parametrize("length", [1, 2, 7, 8, 9, 16])
def test_prefills_every_length_the_buckets_allow(tiny_checkpoint, tmp_path, fake_nxdi,
                                                 length) -> None:
    """Buckets [8, 16]: 1 and 2 tokens, bucket-1, bucket (runs the next), bucket+1, the largest."""
    b = _backend(tiny_checkpoint, tmp_path, context_length_estimate=[8, 16])
    assert b.max_prompt_length == 16
    prompt = [1 + (7 * i) % 500 for i in range(length)]
    assert _greedy(b, 1, prompt, 4) == _reference(tiny_checkpoint, prompt, 4)
    b.close()


@pytest.mark.skipif(not TRANSFORMERS_5, reason="the torch backend needs transformers 5")
def test_greedy_equals_the_torch_backend(tiny_checkpoint, tmp_path, fake_nxdi) -> None:
    from handlers.backends.torch_backend import TorchBackend

    cfg = parse_config({"handler": {"batch_size": 1, "max_length": 128,
                                    "max_new_tokens_limit": 64}}).handler
    ref = TorchBackend(tiny_checkpoint, cfg)
    b = _backend(tiny_checkpoint, tmp_path)
    for prompt in ([5], PROMPTS[1]):
        assert _greedy(b, 0, prompt, 8) == _greedy(ref, 0, prompt, 8)
    b.close()


def test_a_second_start_loads_from_the_cache(tiny_checkpoint, tmp_path, fake_nxdi) -> None:
    b = _backend(tiny_checkpoint, tmp_path)
    assert b.start.compiled
    entry = b.start.entry
    assert {p.name for p in entry.artifacts.iterdir()} == {"model.pt", "neuron_config.json"}
    b.close()
    b = _backend(tiny_checkpoint, tmp_path)
    assert not b.start.compiled and b.start.entry.name == entry.name
    assert _greedy(b, 0, PROMPTS[0], 3) == _reference(tiny_checkpoint, PROMPTS[0], 3)
    b.close()
    assert [e["event"] for e in _events(fake_nxdi)] == ["compile", "load", "load"]


def test_neuron_environment_and_cores(tiny_checkpoint, tmp_path, fake_nxdi) -> None:
    import os

    b = _backend(tiny_checkpoint, tmp_path)
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "0-1"
    other = _backend(tiny_checkpoint, tmp_path)  # a second worker gets the next block
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "2-3"
    loads = [e["visible_cores"] for e in _events(fake_nxdi) if e["event"] == "load"]
    assert loads == [[0, 1], [2, 3]]
    b.close()
    other.close()


def test_another_sdk_build_is_a_mismatch(tiny_checkpoint, tmp_path, fake_nxdi,
                                         monkeypatch) -> None:
    from neuron_cache import key

    _backend(tiny_checkpoint, tmp_path).close()
    real = key.sdk_versions
    monkeypatch.setattr(key, "sdk_versions", lambda dists=key.SDK_DISTRIBUTIONS: {
        **real(dists), "neuronx-distributed-inference": "0.7.14366"})
    with pytest.raises(CacheError, match="neuronx-distributed-inference"):
        _backend(tiny_checkpoint, tmp_path)
    b = _backend(tiny_checkpoint, tmp_path, on_mismatch="recompile")
    assert b.start.compiled
    b.close()


def test_on_device_sampling_greedy_and_refusals(tiny_checkpoint, tmp_path, fake_nxdi) -> None:
    b = _backend(tiny_checkpoint, tmp_path, on_device_sampling=True, global_top_k=50)
    assert _greedy(b, 0, PROMPTS[0], 4) == _reference(tiny_checkpoint, PROMPTS[0], 4)
    sampled = b.prefill([1], [PROMPTS[1]], [SamplingParams(temperature=0.8, top_k=20)])
    assert 0 <= sampled[0] < 1024
    b.release([1])
    for params, field in [(SamplingParams(temperature=1.0, seed=3), "seed"),
                          (SamplingParams(min_new_tokens=2), "min_new_tokens"),
                          (SamplingParams(temperature=1.0, top_k=51), "top_k")]:
        with pytest.raises(RequestError) as err:
            b.prefill([1], [PROMPTS[1]], [params])
        assert err.value.field == field
    b.close()


@pytest.mark.parametrize("body,field", [({"seed": 1, "temperature": 1.0}, "seed"),
                                        ({"min_new_tokens": 1}, "min_new_tokens"),
                                        ({"temperature": 1.0, "top_k": 300}, "top_k")])
def test_requests_it_cannot_honour_are_400s_naming_the_field(tmp_path, body, field) -> None:
    from handlers.api.request import parse_request
    from handlers.backends.capabilities import check_sampling

    def check(cfg) -> None:
        check_sampling(parse_request({"prompt": "hi", **body}, cfg).sampling,
                       nxdi_capabilities(cfg.neuron.on_device_sampling, cfg.neuron.global_top_k))

    with pytest.raises(RequestError) as err:
        check(_config(tmp_path, on_device_sampling=True))
    assert err.value.field == field and err.value.status == 400
    check(_config(tmp_path))  # host sampling: all fine


def test_a_seed_on_a_greedy_request_changes_nothing_so_it_is_honoured(tmp_path) -> None:
    from handlers.backends.capabilities import check_sampling

    check_sampling(SamplingParams(seed=3), nxdi_capabilities(True, 256))


def test_decode_must_cover_every_running_slot(tiny_checkpoint, tmp_path, fake_nxdi) -> None:
    b = _backend(tiny_checkpoint, tmp_path)
    b.prefill([0, 1], PROMPTS, [SamplingParams()] * 2)
    with pytest.raises(SlotError, match="every running slot"):
        one_each(b.decode([0]))
    with pytest.raises(SlotError, match="busy slot"):
        b.prefill([1], [PROMPTS[0]], [SamplingParams()])
    b.release([1])
    with pytest.raises(RequestError, match="prompt"):
        b.prefill([1], [list(range(1, 130))], [SamplingParams()])
    b.close()


def test_config_rules(tmp_path) -> None:
    with pytest.raises(ConfigError, match="continuous batching only"):
        parse_config({"handler": {"backend": "nxdi", "batching": "micro"}})
    with pytest.raises(ConfigError, match="token_generation_buckets"):
        _config(tmp_path, nxdi={"token_generation_buckets": [64, 256]})
    with pytest.raises(ConfigError, match="the largest, 64, must be handler.max_length 128"):
        _config(tmp_path, nxdi={"token_generation_buckets": [32, 64]})
    assert _config(tmp_path, nxdi={"token_generation_buckets": [128, 64]}).nxdi
    with pytest.raises(ConfigError, match="max_context_length"):
        _config(tmp_path, nxdi={"max_context_length": 32}, context_length_estimate=[16, 64])


def test_missing_sdk_names_the_install(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    for var in RT_VARS:
        monkeypatch.setenv(var, "")
    from handlers.backends.neuron_cores import available_cores, claim_cores

    with pytest.raises(NeuronUnavailableError, match="neuronx-distributed-inference"):
        _backend(tiny_checkpoint, tmp_path)
    n = _config(tmp_path).neuron
    claim = claim_cores(n, available_cores(n))
    assert claim.cores == (0, 1)  # the failed start released its block
    claim.release()


def test_a_neuron_config_field_the_sdk_drops_is_refused(tiny_checkpoint, tmp_path, fake_nxdi,
                                                        monkeypatch) -> None:
    from neuron_cache import key

    real = key.nxdi_neuron_config
    monkeypatch.setattr(key, "nxdi_neuron_config", lambda c: {**real(c), "no_such_field": 1})
    with pytest.raises(ConfigError, match="no_such_field"):
        _backend(tiny_checkpoint, tmp_path)


def test_a_failed_compile_leaves_no_staging_dir_and_no_entry(tiny_checkpoint, tmp_path,
                                                             fake_nxdi, monkeypatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM

    def fail(self, *args, **kwargs):
        raise RuntimeError("neuronx-cc failed")

    monkeypatch.setattr(NeuronBaseForCausalLM, "compile", fail)
    with pytest.raises(RuntimeError, match="neuronx-cc failed"):
        _backend(tiny_checkpoint, tmp_path)
    assert list((tmp_path / "tmp").iterdir()) == []
    cache = tmp_path / "cache"  # the compile stages in a hidden .tmp-* there
    assert not cache.exists() or [p.name for p in cache.iterdir()] in ([], [".locks"])


def test_host_sampling_reports_logprobs(tiny_checkpoint, tmp_path, fake_nxdi) -> None:
    b = _backend(tiny_checkpoint, tmp_path)
    b.prefill([0], [PROMPTS[1]], [SamplingParams(logprobs=1, presence_penalty=1.0)])
    chosen, top = b.token_logprobs(0)
    assert chosen <= 0 and len(top) == 1
    assert b.token_logprobs(1) is None
    b.close()
