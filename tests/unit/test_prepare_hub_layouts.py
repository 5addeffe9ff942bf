"""`prepare` on each family's Hugging Face Hub layout, laid out as a download brings it.

Qwen: sharded safetensors with their index, a BPE tokenizer as vocab.json + merges.txt +
tokenizer.json under Qwen2Tokenizer, tied embeddings (no lm_head.weight), a generation
config with Qwen's sampling defaults, a config keeping a switched-off sliding_window.
Mistral-7B-Instruct-v0.3 and Mixtral: the transformers layout beside Mistral's own
(params.json, consolidated.safetensors / consolidated.00.pt, tokenizer.model.v3), which
must never be read as shards; Mistral's own layout alone is refused with what to fetch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from archive_tools import prepare as prep
from archive_tools.cli import main


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(ckpt.glob("model*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _as_published(demo: Path, out: Path) -> Path:
    """The demo checkpoint saved as the publisher's repository holds it: weights in shards
    with an index, by transformers' own save_pretrained (not the toolkit's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo)
    model.save_pretrained(out, max_shard_size="200KB")
    AutoTokenizer.from_pretrained(demo).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def demos(family_checkpoint) -> dict[str, Path]:
    return {arch: family_checkpoint(arch) for arch in ("qwen2", "mistral", "mixtral")}


def _same_greedy_logits(a: Path, b: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[3, 17, 99, 250, 7]])
    with torch.inference_mode():
        la = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)(ids).logits
        lb = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)(ids).logits
    assert torch.equal(la, lb)


def test_qwen_hub_layout(demos, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    src = _as_published(demos["qwen2"], tmp_path / "Qwen2.5-0.5B-Instruct")
    tok = AutoTokenizer.from_pretrained(src)
    tok.backend_tokenizer.model.save(str(src))  # vocab.json and merges.txt, as Qwen ships
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**cfg,
                                                           "tokenizer_class": "Qwen2Tokenizer"}))
    config = json.loads((src / "config.json").read_text())
    config.update(sliding_window=32768, use_sliding_window=False, max_window_layers=21)
    (src / "config.json").write_text(json.dumps(config))
    gen = json.loads((src / "generation_config.json").read_text())
    gen.update(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    (src / "generation_config.json").write_text(json.dumps(gen))
    assert (src / "model.safetensors.index.json").is_file() and (src / "vocab.json").is_file()
    assert "lm_head.weight" not in _tensors(src)  # tied, as in the 0.5B-3B sizes

    out = prep.prepare(src, tmp_path / "out")
    assert _tensors(out).keys() == _tensors(src).keys()
    assert {"vocab.json", "merges.txt", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    _same_greedy_logits(src, out)
    prepared = AutoTokenizer.from_pretrained(out)
    text = "<|im_start|>user\nHi<|im_end|>\n<tool_call>"
    assert prepared(text)["input_ids"] == tok(text)["input_ids"]
    assert prepared.chat_template == tok.chat_template
    assert json.loads((out / "generation_config.json").read_text())["top_k"] == 20


def _mistral_native_beside(src: Path) -> None:
    """Mistral's own files as the v0.3 repository has them beside the transformers ones."""
    renamed = {k.replace("model.layers.", "layers.").replace("self_attn.q_proj", "attention.wq")
               .replace("model.embed_tokens", "tok_embeddings"): t.clone()
               for k, t in _tensors(src).items()}
    save_file(renamed, str(src / "consolidated.safetensors"))
    (src / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 2, "n_heads": 4,
                                                 "n_kv_heads": 2, "vocab_size": 1024}))
    (src / "tokenizer.model.v3").write_bytes(b"\x0a\x04mock")


@pytest.mark.parametrize("with_index", [True, False])
def test_mistral_v0_3_hub_layout_reads_the_transformers_shards_only(
        demos, tmp_path: Path, with_index: bool) -> None:
    from transformers import AutoTokenizer

    src = _as_published(demos["mistral"], tmp_path / "Mistral-7B-Instruct-v0.3")
    _mistral_native_beside(src)
    if not with_index:  # a download that skipped the index: the shard files alone
        (src / "model.safetensors.index.json").unlink()
    out = prep.prepare(src, tmp_path / "out", amp="f32")
    assert _tensors(out).keys() == _tensors(src).keys()
    assert not any(k.startswith(("layers.", "tok_embeddings")) for k in _tensors(out))
    assert not (out / "consolidated.safetensors").exists()
    assert not (out / "params.json").exists()
    _same_greedy_logits(demos["mistral"], out)  # what was saved (transformers needs the index)
    tok = AutoTokenizer.from_pretrained(out)
    assert "[AVAILABLE_TOOLS]" in tok.chat_template
    ids = tok("[TOOL_CALLS]", add_special_tokens=False)["input_ids"]  # one special token
    assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == ""


def test_mixtral_hub_layout_leaves_the_consolidated_pt_files(demos, tmp_path: Path) -> None:
    src = _as_published(demos["mixtral"], tmp_path / "Mixtral-8x7B-Instruct-v0.1")
    for i in range(2):  # consolidated.00.pt ... beside the safetensors, as on the Hub
        torch.save({"layers.0.feed_forward.experts.0.w1.weight": torch.zeros(2)},
                   src / f"consolidated.0{i}.pt")
    out = prep.prepare(src, tmp_path / "out", amp="bf16")
    assert _tensors(out).keys() == _tensors(src).keys()
    assert not list(out.glob("consolidated*"))
    assert json.loads((out / "config.json").read_text())["num_local_experts"] == 8


def test_mistral_native_layout_alone_is_refused_with_what_to_download(
        demos, tmp_path: Path, capsys) -> None:
    src = _as_published(demos["mistral"], tmp_path / "mistral-native")
    _mistral_native_beside(src)
    for path in list(src.iterdir()):  # what mistral-inference's instructions download
        if path.name not in ("params.json", "consolidated.safetensors", "tokenizer.model.v3"):
            path.unlink()
    capsys.readouterr()  # the setup's progress bars
    assert main(["prepare", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "Mistral's own layout (params.json, consolidated.safetensors)" in err
    assert "huggingface-cli download REPO --include 'config.json'" in err
    assert "'model*.safetensors*'" in err and "'tokenizer*'" in err
    assert not (tmp_path / "out").exists()


def test_a_llama_3_download_ignores_meta_s_original_folder(tiny_checkpoint: Path,
                                                          tmp_path: Path) -> None:
    src = tmp_path / "Llama-3.1-8B-Instruct"
    shutil.copytree(tiny_checkpoint, src)
    (src / "original").mkdir()  # Meta's layout, as meta-llama repositories hold it
    torch.save({"tok_embeddings.weight": torch.zeros(2)},
               src / "original" / "consolidated.00.pth")
    (src / "original" / "params.json").write_text("{}")
    out = prep.prepare(src, tmp_path / "out")
    assert _tensors(out).keys() == _tensors(tiny_checkpoint).keys()
    assert not (out / "original").exists()
