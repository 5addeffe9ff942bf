"""The torch backend against `generate`: same tokens, alone or sharing a batch."""

import pytest
import torch

from handlers.backends.base import SamplingParams
from handlers.config import parse_config

PROMPTS = ["Hello there, how are you", "The sea", "Once upon a time there was a robot", "日本語"]


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from handlers.backends.torch_backend import TorchBackend

    cfg = parse_config({"handler": {"batch_size": 4, "max_length": 256,
                                    "max_new_tokens_limit": 128}}).handler
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    return TorchBackend(tiny_checkpoint, cfg), tok, model


def reference(model, ids, n, **kw):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, **kw)
    return out[0, len(ids):].tolist()


def test_staggered_rows_match_generate(setup):
    backend, tok, model = setup
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    want = [reference(model, x, 12, do_sample=False) for x in ids]
    got = {i: [] for i in range(4)}
    sp = SamplingParams(min_new_tokens=12)
    got[0] += backend.prefill([0], [ids[0]], [sp])
    for step in range(30):
        if step == 2:
            for slot, token in zip([1, 2], backend.prefill([1, 2], ids[1:3], [sp, sp]),
                                   strict=True):
                got[slot].append(token)
        if step == 5:
            got[3] += backend.prefill([3], [ids[3]], [sp])
        running = [s for s in range(4) if 0 < len(got[s]) < 12]
        if not running and step > 5:
            break
        backend.release([s for s in range(4) if len(got[s]) >= 12])
        for slot, token in zip(running, backend.decode(running), strict=True):
            got[slot].append(token)
    backend.release([0, 1, 2, 3])
    assert [got[i][:12] for i in range(4)] == want


def test_packed_steps_match_generate(setup):
    """Newcomers prefilled inside the running batch's decode (one forward)."""
    backend, tok, model = setup
    assert backend.mixes_prefill
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    want = [reference(model, x, 12, do_sample=False) for x in ids]
    got = {i: [] for i in range(4)}
    sp = SamplingParams(min_new_tokens=12)
    got[0] += backend.prefill([0], [ids[0]], [sp])
    joins = {2: [1, 2], 5: [3]}  # two newcomers of different lengths, then one
    for step in range(30):
        backend.release([s for s in range(4) if len(got[s]) >= 12])
        running = [s for s in range(4) if 0 < len(got[s]) < 12]
        if step in joins:
            new = joins[step]
            first, following = backend.step(new, [ids[s] for s in new], [sp] * len(new),
                                             running)
            for slot, token in zip(new + running, first + following, strict=True):
                got[slot].append(token)
            continue
        if not running:
            break
        for slot, token in zip(running, backend.decode(running), strict=True):
            got[slot].append(token)
    backend.release([0, 1, 2, 3])
    assert [got[i][:12] for i in range(4)] == want


def test_failed_packed_step_leaves_the_batch_as_it_was(setup, monkeypatch):
    from handlers.backends import torch_backend

    backend, tok, model = setup
    ids = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    want = reference(model, ids[0], 8, do_sample=False)
    sp = SamplingParams(min_new_tokens=8)
    got = backend.prefill([0], [ids[0]], [sp]) + backend.decode([0]) + backend.decode([0])
    real = torch_backend._PackedStep.attend
    last_layer = model.config.num_hidden_layers - 1
    assert last_layer > 0

    def fail_midway(self, module, *args, **kwargs):  # after the other layers appended KV
        if module.layer_idx == last_layer:
            raise RuntimeError("injected")
        return real(self, module, *args, **kwargs)

    monkeypatch.setattr(torch_backend._PackedStep, "attend", fail_midway)
    with pytest.raises(RuntimeError, match="injected"):
        backend.step([1], [ids[1]], [sp], [0])
    monkeypatch.setattr(torch_backend._PackedStep, "attend", real)
    with pytest.raises(ValueError, match="running"):
        backend.step([1], [ids[1]], [sp], [2])
    for _ in range(5):
        got += backend.decode([0])
    backend.release([0])
    assert got == want


def test_a_model_whose_attention_skips_the_packed_path_stops_packing(setup):
    from handlers.backends.torch_backend import PACKED_ATTENTION

    backend, tok, model = setup
    ids = tok(PROMPTS[0])["input_ids"]
    want = reference(model, ids, 4, do_sample=False)
    got = backend.prefill([0], [ids], [SamplingParams()])
    backend.model.set_attn_implementation("sdpa")  # attention that ignores `packed_step`
    try:
        with pytest.raises(RuntimeError, match="did not run the packed step"):
            backend.step([1], [[1, 2, 3]], [SamplingParams()], [0])
        assert not backend.mixes_prefill
        for _ in range(3):
            got += backend.decode([0])
        assert got == want
    finally:
        backend.release([0, 1])
        backend.model.set_attn_implementation(PACKED_ATTENTION)
        backend.mixes_prefill = True


def test_seeded_sampling_is_reproducible_and_min_new_tokens_blocks_eos(setup):
    backend, tok, _ = setup
    ids = tok("The sea")["input_ids"]
    runs = []
    for _ in range(2):
        p = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=7, min_new_tokens=20)
        out = backend.prefill([0], [ids], [p])
        for _ in range(19):
            out += backend.decode([0])
        backend.release([0])
        runs.append(out)
    assert runs[0] == runs[1]
    assert not set(runs[0]) & backend.eos_token_ids


def test_misuse_is_rejected(setup):
    backend, tok, _ = setup
    backend.prefill([0], [[1, 2, 3]], [SamplingParams()])
    with pytest.raises(ValueError, match="busy"):
        backend.prefill([0], [[1, 2]], [SamplingParams()])
    with pytest.raises(ValueError, match="running"):
        backend.decode([1])
    backend.release([0])


def test_append_layer_matches_concatenation_without_copying_every_step():
    from handlers.backends.torch_backend import _AppendLayer

    torch.manual_seed(0)
    layer, ref = _AppendLayer(), None
    chunks = [torch.randn(3, 2, n, 4) for n in (5, 1, 1, 1)]
    buffers = set()
    for chunk in chunks:
        keys, values = layer.update(chunk, -chunk)
        ref = chunk if ref is None else torch.cat([ref, chunk], dim=2)
        assert torch.equal(keys, ref) and torch.equal(values, -ref)
        buffers.add(layer._kbuf.data_ptr())
    assert len(buffers) == 1  # one-token steps wrote into the spare room

    # the backend cuts a row out and trims a column: the next update adopts the new tensors
    layer.keys, layer.values = ref[[0, 2], :, 1:], -ref[[0, 2], :, 1:]
    step = torch.randn(2, 2, 1, 4)
    keys, values = layer.update(step, -step)
    want = torch.cat([ref[[0, 2], :, 1:], step], dim=2)
    assert torch.equal(keys, want) and torch.equal(values, -want)
