"""The torch backend against `generate`: same tokens, alone or sharing a batch."""

import pytest
import torch

from handlers.backends.base import SamplingParams, SlotError
from handlers.config import parse_config
from tests.unit.fakes import one_each

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
        for slot, token in zip(running, one_each(backend.decode(running)), strict=True):
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
            for slot, token in zip(new + running, first + one_each(following), strict=True):
                got[slot].append(token)
            continue
        if not running:
            break
        for slot, token in zip(running, one_each(backend.decode(running)), strict=True):
            got[slot].append(token)
    backend.release([0, 1, 2, 3])
    assert [got[i][:12] for i in range(4)] == want


def test_failed_packed_step_leaves_the_batch_as_it_was(setup, monkeypatch):
    from handlers.backends import torch_backend

    backend, tok, model = setup
    ids = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    want = reference(model, ids[0], 8, do_sample=False)
    sp = SamplingParams(min_new_tokens=8)
    got = backend.prefill([0], [ids[0]], [sp])
    got += one_each(backend.decode([0])) + one_each(backend.decode([0]))
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
    with pytest.raises(SlotError, match="running"):
        backend.step([1], [ids[1]], [sp], [2])
    for _ in range(5):
        got += one_each(backend.decode([0]))
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
            got += one_each(backend.decode([0]))
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
            out += one_each(backend.decode([0]))
        backend.release([0])
        runs.append(out)
    assert runs[0] == runs[1]
    assert not set(runs[0]) & backend.eos_token_ids


def test_misuse_is_rejected(setup):
    backend, tok, _ = setup
    backend.prefill([0], [[1, 2, 3]], [SamplingParams()])
    with pytest.raises(SlotError, match="busy"):
        backend.prefill([0], [[1, 2]], [SamplingParams()])
    with pytest.raises(SlotError, match="running"):
        one_each(backend.decode([1]))
    backend.release([0])


def test_append_layer_steps_leaves_and_joins_work_in_its_own_buffers():
    from handlers.backends.torch_backend import _AppendLayer

    torch.manual_seed(0)
    layer = _AppendLayer()
    rows: list[torch.Tensor] = []  # each row's real tokens [heads, length, d], right-aligned

    def check() -> None:
        keys, values = layer.keys, layer.values
        assert keys.shape[:2] == (len(rows), 2)
        assert keys.shape[2] == max(r.shape[1] for r in rows)  # the window: the longest row
        for i, row in enumerate(rows):
            assert torch.equal(keys[i, :, keys.shape[2] - row.shape[1]:], row)
            assert torch.equal(values[i, :, keys.shape[2] - row.shape[1]:], -row)
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()  # padding too

    def step() -> None:
        nonlocal rows
        new = torch.randn(len(rows), 2, 1, 4)
        keys, values = layer.update(new, -new)
        assert keys is layer.keys and values is layer.values
        rows = [torch.cat([r, new[i]], dim=1) for i, r in enumerate(rows)]
        check()

    def leave(*gone: int) -> None:  # as the backend does: the last rows fill the holes
        nonlocal rows
        kept = len(rows) - len(gone)
        moves = list(zip(sorted(i for i in gone if i < kept),
                         [i for i in range(kept, len(rows)) if i not in gone], strict=True))
        width = max(r.shape[1] for r in rows)
        order = list(range(kept))
        for dst, src in moves:
            order[dst] = src
        rows = [rows[i] for i in order]
        layer.keep(moves, kept, width - max(r.shape[1] for r in rows))
        check()

    def join(n: int, length: int) -> None:
        nonlocal rows
        new = torch.randn(n, 2, length, 4)
        layer.add(new, -new)
        rows += list(new)
        check()

    first = torch.randn(3, 2, 5, 4)
    layer.update(first, -first)
    rows = list(first)
    buffer = layer._kbuf.data_ptr()
    for _ in range(3):
        step()
    assert layer._kbuf.data_ptr() == buffer  # one-token steps wrote into the spare room
    join(1, 3)  # narrower than the window: right-aligned under it, in a fresh row
    step()
    leave(0, 1)  # two of the longest leave: row 3 fills a hole, columns trimmed
    leave(1)  # the last row leaves: nothing moves
    join(2, 4)  # wider than the window, room on the left: the window widens in place
    step()
    leave(0)
    join(3, 40)  # wider than all the room there is, and more rows: fresh buffers
    for _ in range(70):  # past the spare columns
        step()
    leave(0, 2, 3)
    join(1, 2)
    step()
    layer.cut(layer.keys.shape[2] - 1)  # a failed packed step's append, undone
    rows = [r[:, :-1] for r in rows]
    check()


