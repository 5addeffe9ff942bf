"""Speculative decoding on the neuron backend (FusedSpeculativeDecoder), on the fake.

The fake (tests/fakes/transformers_neuronx/fused_speculation.py) keeps the real class's
asserts, host-side code and acceptance rule, and each model's KV rows, so a decode that
leaves a running slot out, or runs past the last bucket, shows here as on Inf2. Drafts:
a noisy copy of the model (accepts some runs, rejects others), the model itself (accepts
every token: k + 1 a step), the demo model of another seed (same vocabulary, rarely
agrees). Citations are to aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/.
"""

from __future__ import annotations

import importlib
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
from handlers.errors import ConfigError, Inf2ServeError, RequestError

ROOT = Path(__file__).resolve().parents[2]
FAKES = ROOT / "tests" / "fakes"
K = 4
TEXTS = ["The quick brown fox", "Once upon a time", "a", "In the beginning the",
         "She said that", "It was the best of times", "Water", "He went to the market and"]


def noisy_copy(src: Path, dst: Path, eps: float, seed: int = 0) -> Path:
    """`src` with every matrix perturbed by eps x its std: a draft that agrees often, not
    always."""
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
    from transformers import LlamaConfig, LlamaForCausalLM

    from archive_tools.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("spec-model-dir")
    shutil.copytree(tiny_checkpoint, root / "model")
    noisy_copy(tiny_checkpoint, root / "draft", 0.1)
    shutil.copytree(tiny_checkpoint, root / "same")
    build_demo_model(root / "far", "tiny", seed=1)
    small = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(small).save_pretrained(str(root / "other-vocab"))
    shutil.copy(tiny_checkpoint / "tokenizer.json", root / "other-vocab")  # only config differs
    return root


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from handlers.engine.start import load_tokenizer

    return load_tokenizer(model_dir / "model")



def _handler(tmp_path: Path, batch_size: int = 2, draft: str = "draft", **neuron) -> dict:
    settings = {"tp_degree": 2, "cores_per_instance": 4, "cache_dir": str(tmp_path / "cache"),
                "core_lock_dir": str(tmp_path / "locks"), "on_device_sampling": True,
                "global_top_k": 64, **neuron}
    if draft:
        settings["speculation"] = {"draft_checkpoint": draft, "length": K}
    return {"handler": {"backend": "neuron", "batching": "continuous", "batch_size": batch_size,
                        "max_length": 128, "dtype": "float32", "max_new_tokens_limit": 64,
                        "defaults": {"max_new_tokens": 16}, "neuron": settings}}


def _backend(model_dir: Path, tmp_path: Path, batch_size: int = 2, draft: str = "draft",
             **neuron):
    from handlers.backends.neuron_backend import NeuronBackend

    config = parse_config(_handler(tmp_path, batch_size, draft, **neuron)).handler
    return NeuronBackend(model_dir / "model", config, model_dir)


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
        model_dir, tmp_path, fake_sdk, tokenizer, streams) -> None:
    """1 stream: one slot, requests one after another. 8 streams: six start together, a
    1-token prompt and another join at steps 2 and 3 while the others are mid-speculation.
    Stop strings (taken from the middle of three answers) and max_new_tokens end them
    wherever the accepted runs put them."""
    prompts = [[67]] + [_ids(tokenizer, t) for t in TEXTS]
    requests = [(f"r{i}", p, 10 + 3 * (i % 5), (), 0 if streams == 1 else (2 if i == 6 else 3
                                                                           if i == 7 else 0))
                for i, p in enumerate(prompts[:8])]
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
    seen = _counting(spec)
    got = _serve(spec, tokenizer, requests)
    spec.close()
    assert got == expected  # text, token ids, reason and counts of every request
    counts = [n for step in seen for n in step]
    assert max(counts) > 1 and min(counts) == 1  # runs accepted, and drafts rejected
    assert len(seen) < sum(e.completion_tokens for e in expected.values())


