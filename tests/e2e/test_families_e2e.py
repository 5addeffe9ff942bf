"""Qwen2, Qwen3, Mistral and Mixtral on the torch backend through one real TorchServe.

The Qwen3, Mistral and Mixtral tiny `demo-model --arch` checkpoints, and a Qwen2 one built
with transformers alone (its classes and `save_pretrained`, untouched by the toolkit:
chat_template.jinja beside tokenizer_config.json, Qwen2.5-7B's untied embeddings and 7
query heads per K/V head), each its own archive on one server. For every archive, four
requests at once (so they share the running batch): native non-streamed and
NDJSON-streamed, OpenAI chat non-streamed and SSE-streamed; each greedy answer equals
transformers' `generate` on the same ids (the chat prompt rendered by the checkpoint's own
template, as transformers renders it).

The same server holds the Mistral demo checkpoint on the neuron backend (MistralForSampling,
from its model_type) and the Qwen2 one on nxdi (NxD Inference's Qwen2 class: q/k/v bias,
tied embeddings), on the SDKs' fakes (tests/fakes, first on the workers' PYTHONPATH): the
same four requests, and 1-token prompts joining a running request leave its text unchanged.
So every family's demo checkpoint goes through TorchServe, Qwen2's on nxdi.

Kept cheap (one server, six single-worker models loading at once on CI's 2 cores): the
engine runs in the worker (engine_process inline: one process per model, not two; the
child process is the other e2e files' subject), and 256 positions (the prompts here stay
under 64 tokens), so the fakes' padded buckets are 128 and 256, not up to 2048.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from archive_tools.package import package
from tests.e2e.harness import attach_logs_fixture, make_config, post, running_server
from tests.e2e.test_neuron_e2e import _joined_by_one_token_prompts

pytestmark = pytest.mark.e2e
DEMO = ("qwen3", "mistral", "mixtral")  # qwen2: its demo checkpoint is served on nxdi below
#: served name -> (demo checkpoint, backend): the torch archives' checkpoints on the fakes
ON_NEURON = {"mistral-neuron": ("mistral", "neuron"), "qwen2-nxdi": ("qwen2", "nxdi")}
MODELS = (*DEMO, "qwen2-hf")
N = 8  # new tokens per answer
HANDLER = {"batching": "continuous", "batch_size": 4, "threads": 1, "engine_process": "inline",
           "max_length": 256, "max_new_tokens_limit": 64}
FAKES = Path(__file__).resolve().parents[1] / "fakes"


def _qwen2_built_with_transformers(out: Path) -> Path:
    """A Qwen2 checkpoint as a user's own transformers script writes it: Qwen2.5-7B's shape
    of config (7 query heads per K/V head, untied embeddings)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from archive_tools.demo_families import FAMILIES
    from archive_tools.demo_model import SIZES, build_tokenizer

    family = FAMILIES["qwen2"]
    tok = build_tokenizer(SIZES["tiny"], seed=1, family=family)
    ids = {t: tok.convert_tokens_to_ids(t) for t in family.special}
    config = Qwen2Config(vocab_size=len(tok), hidden_size=112, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=160, num_hidden_layers=2,
                         max_position_embeddings=2048, initializer_range=0.08, rope_theta=1e6,
                         use_sliding_window=False, sliding_window=2048, max_window_layers=2,
                         tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"])
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoints(family_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-ckpts")
    out = {name: family_checkpoint(name) for name in DEMO}
    out["qwen2-hf"] = _qwen2_built_with_transformers(root / "qwen2-hf")
    out.update({name: family_checkpoint(family) for name, (family, _) in ON_NEURON.items()})
    return out


def _neuron_config(path: Path, backend: str, root: Path) -> Path:
    return make_config(path, {"deviceType": "neuron"}, {
        **HANDLER, "backend": backend, "dtype": "float32",
        "neuron": {"tp_degree": 2, "cores_per_instance": 4,
                   "core_lock_dir": str(root / "core-locks")}})


def _fakes_env(root: Path) -> dict[str, str]:
    """Both SDKs' fakes importable by every worker (the torch ones import neither)."""
    path = [str(FAKES), str(FAKES / "nxdi"), os.environ.get("PYTHONPATH")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, path)),
            "INF2SERVE_FAKE_NEURON_EVENTS": str(root / "events.jsonl"),
            "INF2SERVE_FAKE_NEURON_DEVICE_DIR": str(root / "device")}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families-e2e") / "model_store"


