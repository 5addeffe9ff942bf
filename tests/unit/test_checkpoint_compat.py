"""Checkpoints written under transformers 5 read the same under the Neuron SDKs' 4.x.

`demo-model` and `prepare` write under this suite's transformers 5; each 4.x overlay
(tests/overlays.py) then loads them in a subprocess, and tokenizer, RoPE, generation ids
and logits must equal what 5.x reads. The pure rewrite rules are tested on their own first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from archive_tools import checkpoint_compat as compat
from archive_tools.prepare import prepare
from tests import ckpt_probe
from tests.overlays import overlay_env, overlay_params, transformers_version, version_tuple

ROOT = Path(__file__).resolve().parents[2]
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# Llama-3 (theta 500000, no scaling) and Llama-3.1 (llama3 scaling), at a tiny size
ROPES = {"llama3-theta": {"rope_type": "default", "rope_theta": 500000.0},
         "llama31-scaling": LLAMA3_ROPE}


def test_config_gets_4x_rope_and_dtype_keys() -> None:
    out = compat.config_for_4x({"rope_parameters": dict(LLAMA3_ROPE), "dtype": "bfloat16"})
    assert out["rope_theta"] == 500000.0
    assert out["rope_scaling"] == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    assert out["rope_parameters"] == LLAMA3_ROPE and out["torch_dtype"] == "bfloat16"
    plain = compat.config_for_4x({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain["rope_scaling"] is None and plain["rope_theta"] == 1e4


def test_a_4x_config_is_left_as_it_was() -> None:
    old = {"rope_theta": 10000.0, "rope_scaling": None, "torch_dtype": "float16"}
    assert compat.config_for_4x(old) == old


@pytest.mark.parametrize("rope", list(ROPES.values()), ids=list(ROPES))
def test_5x_reads_the_rewritten_config_as_the_original(rope: dict) -> None:
    from transformers import LlamaConfig

    original = LlamaConfig(rope_parameters=dict(rope), max_position_embeddings=512).to_dict()
    rewritten = LlamaConfig.from_dict(compat.config_for_4x(original))
    assert rewritten.rope_parameters == LlamaConfig.from_dict(original).rope_parameters


def test_tokenizer_config_names_a_4x_class_and_inlines_the_template() -> None:
    out = compat.tokenizer_config_for_4x({"tokenizer_class": "TokenizersBackend",
                                          "chat_template": "old"}, "{{ messages }}")
    assert out["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert out["chat_template"] == "{{ messages }}"  # the .jinja wins in 4.47+ and 5.x
    assert out["clean_up_tokenization_spaces"] is False
    kept = compat.tokenizer_config_for_4x({"tokenizer_class": "LlamaTokenizer",
                                           "clean_up_tokenization_spaces": True}, None)
    assert kept == {"tokenizer_class": "LlamaTokenizer", "clean_up_tokenization_spaces": True}


def test_a_list_of_extra_special_tokens_becomes_additional_special_tokens() -> None:
    """5.x writes extra_special_tokens: [...], which 4.48+ read as a mapping and fail on."""
    out = compat.tokenizer_config_for_4x({"extra_special_tokens": ["<a>", "<b>"],
                                          "additional_special_tokens": ["<b>"]}, None)
    assert "extra_special_tokens" not in out
    assert out["additional_special_tokens"] == ["<b>", "<a>"]
    named = {"extra_special_tokens": {"image_token": "<img>"}}  # 4.48+'s own form: kept
    assert compat.tokenizer_config_for_4x(named, None)["extra_special_tokens"] == {
        "image_token": "<img>"}


def test_merges_become_strings_unless_a_token_holds_a_space() -> None:
    tok = {"model": {"type": "BPE", "merges": [["a", "b"], ["Ġ", "c"]]}}
    assert compat.tokenizer_json_for_old(tok)["model"]["merges"] == ["a b", "Ġ c"]
    assert compat.tokenizer_json_for_old({"model": {"type": "BPE", "merges": [["a b", "c"]]}}) \
        is None
    assert compat.tokenizer_json_for_old({"model": {"type": "BPE", "merges": ["a b"]}}) is None


def _raw_5x_source(dst: Path, demo: Path, rope: dict) -> Path:
    """A tiny Llama saved by 5.x as a user would (tokenizer re-saved by 5.x with an extra
    special token, template as .jinja)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=172,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rope_parameters=dict(rope),
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(dst)
    tokenizer = AutoTokenizer.from_pretrained(demo)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    tokenizer.save_pretrained(dst)
    saved = json.loads((dst / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == "TokenizersBackend"  # what 4.x cannot load
    assert saved["extra_special_tokens"] == ["<tool>"]  # nor 4.48+ this
    assert (dst / "chat_template.jinja").is_file()
    return dst


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint: Path, tmp_path_factory) -> dict[str, Path]:
    """demo-model output, and `prepare` outputs of raw 5.x checkpoints with Llama-3 RoPEs."""
    root = tmp_path_factory.mktemp("compat")
    out = {"demo": tiny_checkpoint}
    for name, rope in ROPES.items():
        src = _raw_5x_source(root / f"{name}-src", tiny_checkpoint, rope)
        out[name] = prepare(src, root / name)
    return out


@pytest.fixture(scope="module")
def read_by_5x(checkpoints: dict[str, Path]) -> dict[str, dict]:
    return {name: ckpt_probe.probe(str(path)) for name, path in checkpoints.items()}


_read_by_4x: dict[Path, dict] = {}


def read_by(overlay: Path, checkpoints: dict[str, Path]) -> dict[str, dict]:
    """ckpt_probe of every checkpoint in one subprocess under `overlay` (cached per overlay)."""
    if overlay not in _read_by_4x:
        r = subprocess.run([sys.executable, "-m", "tests.ckpt_probe",
                            *map(str, checkpoints.values())], cwd=ROOT, env=overlay_env(overlay),
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        by_path = json.loads(r.stdout.strip().splitlines()[-1])
        _read_by_4x[overlay] = {n: by_path[str(p)] for n, p in checkpoints.items()}
    return _read_by_4x[overlay]


@pytest.mark.parametrize("overlay", overlay_params())
@pytest.mark.parametrize("name", ["demo", *ROPES])
def test_4x_reads_what_5x_reads(overlay: Path, name: str, checkpoints, read_by_5x) -> None:
    got = read_by(overlay, checkpoints)[name]
    version = transformers_version(overlay)
    if name == "llama31-scaling" and version_tuple(version) < (4, 43):
        # llama3 RoPE scaling arrived in 4.43; older versions must refuse it, not misread it
        assert "rope_scaling" in got.get("error", ""), got.get("error")
        return
    assert "error" not in got, got["error"]
    want = read_by_5x[name]
    assert got["transformers"] == version and want["transformers"].startswith("5.")
    for key in ("ids", "decoded", "decoded_skip_special", "special_ids", "chat", "rope",
                "generation_ids"):
        assert got[key] == want[key], key
    assert got["chat"] is not None and got["rope"]["theta"] == (
        10000.0 if name == "demo" else 500000.0)
    torch.testing.assert_close(torch.tensor(got["inv_freq"]), torch.tensor(want["inv_freq"]))
    assert got["attention_scaling"] == pytest.approx(want["attention_scaling"])
    torch.testing.assert_close(torch.tensor(got["logits"]), torch.tensor(want["logits"]),
                               atol=1e-4, rtol=1e-4)