def test_a_stop_string_and_max_new_tokens_ending_inside_an_accepted_run(
        model_dir, tmp_path, fake_sdk, tokenizer) -> None:
    """With the model as its own draft every decode accepts all k drafts: a request's
    tokens come as 1 (prefill), then k + 1 a step. max_new_tokens 1 + (k+1) + 2 and a stop
    string completed by the 3rd token of the first run end mid-run, exactly as without
    speculation (Sequence.extend cuts the run; the output side cuts at the stop)."""
    prompt = _ids(tokenizer, TEXTS[1])
    plain = _backend(model_dir, tmp_path / "plain", draft="")
    ref = _serve(plain, tokenizer, [("ref", prompt, 20, (), 0)])["ref"].token_ids
    text = tokenizer.decode(list(ref))
    stop = next(s for j in range(2, K + 1)
                if (s := tokenizer.decode(list(ref[:j + 1]))[-3:]).strip()
                and text.find(s) + len(s) == len(tokenizer.decode(list(ref[:j + 1]))))
    requests = [("len", prompt, 1 + (K + 1) + 2, (), 0), ("stop", prompt, 20, (stop,), 0)]
    expected = _serve(plain, tokenizer, requests)
    plain.close()
    spec = _backend(model_dir, tmp_path / "spec", draft="same")
    seen = _counting(spec)
    got = _serve(spec, tokenizer, requests)
    spec.close()
    assert got == expected
    assert seen[0] == [K + 1, K + 1]  # every draft accepted
    assert (got["len"].reason, got["len"].completion_tokens) == ("length", 1 + (K + 1) + 2)
    assert got["stop"].reason == "stop" and 1 < got["stop"].completion_tokens < 1 + K + 1


# --- the backend's limits and start-up ---------------------------------------------------------
def test_limits_leave_room_for_k_positions(model_dir, tmp_path, fake_sdk) -> None:
    """The fused step writes cache ids up to the last token's + k (fused_speculation.py:
    L173-L211): sequences get max_length - k positions, the engine up to k + 1 tokens a
    step, and logprobs are refused (the engine requires it of a multi-token backend)."""
    b = _backend(model_dir, tmp_path)
    assert (b.max_length, b.max_tokens_per_step, b.max_prompt_length) == (128 - K, K + 1,
                                                                          128 - K - 1)
    assert "logprobs" in b.capabilities.unsupported
    b.warmup()  # the largest prefill bucket's longest prompt, then a fused step
    with pytest.raises(RequestError, match="expected 1 to 123"):
        b.prefill([0], [[5] * (128 - K)], [SamplingParams()])
    first = b.prefill([0], [[5] * (128 - K - 1)], [SamplingParams()])  # the longest that fits
    rows = b.decode([0])  # writes cache ids 123..127: the last bucket's last position
    assert len(first) == 1 and 1 <= len(rows[0]) <= K + 1
    b.close()


def test_a_missing_draft_or_one_the_decoder_refuses_is_a_config_error(model_dir, tmp_path,
                                                                      fake_sdk) -> None:
    with pytest.raises(ConfigError, match="speculation.draft_checkpoint: .*nowhere has no "
                                          "config.json; package the draft"):
        _backend(model_dir, tmp_path, draft="nowhere")
    with pytest.raises(ConfigError, match="FusedSpeculativeDecoder refuses this draft and "
                                          "model: The target model and draft model must have "
                                          "the same vocab size"):
        _backend(model_dir, tmp_path, draft="other-vocab")


def test_sampled_slots_use_their_parameters_on_draft_and_target(model_dir, tmp_path,
                                                                fake_sdk) -> None:
    """update_generation_config goes to the target and, its config being dynamic, the draft
    (fused_speculation.py:L498-L501): both sample each line with its slot's parameters."""
    b = _backend(model_dir, tmp_path, draft="far")
    hot = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    b.prefill([1], [[1, 50, 60, 70]], [hot])
    b.prefill([0], [[1, 90, 100]], [SamplingParams()])
    b.model.sampled.clear()
    draft = b._runner.fused.draft
    draft.sampled.clear()
    for _ in range(3):
        b.decode([0, 1])
    for model in (b.model, draft):
        assert {s for s in model.sampled if s[0] == 1} == {(1, 5, 0.9, 0.8)}
        assert {s for s in model.sampled if s[0] == 0} == {(0, 1, 1.0, 1.0)}
    b.close()


# --- the compile cache: target and draft in the entry, fused graphs in the compiler's ---------
FRESH = """
import json, sys
from pathlib import Path
from handlers.backends.base import SamplingParams
from handlers.backends.neuron_backend import NeuronBackend
from handlers.config import parse_config
raw, model_dir, prompt = json.loads(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
b = NeuronBackend(model_dir / "model", parse_config(raw).handler, model_dir)
out = b.prefill([0], [prompt], [SamplingParams()])
while len(out) < 12:
    out += b.decode([0])[0]
print(json.dumps({"compiled": b.start.compiled, "tokens": out[:12]}))
b.close()
"""


