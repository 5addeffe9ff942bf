"""config.json must describe its weights: the shape table per model_type, against what
transformers' own save_pretrained writes, and the refusals naming tensor, file and keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from handlers.checkpoint_checks import check_weights, safetensors_header
from handlers.checkpoint_shapes import ARCHITECTURES, check_shapes
from handlers.errors import ConfigError

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
# model_type -> (config class, extra keys): GQA everywhere, and each family's own options
FAMILIES = [
    ("llama", "LlamaConfig", {}),
    ("llama", "LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    ("llama", "LlamaConfig", {"tie_word_embeddings": True}),
    ("llama", "LlamaConfig", {"head_dim": 16}),  # head_dim x heads != hidden_size
    ("mistral", "MistralConfig", {}),
    ("qwen2", "Qwen2Config", {"tie_word_embeddings": True}),
    ("qwen3", "Qwen3Config", {"head_dim": 16}),
    ("qwen3", "Qwen3Config", {"head_dim": 8, "attention_bias": True}),
    ("mixtral", "MixtralConfig", {"num_local_experts": 3, "num_experts_per_tok": 2}),
]


def saved(tmp_path: Path, cls_name: str, extra: dict) -> tuple[dict, dict[str, list[int]]]:
    """A tiny model of the family saved by transformers: (config.json, tensor shapes)."""
    import torch
    import transformers

    config = getattr(transformers, cls_name)(**SMALL, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    header, _ = safetensors_header(tmp_path / "model.safetensors")
    shapes = {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
    return json.loads((tmp_path / "config.json").read_text()), shapes


@pytest.mark.parametrize("model_type, cls_name, extra", FAMILIES,
                         ids=[f"{f[0]}-{'-'.join(f[2]) or 'plain'}" for f in FAMILIES])
def test_the_table_is_what_transformers_saves(model_type: str, cls_name: str, extra: dict,
                                              tmp_path: Path) -> None:
    config, shapes = saved(tmp_path, cls_name, extra)
    assert config["model_type"] == model_type
    expected = ARCHITECTURES[model_type](config)
    required = {n: list(e.shape) for n, e in expected.items() if not e.optional}
    optional = {n: list(e.shape) for n, e in expected.items() if e.optional}
    assert {n: s for n, s in shapes.items() if n not in optional} == required
    assert all(shapes[n] == s for n, s in optional.items() if n in shapes)
    check_weights(tmp_path, config)  # and the check accepts it


@pytest.fixture
def ckpt(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")


def edit_config(ckpt: Path, **changes) -> dict:
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))
    return config


@pytest.mark.parametrize("change, message", [
    (lambda c: {"hidden_size": c["hidden_size"] * 2},
     "tensor 'model.embed_tokens.weight' is [{v}, {h}], but {cfg} implies [{v}, {h2}] "
     "(vocab_size x hidden_size, with vocab_size {v}, hidden_size {h2})"),
    (lambda c: {"vocab_size": c["vocab_size"] // 2},
     "tensor 'model.embed_tokens.weight' is [{v}, {h}], but {cfg} implies [{v2}, {h}]"),
    (lambda c: {"intermediate_size": c["intermediate_size"] * 2},
     "tensor 'model.layers.0.mlp.gate_proj.weight' is [{i}, {h}], but {cfg} implies "
     "[{i2}, {h}] (intermediate_size x hidden_size, with hidden_size {h}, intermediate_size "
     "{i2})"),
    (lambda c: {"num_key_value_heads": c["num_attention_heads"]},
     "tensor 'model.layers.0.self_attn.k_proj.weight' is"),
    (lambda c: {"num_hidden_layers": c["num_hidden_layers"] + 1},
     "needs tensor 'model.layers.{n}.self_attn.q_proj.weight'"),
    (lambda c: {"num_hidden_layers": c["num_hidden_layers"] - 1},
     "holds 'model.layers.{n1}."),
])
def test_a_config_that_does_not_describe_the_weights_is_refused(ckpt: Path, change,
                                                                message: str) -> None:
    original = json.loads((ckpt / "config.json").read_text())
    config = edit_config(ckpt, **change(original))
    with pytest.raises(ConfigError) as info:
        check_weights(ckpt, config)
    o = original
    want = message.format(v=o["vocab_size"], h=o["hidden_size"], h2=o["hidden_size"] * 2,
                          v2=o["vocab_size"] // 2, i=o["intermediate_size"],
                          i2=o["intermediate_size"] * 2, n=o["num_hidden_layers"],
                          n1=o["num_hidden_layers"] - 1, cfg=ckpt / "config.json")
    assert want in str(info.value)
    assert "restore the config.json saved with these weights" in str(info.value)


def test_an_untied_model_needs_its_lm_head(ckpt: Path) -> None:
    from safetensors.torch import load_file, save_file

    config = json.loads((ckpt / "config.json").read_text())
    assert not config.get("tie_word_embeddings")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="needs tensor 'lm_head.weight' .* which no weight file "
                                          "holds and tie_word_embeddings is false"):
        check_weights(ckpt, config)
    check_weights(ckpt, edit_config(ckpt, tie_word_embeddings=True))  # tied: none needed


@pytest.mark.parametrize("changes", [{"model_type": "gpt_neox"},
                                     {"quantization_config": {"quant_method": "awq"}}])
def test_unknown_families_and_quantized_weights_are_not_shape_checked(changes: dict) -> None:
    config = {**SMALL, "model_type": "llama", **changes}
    check_shapes(config, {"w": ([1], Path("x"))}, Path("config.json"))  # no error


def test_a_missing_size_is_named(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    del config["hidden_size"]
    with pytest.raises(ConfigError) as info:
        check_weights(ckpt, config)
    assert str(info.value).startswith(f"{ckpt / 'config.json'}: hidden_size is None; expected a "
                                      "positive integer (model_type 'llama')")