@pytest.fixture(scope="module")
def server(checkpoints: dict[str, Path], store: Path):
    root = store.parent
    store.mkdir()
    for name, ckpt in checkpoints.items():
        config = (_neuron_config(root / f"{name}.yaml", ON_NEURON[name][1], root)
                  if name in ON_NEURON else make_config(root / f"{name}.yaml", handler=HANDLER))
        package(config, ckpt, name, "no-archive", store)
    # six workers start at once: more than one model's time
    with running_server(store, root / "run", [*MODELS, *ON_NEURON], env=_fakes_env(root),
                        ready_timeout_s=600) as srv:
        yield srv


_attach_logs = attach_logs_fixture()


def _reference(model, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), max_new_tokens=N, min_new_tokens=N,
                             do_sample=False)
    return out[0, len(ids):].tolist()


def _chat_stream(server, name: str, messages: list[dict]) -> str:
    client = _client(server, name)
    stream = client.chat.completions.create(model=name, messages=messages, max_tokens=N,
                                            temperature=0, stream=True,
                                            extra_body={"min_tokens": N})
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def _chat(server, name: str, messages: list[dict]):
    return _client(server, name).chat.completions.create(
        model=name, messages=messages, max_tokens=N, temperature=0,
        extra_body={"min_tokens": N})


def _client(server, name: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.inference_url}/predictions/{name}/1.0/v1",
                  api_key=server.inference_token, max_retries=0, timeout=120)


@pytest.mark.parametrize("name", [*MODELS, *ON_NEURON])
def test_greedy_answers_equal_generate_native_and_chat_streamed_and_not(server, checkpoints,
                                                                        name) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = checkpoints[name]
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    prompt = f"Once upon a time the {name} model"
    messages = [{"role": "user", "content": f"Tell {name} a short story."}]
    native = {"prompt": prompt, "max_new_tokens": N, "min_new_tokens": N, "temperature": 0}
    jobs = [
        lambda: post(server, name, {**native, "stream": False, "details": True}),
        lambda: post(server, name, {**native, "stream_format": "ndjson"}),
        lambda: _chat(server, name, messages),
        lambda: _chat_stream(server, name, messages),
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        whole, streamed, chat, chat_streamed = [f.result() for f in
                                                [pool.submit(job) for job in jobs]]

    want = _reference(model, tok(prompt)["input_ids"])
    assert whole.status == 200, whole.body
    assert whole.json()["token_ids"] == want
    text = tok.decode(want, skip_special_tokens=True)
    assert whole.json()["text"] == text
    assert streamed.status == 200, streamed.body
    lines = streamed.ndjson()
    assert "".join(line.get("text", "") for line in lines) == text
    assert lines[-1]["completion_tokens"] == N

    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
    want_chat = _reference(model, list(chat_ids))
    chat_text = tok.decode(want_chat, skip_special_tokens=True)
    assert "<think>" not in chat_text and "<tool_call>" not in chat_text  # plain content
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert chat.choices[0].message.content == chat_text
    assert chat_streamed == chat_text


def test_the_transformers_built_checkpoint_is_what_a_user_saves(checkpoints) -> None:
    """Not a demo-model output: the chat template in chat_template.jinja (transformers 5's
    save_pretrained), untied, 7 query heads per K/V head; yet served above."""
    qwen = checkpoints["qwen2-hf"]
    assert (qwen / "chat_template.jinja").is_file()
    config = json.loads((qwen / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["num_attention_heads"] == 7 * config["num_key_value_heads"]


@pytest.mark.parametrize("name", ON_NEURON)
def test_on_the_neuron_fakes_joining_prompts_leave_a_greedy_answer_unchanged(server, store,
                                                                            name) -> None:
    """Continuous batching on the SDK's class for the family: 1-token prompts joining a
    running request (prefilled beside its decode) leave its text as it was alone; the
    compile cache's entry names the family."""
    alone, joined = _joined_by_one_token_prompts(server, name)
    assert joined == alone and alone.strip()
    family, backend = ON_NEURON[name]
    prefix = f"{family}-" if backend == "neuron" else f"nxdi-{family}-"
    entries = [p.name for p in (store / name / "neuron_cache").iterdir()
               if (p / "metadata.json").exists()]
    assert len(entries) == 1 and entries[0].startswith(prefix), entries