def test_compile_save_load_in_a_fresh_process_compiles_nothing(model_dir, tmp_path,
                                                               fake_sdk) -> None:
    """The entry holds the target's NEFFs and the draft's (draft/); the fused graphs, which
    FusedSpeculativeDecoder cannot save (fused_speculation.py:L464-L495), are in the
    compiler cache NEURON_COMPILE_CACHE_URL points inside cache_dir. A fresh process loads
    both models and finds the fused graphs: nothing compiles. Without the compiler cache
    only the fused graphs compile again."""
    prompt = [1, 50, 60, 70, 80]
    b = _backend(model_dir, tmp_path)
    first = b.prefill([0], [prompt], [SamplingParams()])
    while len(first) < 12:
        first += b.decode([0])[0]
    entry = b.start.entry.artifacts
    assert b.start.compiled
    b.close()
    events = _events(fake_sdk)
    assert [(e["event"], e.get("checkpoint", e.get("program"))) for e in events] == [
        ("compile", str(model_dir / "model")), ("compile", str(model_dir / "draft")),
        ("compile", "fused-speculator")]
    assert any(entry.glob("*.neff")) and any((entry / "draft").glob("*.neff"))
    compiler_cache = tmp_path / "cache" / "neuronx-cc"
    assert len(list(compiler_cache.rglob("model.neff"))) == 1  # one bucket, one batch size

    path = [str(FAKES), str(ROOT), os.environ.get("PYTHONPATH", "")]  # keep an overlay
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path)),
           "INF2SERVE_FAKE_NEURON_DEVICE_DIR": str(tmp_path / "device-2")}
    r = subprocess.run([sys.executable, "-c", FRESH, json.dumps(_handler(tmp_path)),
                        str(model_dir), json.dumps(prompt)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    fresh = json.loads(r.stdout.strip().splitlines()[-1])
    assert fresh == {"compiled": False, "tokens": first[:12]}
    later = [e for e in _events(fake_sdk)[3:]]
    assert [(e["event"], e.get("directory", e.get("program"))) for e in later] == [
        ("load", str(entry)), ("load", str(entry / "draft")), ("cache-hit", "fused-speculator")]

    shutil.rmtree(compiler_cache)  # an entry copied without the compiler's cache
    again = _backend(model_dir, tmp_path)
    assert not again.start.compiled
    again.close()
    assert [(e["event"], e.get("program")) for e in _events(fake_sdk)[6:]] == [
        ("load", None), ("load", None), ("compile", "fused-speculator")]


# --- the fake raises where transformers-neuronx raises ----------------------------------------
@pytest.fixture
def tnx(fake_sdk, tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "compiler-cache"))
    return importlib.import_module("transformers_neuronx")


def _model(tnx, checkpoint: Path, batch: int = 2, tp: int = 2, embedding: bool = True,
           generation: bool = True, cb: bool = True, compile: bool = False):
    gen = (tnx.GenerationConfig(do_sample=True, dynamic=True, per_batch_line=True,
                                global_top_k=64, top_k=1) if generation else None)
    kwargs = {"on_device_embedding": embedding, "on_device_generation": gen}
    if cb:
        kwargs["continuous_batching"] = tnx.ContinuousBatchingConfig(max_num_seqs=batch)
    model = tnx.LlamaForSampling.from_pretrained(
        str(checkpoint), batch_size=batch, tp_degree=tp, amp="f32", n_positions=64,
        context_length_estimate=[16], neuron_config=tnx.NeuronConfig(**kwargs))
    if compile:
        model.to_neuron()
    return model


def _fused(tnx, model_dir: Path, draft: str = "far", k: int = K, **kwargs):
    from transformers_neuronx.fused_speculation import FusedSpeculativeDecoder

    target = _model(tnx, model_dir / "model", compile=True)
    fused = FusedSpeculativeDecoder(_model(tnx, model_dir / draft, compile=True), target, k,
                                    **kwargs)
    fused.to_neuron()
    return fused


def _t(rows):
    import torch

    return torch.tensor(rows, dtype=torch.int64)


REFUSED = [  # (draft kwargs, target kwargs, k, message): fused_speculation.py:L296-L325
    ({"embedding": False}, {}, K, "The draft model must enable on-device embedding."),
    ({"generation": False}, {}, K, "The draft model must enable on-device sampling."),
    ({}, {"embedding": False}, K, "The target model must enable on-device embedding."),
    ({}, {"generation": False}, K, "The target model must enable on-device sampling."),
    ({"checkpoint": "other-vocab"}, {}, K,
     "The target model and draft model must have the same vocab size."),
    ({"tp": 1}, {}, K, "The target model and draft model must have the same tp degree."),
    ({}, {}, 4.0, "The k value must be an integer."),
    ({"cb": False}, {}, K, "The draft model must set padding_side as right for batch size > 1."),
    ({}, {"cb": False}, K,
     "The target model must set padding_side as right for batch size > 1."),
]


@pytest.mark.parametrize(("draft", "target", "k", "message"), REFUSED)
def test_the_decoder_asserts_what_the_real_one_asserts(tnx, model_dir, draft, target, k,
                                                       message) -> None:
    from transformers_neuronx.fused_speculation import FusedSpeculativeDecoder

    draft = dict(draft)
    d = _model(tnx, model_dir / draft.pop("checkpoint", "far"), **draft)
    t = _model(tnx, model_dir / "model", **target)
    with pytest.raises(AssertionError, match=f"^{message}$"):
        FusedSpeculativeDecoder(d, t, k)


def test_to_neuron_and_decode_in_the_real_order(tnx, model_dir) -> None:
    """No fused decode before to_neuron (self.speculator is None, L859); the fused graph is
    set up with both models' weights (L492-L495: inferred, they must be loaded first); a
    process pool of 0 workers fails (program.py:L364-L367)."""
    from transformers_neuronx.fused_speculation import FusedSpeculativeDecoder

    target, draft = _model(tnx, model_dir / "model"), _model(tnx, model_dir / "far")
    fused = FusedSpeculativeDecoder(draft, target, K)
    with pytest.raises(RuntimeError, match=r"before draft.to_neuron\(\)"):
        fused.to_neuron()
    draft.to_neuron()
    target.to_neuron()
    with pytest.raises(ValueError, match="max_workers must be greater than 0"):
        fused.to_neuron(workers=0)
    fused.speculative_iteration(_t([[1, 50, 60]]), _t([[0, 1, 2]]), _t([0]))  # context: fine
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'execute'"):
        fused.speculative_iteration(_t([[70]]), _t([[3]]), _t([0]))
    fused.to_neuron()
    tokens, counts = fused.speculative_iteration(_t([[70]]), _t([[3]]), _t([0]))
    assert tokens.shape == (1, K + 1) and 1 <= int(counts[0, 0]) <= K + 1


def test_a_step_past_the_last_bucket_is_refused(tnx, model_dir) -> None:
    """FusedSpeculativeSelector picks the bucket of the largest cache id + k
    (program.py:L431-L452); past the last one the real selector still runs it and writes
    beyond the KV cache (undefined), which the fake refuses."""
    fused = _fused(tnx, model_dir)
    fused.speculative_iteration(_t([[1, 50, 60]]), _t([[0, 1, 2]]), _t([0]))
    fused.speculative_iteration(_t([[70]]), _t([[63 - K]]), _t([0]))  # writes up to 63
    with pytest.raises(IndexError, match=f"position {64} .* past the largest bucket 64"):
        fused.speculative_iteration(_t([[70]]), _t([[64 - K]]), _t([0]))


def test_rows_left_out_of_a_decode_get_token_0_in_both_caches(tnx, model_dir) -> None:
    """Absent seq ids are zero rows of the full graph batch (preprocess_input, L871-L894):
    token 0 at cache ids 0..k of both models' caches, so every running slot must be in
    every decode."""
    fused = _fused(tnx, model_dir)
    for slot, prompt in ((0, [1, 50, 60, 70]), (1, [1, 90, 100, 110, 120, 130])):
        fused.speculative_iteration(_t([prompt]), _t([list(range(len(prompt)))]), _t([slot]))
    for model in (fused.draft, fused.target):
        assert model._kv[2][1][:6] == [1, 90, 100, 110, 120, 130]
    fused.speculative_iteration(_t([[80]]), _t([[4]]), _t([0]))  # slot 1 left out
    for model in (fused.draft, fused.target):
        assert model._kv[2][1][0] == 0 and model._kv[2][1][:K + 1] != [1, 90, 100, 110, 120]
        assert model._kv[2][0][:5] == [1, 50, 60, 70, 80]  # slot 0 as written


def test_the_default_pad_id_0_replaces_an_accepted_token_0(tnx, model_dir) -> None:
    """speculative_iteration_post_process (L220-L234) first sets every element equal to the
    pad id to row 0's first token: with the default pad_token_id 0 an accepted token 0
    comes back as another token; with -1 (what the backend passes) it survives."""
    for pad, expected in ((0, [[7, 7, 3], [9, 7, 0]]), (-1, [[7, 0, 3], [9, 0, -1]])):
        fused = _fused(tnx, model_dir, pad_token_id=pad)
        tokens = _t([[7, 0, 3], [9, 0, pad]])
        out, _ = fused.speculative_iteration_post_process(tokens, _t([[3], [2]]))
        assert out.tolist() == expected


@pytest.mark.parametrize("sampled", [False, True])
def test_a_draft_equal_to_the_target_is_always_accepted(tnx, model_dir, sampled) -> None:
    """Acceptance is min(1, p_target / p_draft) against a uniform (hlo.py:L3806-L3845):
    with the same distributions every draft token is kept, greedy or sampled; greedy
    keeps a draft token exactly when it is the target's argmax. The fake draws its own
    uniforms and samples (torch generators), not the device's."""
    fused = _fused(tnx, model_dir, draft="same")
    if sampled:
        from transformers_neuronx.config import GenerationConfig

        gc = GenerationConfig(
            do_sample=True, dynamic=True, per_batch_line=True, global_top_k=64,
            top_k=[20, 20], top_p=[0.95, 0.95], temperature=[0.9, 0.9])
        fused.update_generation_config(gc)
    fused.speculative_iteration(_t([[1, 50, 60, 70]]), _t([[0, 1, 2, 3]]), _t([0]))
    tokens, counts = fused.speculative_iteration(_t([[80]]), _t([[4]]), _t([0]))
    assert counts.tolist() == [[K + 1]] and -1 not in tokens.tolist()[0]


# --- packaging: --draft-checkpoint -----------------------------------------------------------
def _yaml(tmp_path: Path, draft: str = "draft", **speculation) -> Path:
    import yaml

    raw = {"minWorkers": 1, "maxWorkers": 1, "batchSize": 1, "asyncCommunication": True,
           **_handler(tmp_path, draft=draft)}
    raw["handler"]["neuron"].pop("cache_dir")
    raw["handler"]["neuron"].get("speculation", {}).update(speculation)
    path = tmp_path / "model-config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_package_puts_the_draft_where_the_config_says(model_dir, tmp_path) -> None:
    from archive_tools.package import package

    target = package(_yaml(tmp_path, draft="drafts/small"), model_dir / "model", "spec",
                     "no-archive", tmp_path / "store", draft_checkpoint=model_dir / "draft")
    packaged = sorted(p.name for p in (target / "drafts" / "small").iterdir())
    assert packaged == sorted(p.name for p in (model_dir / "draft").iterdir())
    assert (target / "model" / "config.json").is_file()


@pytest.mark.parametrize(("draft_key", "flag", "message"), [
    ("draft", None, "handler.neuron.speculation.draft_checkpoint is 'draft' but no "
                    "--draft-checkpoint was given"),
    ("", "draft", r"--draft-checkpoint .*draft: handler.neuron.speculation.draft_checkpoint is "
                  "not set"),
    ("draft", "other-vocab", r"--draft-checkpoint .*other-vocab: vocab_size 512 differs from "
                             "the model's 1024"),
    ("draft", "nowhere", r"--draft-checkpoint .*nowhere: no such directory"),
    ("model/draft", "draft", "handler.neuron.speculation.draft_checkpoint: 'model/draft' must "
                             "be a relative path inside the archive, apart from"),
    ("../draft", "draft", "must be a relative path inside the archive"),
])
def test_package_refuses_a_draft_without_its_key_and_one_that_cannot_serve(
        model_dir, tmp_path, draft_key, flag, message) -> None:
    from archive_tools.package import plan_package

    config = _yaml(tmp_path, draft=draft_key)
    with pytest.raises(Inf2ServeError, match=message):
        plan_package(config, model_dir / "model", "spec", "no-archive", tmp_path / "store",
                     draft_checkpoint=model_dir / flag if flag else None)
