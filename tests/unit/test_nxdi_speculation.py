"""Fused speculation on the nxdi backend, on the NxD Inference fake.

The fake (tests/fakes/nxdi/neuronx_distributed_inference/models/_fused_spec.py) runs the
real fused step's rule: S = speculation_length single-token draft steps (greedy), the
target's S tokens at the same positions, kept up to the first draft it did not choose;
draft and target each keep their KV-cache lines, so a step that writes in the wrong place
changes a sequence's tokens here. Drafts: a noisy copy of the model (accepts some runs,
rejects others), the model itself (accepts every draft: S tokens a step), the demo model
of another seed (same vocabulary, rarely agrees). Citations are to aws-neuron/
neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from handlers.engine.core import Engine
from handlers.engine.scheduler import FinishEvent, Scheduler, Sequence
from handlers.errors import ConfigError, RequestError

ROOT = Path(__file__).resolve().parents[2]
NXDI = ROOT / "tests" / "fakes" / "nxdi"
K = 3  # drafts a step: speculation_length S = K + 1
S = K + 1
TEXTS = ["The quick brown fox", "Once upon a time", "In the beginning the", "She said that",
         "It was the best of times", "Water", "He went to the market and"]


def noisy_copy(src: Path, dst: Path, eps: float, seed: int = 0) -> Path:
    """`src` with every matrix perturbed by eps x its std: agrees often, not always."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    noisy = {k: v + eps * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v
             for k, v in weights.items()}
    save_file(noisy, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model dir as an archive holds it: model/ and the drafts beside it."""
    from archive_tools.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("nxdi-spec")
    shutil.copytree(tiny_checkpoint, root / "model")
    noisy_copy(tiny_checkpoint, root / "draft", 0.1)
    shutil.copytree(tiny_checkpoint, root / "same")
    build_demo_model(root / "far", "tiny", seed=1)
    return root


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from handlers.engine.start import load_tokenizer

    return load_tokenizer(model_dir / "model")



def _handler(tmp_path: Path, batch_size: int = 2, draft: str = "draft", nxdi: dict | None = None,
             k: int = K, **neuron) -> dict:
    settings = {"tp_degree": 2, "cores_per_instance": 4, "cache_dir": str(tmp_path / "cache"),
                "core_lock_dir": str(tmp_path / "locks"), "on_device_sampling": True,
                "global_top_k": 64, "context_length_estimate": [16, 128], **neuron}
    if draft:
        settings["speculation"] = {"draft_checkpoint": draft, "length": k}
    return {"handler": {"backend": "nxdi", "batching": "continuous", "batch_size": batch_size,
                        "max_length": 128, "dtype": "float32", "max_new_tokens_limit": 64,
                        "defaults": {"max_new_tokens": 16}, "neuron": settings,
                        "nxdi": nxdi or {}}}


def _backend(model_dir: Path, tmp_path: Path, batch_size: int = 2, draft: str = "draft",
             **kw):
    from handlers.backends.nxdi_backend import NxdiBackend

    config = parse_config(_handler(tmp_path, batch_size, draft, **kw)).handler
    return NxdiBackend(model_dir / "model", config, model_dir)


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _counting(backend) -> list[list[int]]:
    """Record how many tokens each decode gave each row."""
    seen: list[list[int]] = []
    decode = backend.decode

    def counted(slots):
        rows = decode(slots)
        seen.append([len(r) for r in rows])
        return rows

    backend.decode = counted
    return seen


def _serve(backend, tokenizer, requests: list[tuple]) -> dict[str, FinishEvent]:
    """Each (id, prompt ids, max_new_tokens, stop strings, step it arrives at) through the
    Engine, one step at a time; each request's finish event."""
    engine = Engine(backend, Scheduler(backend.batch_size))
    events: dict[str, list] = {}
    pending = sorted(requests, key=lambda r: r[4])
    for step in range(500):
        while pending and pending[0][4] <= step:
            rid, prompt, n, stop, _ = pending.pop(0)
            engine.submit(Sequence(request_id=rid, prompt_ids=list(prompt), max_new_tokens=n,
                                   sampling=SamplingParams(), stop=stop, tokenizer=tokenizer,
                                   sink=events.setdefault(rid, []).append))
        if not pending and not engine.scheduler.has_work():
            break
        engine.step()
    assert all(isinstance(e[-1], FinishEvent) for e in events.values()), events
    return {rid: e[-1] for rid, e in events.items()}


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


# --- through the Engine: greedy with speculation == greedy without ---------------------------
@pytest.mark.parametrize("streams", [1, 8])
def test_greedy_through_the_engine_equals_greedy_without_speculation(
        model_dir, tmp_path, fake_nxdi, tokenizer, streams) -> None:
    """1 stream: one slot, requests one after another. 8 streams: six start together, a
    1-token prompt and another join at steps 2 and 3 while the others are mid-speculation.
    Stop strings (from the middle of three answers) and max_new_tokens end them wherever
    the accepted runs put them."""
    prompts = [[67]] + [_ids(tokenizer, t) for t in TEXTS]
    requests = [(f"r{i}", p, 10 + 3 * (i % 5), (), 0 if streams == 1 else (2 if i == 0 else 3
                                                                           if i == 7 else 0))
                for i, p in enumerate(prompts)]
    plain = _backend(model_dir, tmp_path / "plain", streams, draft="")
    texts = {rid: e.text for rid, e in _serve(plain, tokenizer, requests).items()}
    for i in (1, 4, 7):  # a stop string inside the answer: it ends there
        text = texts[f"r{i}"]
        stop = next(text[j:j + 3] for j in range(len(text) // 2, len(text) - 3)
                    if text[j:j + 3].strip())
        requests[i] = (*requests[i][:3], (stop,), requests[i][4])
    expected = _serve(plain, tokenizer, requests)
    plain.close()
    assert [expected[f"r{i}"].reason for i in (1, 4, 7)] == ["stop"] * 3
    spec = _backend(model_dir, tmp_path / "spec", streams)
    assert spec.max_tokens_per_step == S
    seen = _counting(spec)
    got = _serve(spec, tokenizer, requests)
    spec.close()
    assert got == expected  # text, token ids, reason and counts of every request
    counts = [n for step in seen for n in step]
    assert max(counts) > 1 and min(counts) == 1  # runs accepted, and drafts rejected
    assert len(seen) < sum(e.completion_tokens for e in expected.values())


def test_a_stop_string_and_max_new_tokens_ending_inside_an_accepted_run(
        model_dir, tmp_path, fake_nxdi, tokenizer) -> None:
    """With the model as its own draft every step accepts all S - 1 drafts: a request's
    tokens come as 1 (prefill), then S a step. max_new_tokens 1 + S + 2 and a stop string
    completed inside the first run end mid-run, exactly as without speculation."""
    prompt = _ids(tokenizer, TEXTS[1])
    plain = _backend(model_dir, tmp_path / "plain", draft="")
    ref = _serve(plain, tokenizer, [("ref", prompt, 20, (), 0)])["ref"].token_ids
    text = tokenizer.decode(list(ref))
    stop = next(s for j in range(2, S)
                if (s := tokenizer.decode(list(ref[:j + 1]))[-3:]).strip()
                and text.find(s) + len(s) == len(tokenizer.decode(list(ref[:j + 1]))))
    requests = [("len", prompt, 1 + S + 2, (), 0), ("stop", prompt, 20, (stop,), 0)]
    expected = _serve(plain, tokenizer, requests)
    plain.close()
    spec = _backend(model_dir, tmp_path / "spec", draft="same")
    seen = _counting(spec)
    got = _serve(spec, tokenizer, requests)
    spec.close()
    assert got == expected
    assert seen[0] == [S, S]  # every draft accepted
    assert (got["len"].reason, got["len"].completion_tokens) == ("length", 1 + S + 2)
    assert got["stop"].reason == "stop" and 1 < got["stop"].completion_tokens < 1 + S


def test_kv_positions_advance_by_the_accepted_count(model_dir, tmp_path, fake_nxdi) -> None:
    """A draft that rarely agrees (another seed): mostly one token a step, and the tokens
    stay the model's; two slots at different lengths decode together."""
    plain = _backend(model_dir, tmp_path / "plain", draft="")
    spec = _backend(model_dir, tmp_path / "spec", draft="far")
    runs = {}
    for name, b in (("plain", plain), ("spec", spec)):
        out = {0: b.prefill([0], [[1, 50, 60, 70]], [SamplingParams()]),
               1: b.prefill([1], [[5]], [SamplingParams()])}
        while min(map(len, out.values())) < 10:
            for slot, row in zip((1, 0), b.decode([1, 0]), strict=True):
                out[slot] += row
        runs[name] = {s: t[:10] for s, t in out.items()}
        assert [r.length for r in (b.rows[0], b.rows[1])] == [4 + len(out[0]) - 1,
                                                              1 + len(out[1]) - 1]
        b.close()
    assert runs["spec"] == runs["plain"]


# --- limits ----------------------------------------------------------------------------------
def test_limits_leave_room_for_the_fused_step(model_dir, tmp_path, fake_nxdi) -> None:
    """A step at position p writes p..p+S-1 and must fit the largest token bucket, p + S <=
    128 (models/model_wrapper.py:L826-L841, L898-L916): the engine gets max_length
    128 - S + 2, so its last decode (p = max_length - 2) fits exactly."""
    b = _backend(model_dir, tmp_path)
    assert (b.max_length, b.max_tokens_per_step, b.max_prompt_length) == (128 - S + 2, S,
                                                                          128 - S + 1)
    assert "logprobs" in b.capabilities.unsupported
    b.warmup()
    with pytest.raises(RequestError, match=f"expected 1 to {128 - S + 1}"):
        b.prefill([0], [[5] * (128 - S + 2)], [SamplingParams()])
    b.prefill([0], [[5] * (b.max_length - 2)], [SamplingParams()])
    rows = b.decode([0])  # p = max_length - 2 writes up to position 127
    assert 1 <= len(rows[0]) <= S
    b.close()


def test_a_sequence_runs_to_max_length(model_dir, tmp_path, fake_nxdi, tokenizer) -> None:
    spec = _backend(model_dir, tmp_path / "spec", draft="same")
    prompt = [1] + [50 + i for i in range(99)]
    got = _serve(spec, tokenizer, [("long", prompt, 64, (), 0)])["long"]
    spec.close()
    assert (got.reason, got.prompt_tokens + got.completion_tokens) == ("length", 128 - S + 2)
    plain = _backend(model_dir, tmp_path / "plain", draft="")
    ref = _serve(plain, tokenizer, [("long", prompt, got.completion_tokens, (), 0)])["long"]
    plain.close()
    assert got.token_ids == ref.token_ids


def test_sampled_requests_run_and_keep_one_to_s_tokens(model_dir, tmp_path, fake_nxdi) -> None:
    b = _backend(model_dir, tmp_path, draft="same")
    hot = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    b.prefill([0], [[1, 50, 60, 70]], [hot])
    b.prefill([1], [[1, 90, 100]], [SamplingParams()])
    for _ in range(4):
        rows = b.decode([0, 1])
        assert all(1 <= len(r) <= S and all(0 <= t < 1024 for t in r) for r in rows)
        assert len(rows[1]) == S  # greedy with its own copy as draft: every draft kept
    b.close()


@pytest.mark.parametrize("neuron,nxdi,match", [
    ({"context_length_estimate": [S, 128]}, {}, r"bucket\(s\) \[4\] equal 1 or"),
    ({"quantization": {"weights": "int8"}}, {}, "quantization.weights"),
    ({}, {"async_mode": True}, "async_mode"),
])
def test_what_the_backend_refuses_with_speculation(model_dir, tmp_path, fake_nxdi, neuron, nxdi,
                                                   match) -> None:
    with pytest.raises(ConfigError, match=match):
        _backend(model_dir, tmp_path, nxdi=nxdi, **neuron)


def test_a_missing_draft_is_a_config_error(model_dir, tmp_path, fake_nxdi) -> None:
    with pytest.raises(ConfigError, match="nowhere has no config.json; package the draft"):
        _backend(model_dir, tmp_path, draft="nowhere")


# --- compile -> save -> load, in a fresh process -----------------------------------------------
FRESH = """
import json, sys
from pathlib import Path
from handlers.backends.base import SamplingParams
from handlers.backends.nxdi_backend import NxdiBackend
from handlers.config import parse_config
raw, model_dir, prompt = json.loads(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
b = NxdiBackend(model_dir / "model", parse_config(raw).handler, model_dir)
out = b.prefill([0], [prompt], [SamplingParams()])
while len(out) < 12:
    out += b.decode([0])[0]
print(json.dumps({"compiled": b.start.compiled, "tokens": out[:12]}))
b.close()
"""


def test_compile_save_load_in_a_fresh_process_compiles_nothing(model_dir, tmp_path,
                                                               fake_nxdi) -> None:
    """One entry holds the fused model (target and draft graphs; neuron_config.json names
    the draft); a fresh process loads it, sharding both checkpoints, and compiles nothing.
    The key holds k and the draft's config.json: without speculation, or with another k,
    it is another entry."""
    prompt = [1, 50, 60, 70, 80]
    b = _backend(model_dir, tmp_path)
    first = b.prefill([0], [prompt], [SamplingParams()])
    while len(first) < 12:
        first += b.decode([0])[0]
    entry = b.start.entry
    assert b.start.compiled
    b.close()
    saved = json.loads((entry.artifacts / "neuron_config.json").read_text())
    assert saved["neuron_config"]["speculation_length"] == S
    assert saved["neuron_config"]["enable_fused_speculation"] is True
    assert saved["fused_spec_config"]["draft_model_path"] == str(model_dir / "draft")
    assert saved["fused_spec_config"]["draft_config"]["neuron_config"]["speculation_length"] == 0
    metadata = (entry.path / "metadata.json").read_text()
    assert '"speculation"' in metadata and '"draft_model_config"' in metadata

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(NXDI), str(ROOT)]),
           "INF2SERVE_FAKE_NEURON_DEVICE_DIR": str(tmp_path / "device-2")}
    r = subprocess.run([sys.executable, "-c", FRESH, json.dumps(_handler(tmp_path)),
                        str(model_dir), json.dumps(prompt)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    fresh = json.loads(r.stdout.strip().splitlines()[-1])
    assert fresh == {"compiled": False, "tokens": first[:12]}
    events = _events(fake_nxdi)
    assert [e["event"] for e in events] == ["compile", "load", "load"]
    assert events[2]["pid"] != events[1]["pid"]
    assert events[2]["directory"] == os.path.join(str(entry.artifacts), "")
    assert events[2]["draft"] == str(model_dir / "draft")

    for kw in ({"draft": ""}, {"k": K + 1}):
        other = _backend(model_dir, tmp_path, **kw)
        assert other.start.compiled and other.start.entry.name != entry.name
        other.close()


def test_a_draft_of_another_architecture_is_another_entry(model_dir, tmp_path,
                                                          fake_nxdi) -> None:
    """Weights are sharded at every load, so a draft with the same config.json (the noisy
    copy) shares the entry; the key changes with the draft's graph config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    small = model_dir / "small"
    if not small.exists():
        cfg = json.loads((model_dir / "model" / "config.json").read_text())
        cfg["num_hidden_layers"] = 1
        LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(str(small))
    a = _backend(model_dir, tmp_path, draft="draft")
    a.close()
    b = _backend(model_dir, tmp_path, draft="same")
    assert not b.start.compiled and b.start.entry.name == a.start.entry.name
    b.close()
    c = _backend(model_dir, tmp_path, draft="small")
    assert c.start.compiled and c.start.entry.name != a.start.entry.name
    assert c.prefill([0], [[1, 50, 60]], [SamplingParams()])
    c.close()


# --- the fake raises where NxD Inference raises ------------------------------------------------
def _nc(**kw):
    from neuronx_distributed_inference.models.config import NeuronConfig, OnDeviceSamplingConfig

    base = {"batch_size": 2, "ctx_batch_size": 1, "tkg_batch_size": 2, "seq_len": 64,
            "max_context_length": 32, "is_continuous_batching": True, "tp_degree": 2,
            "torch_dtype": "float32", "enable_bucketing": True,
            "context_encoding_buckets": [8, 32], "token_generation_buckets": [32, 64],
            "on_device_sampling_config": OnDeviceSamplingConfig(
                do_sample=True, dynamic=True, global_topk=64),
            "speculation_length": S, "enable_fused_speculation": True}
    return NeuronConfig(**{**base, **kw})


def _fused(model_dir: Path, draft: str = "draft", draft_nc: dict | None = None, **kw):
    """NeuronLlamaForCausalLM with a FusedSpecNeuronConfig, as the backend builds it."""
    import copy

    from neuronx_distributed_inference.models.config import FusedSpecNeuronConfig
    from neuronx_distributed_inference.models.llama.modeling_llama import (
        LlamaInferenceConfig,
        NeuronLlamaForCausalLM,
    )
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    cfg = LlamaInferenceConfig(_nc(**kw), load_config=load_pretrained_config(
        str(model_dir / "model")))
    dnc = copy.deepcopy(cfg.neuron_config)
    dnc.speculation_length, dnc.enable_fused_speculation = 0, False
    for k, v in (draft_nc or {}).items():
        setattr(dnc, k, v)
    cfg.fused_spec_config = FusedSpecNeuronConfig(
        NeuronLlamaForCausalLM._model_cls,
        draft_config=LlamaInferenceConfig(dnc, load_config=load_pretrained_config(
            str(model_dir / draft))),
        draft_model_path=str(model_dir / draft))
    return NeuronLlamaForCausalLM(str(model_dir / "model"), cfg)


def _t(rows):
    import torch

    return torch.tensor(rows, dtype=torch.int64)


def _run(model, ids, seq_ids, position_ids):
    """One forward with greedy on-device sampling rows ([n, 3]: top_k, top_p, temperature)."""
    import torch

    params = torch.tensor([[1.0, 1.0, 1.0]] * ids.shape[0])
    return model(ids.long(), seq_ids=seq_ids, position_ids=position_ids.long(),
                 sampling_params=params)


def test_fused_spec_config_has_the_real_signature(fake_nxdi) -> None:
    import inspect

    from neuronx_distributed_inference.models.config import FusedSpecNeuronConfig

    # models/config.py:L1010-L1016
    assert list(inspect.signature(FusedSpecNeuronConfig).parameters) == [
        "worker_cls", "draft_config", "draft_model_path", "draft_model_cls"]


def test_the_fake_raises_where_nxd_inference_raises(model_dir, tmp_path, fake_nxdi) -> None:
    from neuronx_distributed_inference.models.llama.modeling_llama import (
        LlamaInferenceConfig,
        NeuronLlamaForCausalLM,
    )
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    # batch bucketing with speculation (models/config.py:L610-L654)
    with pytest.raises(ValueError, match="Batch bucketing .* fused speculation"):
        _nc(token_generation_batches=[1, 2])
    # enable_fused_spec reads fused_spec_config.draft_config (models/model_base.py:L3120-L3127)
    cfg = LlamaInferenceConfig(_nc(), load_config=load_pretrained_config(
        str(model_dir / "model")))
    with pytest.raises(AttributeError, match="draft_config"):
        NeuronLlamaForCausalLM(str(model_dir / "model"), cfg)
    # a draft of another dtype needs cast_type as-declared (application_base.py:L209-L216)
    import torch

    with pytest.raises(ValueError, match="cast-type must be set to 'as-declared'"):
        _fused(model_dir, draft_nc={"torch_dtype": torch.bfloat16})
    # the fused graphs need on-device sampling: the draft's is edited (model_base.py:
    # L1675-L1678), the target's asserted (L1807, L1869), when NeuronFusedSpecModel is traced
    model = _fused(model_dir, on_device_sampling_config=None)
    with pytest.raises(AttributeError, match="do_sample"):
        model.compile(str(tmp_path / "a"))
    model = _fused(model_dir, on_device_sampling_config=None,
                   draft_nc={"on_device_sampling_config": _nc().on_device_sampling_config})
    with pytest.raises(AssertionError):
        model.compile(str(tmp_path / "b"))


def test_a_step_past_the_largest_bucket_is_refused(model_dir, tmp_path, fake_nxdi) -> None:
    """required_len = position + speculation_length must fit the largest token bucket, 64
    (models/model_wrapper.py:L826-L841, L898-L916)."""
    model = _fused(model_dir)
    model.compile(str(tmp_path / "c"))
    model.load(str(tmp_path / "c"))
    prompt = list(range(1, 31))
    _run(model, _t([prompt]), _t([0]), _t([list(range(30))]))
    fits = _run(model, _t([[5]]), _t([0]), _t([[64 - S]]))
    assert int(fits.fused_outputs[3][0, 0]) - (64 - S) >= 1
    with pytest.raises(ValueError, match=r"Input len 61 exceeds largest bucket \(64\)"):
        _run(model, _t([[5]]), _t([0]), _t([[64 - S + 1]]))


def test_fused_outputs_follow_the_postprocessors(model_dir, tmp_path, fake_nxdi) -> None:
    """Prefill: [token, -1 x (S-1)], next position = prompt length (model_base.py:
    L2798-L2839). Decode with the model as its own draft: all S kept, next position p + S
    (L2841-L2897); no `.tokens` on a fused output (L3872-L3874)."""
    model = _fused(model_dir, draft="same")
    model.compile(str(tmp_path / "d"))
    model.load(str(tmp_path / "d"))
    out = _run(model, _t([[1, 50, 60, 70]]), _t([1]), _t([[0, 1, 2, 3]]))
    accepted, next_ids, _, next_pos = out.fused_outputs
    assert accepted.dtype == next_pos.dtype
    assert accepted[0, 1:].tolist() == [-1] * (S - 1) and next_pos.tolist() == [[4]]
    assert next_ids.tolist() == [[int(accepted[0, 0])]]
    assert not hasattr(out, "tokens")
    step = _run(model, next_ids, _t([1]), _t([[4]]))
    accepted, next_ids, _, next_pos = step.fused_outputs
    assert -1 not in accepted[0].tolist() and next_pos.tolist() == [[4 + S]]
    assert next_ids.tolist() == [[int(accepted[0, -1])]]


def test_the_acceptance_rule_is_the_contiguous_match(fake_nxdi) -> None:
    """_tkg_postprocessor (model_base.py:L2841-L2897) on crafted drafts [d1..dS] and target
    tokens [t0..t_{S-1}]: kept = t0.. up to the first j where d_{j+1} != t_j, and that t_j
    too; a later match does not count."""
    import torch
    from neuronx_distributed_inference.models._fused_spec import tkg_postprocessor

    drafts = torch.tensor([[7, 8, 9, 4], [7, 0, 9, 4], [0, 8, 9, 4], [7, 8, 9, 0]])
    target = torch.tensor([[7, 8, 9, 5]] * 4)
    mask = torch.ones(4, 10, dtype=torch.int64)
    pos = torch.tensor([[10], [20], [30], [40]])
    accepted, next_ids, _, next_pos = tkg_postprocessor(drafts, target, mask, pos, 4)
    assert accepted.tolist() == [[7, 8, 9, 5], [7, 8, -1, -1], [7, -1, -1, -1], [7, 8, 9, 5]]
    assert next_pos.reshape(-1).tolist() == [14, 22, 31, 44]
    assert next_ids.reshape(-1).tolist() == [5, 8, 7, 5]


def test_a_decode_leaving_a_running_slot_out_corrupts_it(model_dir, tmp_path, fake_nxdi) -> None:
    """The wrapper runs the missing seq ids with the first row's inputs (model_wrapper.py:
    L595-L656), writing its positions in their lines of both caches: the left-out sequence's
    next tokens change, as they would on Inf2 (the backend decodes every running slot)."""
    def run(leave_out: bool) -> list[int]:
        model = _fused(model_dir, draft="same")
        model.compile(str(tmp_path / f"e{leave_out}"))
        model.load(str(tmp_path / f"e{leave_out}"))
        a = _run(model, _t([[1, 9, 8]]), _t([0]), _t([[0, 1, 2]])).fused_outputs
        b = _run(model, _t([[1, 50, 60, 70, 80, 90]]), _t([1]), _t([list(range(6))])
                 ).fused_outputs
        if leave_out:  # slot 1 left out: its line gets slot 0's step at positions 3..6
            _run(model, a[1].long(), _t([0]), a[3].long())
        return _run(model, b[1].long(), _t([1]), b[3].long()).fused_outputs[
            0][0].tolist()

    assert run(False) != run(True)


def test_a_compiled_dir_restores_the_fused_spec_config(model_dir, tmp_path, fake_nxdi) -> None:
    """neuron_config.json keeps the draft; InferenceConfig.load rebuilds FusedSpecNeuronConfig
    with the worker class imported by name (models/config.py:L951-L995)."""
    from neuronx_distributed_inference.models.config import FusedSpecNeuronConfig
    from neuronx_distributed_inference.models.llama.modeling_llama import (
        LlamaInferenceConfig,
        NeuronLlamaModel,
    )

    model = _fused(model_dir)
    model.compile(str(tmp_path / "f"))
    loaded = LlamaInferenceConfig.load(str(tmp_path / "f"))
    spec = loaded.fused_spec_config
    assert isinstance(spec, FusedSpecNeuronConfig) and spec.worker_cls is NeuronLlamaModel
    assert isinstance(spec.draft_config, LlamaInferenceConfig)
    assert spec.draft_config.neuron_config.speculation_length == 0
    assert loaded.neuron_config.speculation_length == S
    assert spec.draft_model_path == str(model_dir / "draft")


def test_what_the_fake_does_not_model(model_dir, tmp_path, fake_nxdi) -> None:
    with pytest.raises(NotImplementedError, match="without enable_fused_speculation"):
        _fused(model_dir, enable_fused_speculation=False)
    # the real trace accepts a context bucket of length S and routes it to token generation
    # inside the graph (model_base.py:L3020-L3024); the fake refuses to guess what it computes
    with pytest.raises(NotImplementedError, match="context bucket 4"):
        _fused(model_dir, context_encoding_buckets=[S, 32]).compile(str(tmp_path / "g"))
