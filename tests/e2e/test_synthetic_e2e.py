"""The synthetic device through a real TorchServe: an archive packaged from a checkpoint
without weights streams the synthetic model's tokens, the same as the backend in-process."""

from __future__ import annotations

import shutil

import pytest

from handlers.backends.base import SamplingParams
from handlers.backends.synthetic_backend import SyntheticBackend
from handlers.config import parse_config
from tests.e2e.harness import ArchiveSpec, attach_logs_fixture, build_store, post, running_server
from tests.unit.fakes import one_each

pytestmark = pytest.mark.e2e

# 20 ms steps: a stream of NEW_TOKENS lasts 0.8 s, so it reaches the client in several chunks
# unless the worker's event loop stalls that long (with 2 ms steps, 80 ms of stall on 2 busy
# cores sent a whole answer as one chunk)
HANDLER = {"backend": "synthetic", "batch_size": 64, "threads": 1, "warmup": False,
           "synthetic": {"decode_step_ms": 20, "prefill_ms": [3]}}
SPECULATIVE = {**HANDLER, "synthetic": {**HANDLER["synthetic"], "speculation_length": 4,
                                         "draft_step_ms": 0.5}}
PROMPTS = [f"Stream {i} begins with" for i in range(8)]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    """config.json and tokenizer only: the synthetic backend reads no weights."""
    out = tmp_path_factory.mktemp("synth-ckpt") / "no-weights"
    out.mkdir()
    for f in tiny_checkpoint.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("synth-e2e")
    store = build_store(root, checkpoint, [ArchiveSpec("synth", handler=HANDLER),
                                           ArchiveSpec("spec", handler=SPECULATIVE)])
    with running_server(store, root / "run", ["synth", "spec"]) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


def _expected(checkpoint, prompt: str) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    cfg = parse_config({"handler": HANDLER}).handler
    backend = SyntheticBackend(checkpoint, cfg, tokenizer=tok, sleep=lambda s: None)
    ids = backend.prefill([0], [tok(prompt)["input_ids"]], [SamplingParams()])
    ids += [one_each(backend.decode([0]))[0] for _ in range(NEW_TOKENS - 1)]
    return tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("model", ["synth", "spec"])
def test_concurrent_streams_carry_the_synthetic_models_words(server, checkpoint, model):
    """With speculation ("spec": 1 to 5 tokens a step) the streams carry the same words and
    end at exactly max_new_tokens, as one token a step does."""
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt: str):
        return post(server, model, {"prompt": prompt, "max_new_tokens": NEW_TOKENS,
                                    "stream_format": "ndjson"})

    # the worker's first request pays its cold start on the event loop (warmup is off here);
    # the streams that arrive meanwhile would leave their text to pile up, not stream
    assert post(server, model, {"prompt": "warm", "max_new_tokens": 2}).status == 200
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, PROMPTS))
    for prompt, r in zip(PROMPTS, results, strict=True):
        assert r.status == 200, r.body
        lines = r.ndjson()
        # streamed, not one answer at the end: text in two chunks or more before the final
        # line. Not one chunk per token: a worker whose event loop fell behind sends the
        # text of several steps as one chunk (ChunkSender), so the count follows the load
        # (stop 22's CI, 2 ms steps on 2 busy cores)
        assert len(lines) >= 3 and all(line["text"] for line in lines[:-1])
        final = lines[-1]
        # no EOS is ever emitted, so every request runs to max_new_tokens
        assert (final["finish_reason"], final["completion_tokens"]) == ("length", NEW_TOKENS)
        text = "".join(line.get("text", "") for line in lines)
        assert text == _expected(checkpoint, prompt)