def test_rows_leaving_and_joining_in_every_order_match_generate(setup, monkeypatch):
    """Leaves that move rows and trim columns, then joins narrower and wider than the
    batch -- by prefill and by packed step, more rows than at the start."""
    backend, tok, model = setup
    monkeypatch.setattr(backend, "batch_size", 8)  # a slot per sequence: 8, never reused
    texts = PROMPTS + ["A", "The quick brown fox jumps over the lazy dog again and again and "
                       "again until the end of the long day", "Hi", "Numbers: 1 2 3 4 5 6"]
    ids = [tok(t)["input_ids"] for t in texts]
    lengths = [5, 9, 3, 14, 7, 6, 11, 4]  # new tokens per sequence: they leave staggered
    want = [reference(model, x, n, do_sample=False) for x, n in zip(ids, lengths, strict=True)]
    got: dict[int, list[int]] = {}
    sps = [SamplingParams(min_new_tokens=n) for n in lengths]
    joins = {0: [0, 1, 2], 2: [3], 4: [4, 5], 5: [6], 9: [7]}
    for step in range(40):
        backend.release([s for s in got if len(got[s]) == lengths[s]])
        running = [s for s in got if len(got[s]) < lengths[s]]
        new = joins.get(step, [])
        if new and running and step % 2:  # joins at odd steps ride along the decode
            first, following = backend.step(new, [ids[s] for s in new],
                                            [sps[s] for s in new], running)
            for slot, token in zip(new + running, first + one_each(following), strict=True):
                got.setdefault(slot, []).append(token)
            continue
        if new:
            for slot, token in zip(new, backend.prefill(new, [ids[s] for s in new],
                                                        [sps[s] for s in new]), strict=True):
                got[slot] = [token]
        running += new  # as the engine does: the newcomers decode in the same step
        if running:
            for slot, token in zip(running, one_each(backend.decode(running)), strict=True):
                got[slot].append(token)
        if len(got) == len(ids) and not running:
            break
    backend.release(list(got))
    assert [got[i] for i in range(len(ids))] == want


def test_logprobs_and_prompt_logprobs_match_the_models_log_softmax(setup):
    """Alone (prefill) and packed into a running batch (step): the same numbers."""
    backend, tok, model = setup
    ids = tok("Once upon a time there was a robot")["input_ids"]
    with torch.inference_mode():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    p = SamplingParams(logprobs=2, prompt_logprobs=2)
    for packed in (False, True):
        if packed:
            backend.prefill([1], [tok("The sea")["input_ids"]], [SamplingParams()])
            first, _ = backend.step([0], [ids], [p], [1])
            first = first[0]
        else:
            first = backend.prefill([0], [ids], [p])[0]
        prompt = backend.prompt_logprobs(0)
        assert prompt[0] is None and backend.prompt_logprobs(0) is None  # taken once
        got = [lp for lp, _ in prompt[1:]]
        assert got == pytest.approx([float(want[i, ids[i + 1]]) for i in range(len(ids) - 1)],
                                    abs=1e-4)
        chosen, top = backend.token_logprobs(0)
        assert chosen == pytest.approx(float(want[-1, first]), abs=1e-4)
        assert len(top) == 2 and top[0][0] == first  # greedy: the top token
        assert backend.token_logprobs(1) is None  # a row that did not ask
        backend.release([0, 1])
