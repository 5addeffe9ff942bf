"""`inf2serve prepare`: values survive the cast, layouts load, bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from archive_tools import prepare as prep
from archive_tools.cli import main

CONFIG = Path(__file__).resolve().parents[2] / "model_configs" / "tiny-llama-cpu.yaml"


def source_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("amp, dtype", [("bf16", torch.bfloat16), ("f16", torch.float16),
                                        ("f32", torch.float32)])
def test_round_trip_values_equal_after_cast(tiny_checkpoint: Path, tmp_path: Path, amp: str,
                                            dtype: torch.dtype) -> None:
    out = prep.prepare(tiny_checkpoint, tmp_path / "out", amp=amp)
    src, got = source_tensors(tiny_checkpoint), source_tensors(out)
    assert got.keys() == src.keys()
    for key, t in src.items():
        assert got[key].dtype == dtype
        assert torch.equal(got[key], t.to(dtype)), key
    assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype).split(".")[1]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no work dir left


def test_prepared_checkpoint_loads_in_transformers(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = prep.prepare(tiny_checkpoint, tmp_path / "out", amp="bf16")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert AutoTokenizer.from_pretrained(out)("Hello")["input_ids"]


def test_bin_source_and_sharded_output_names(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A pytorch_model.bin source (tied tensors share storage there) becomes safetensors."""
    src = tmp_path / "bin"
    src.mkdir()
    tensors = source_tensors(tiny_checkpoint)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # tied: shared storage
    torch.save(tensors, src / "pytorch_model.bin")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((tiny_checkpoint / name).read_bytes())
    out = prep.prepare(src, tmp_path / "out", amp="f16")
    got = source_tensors(out)
    assert (out / "model.safetensors").is_file()
    assert torch.equal(got["lm_head.weight"], tensors["model.embed_tokens.weight"].half())
    assert (out / "generation_config.json").is_file()  # created: the source had none


def test_legacy_split_layout(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """save_pretrained_split: pytorch_model.bin/, key_to_filename.json, one file per key."""
    out = prep.prepare(tiny_checkpoint, tmp_path / "out", amp="bf16", legacy_split=True)
    split = out / "pytorch_model.bin"
    key_to_file = json.loads((split / "key_to_filename.json").read_text())
    src = source_tensors(tiny_checkpoint)
    assert key_to_file.keys() == src.keys()
    assert not list(out.glob("*.safetensors"))  # newer loaders would prefer them
    for i, (key, name) in enumerate(key_to_file.items()):
        assert name.startswith(f"p{i}.")
        t = torch.load(split / name, weights_only=True)
        assert torch.equal(t, src[key].bfloat16())
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # no shared storage


def test_amp_from_config(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    code = main(["prepare", str(tiny_checkpoint), str(tmp_path / "out"), "--config", str(CONFIG)])
    assert code == 0 and "float32" in capsys.readouterr().out  # torch backend, dtype float32


@pytest.mark.parametrize("flag", [["--dtype", "bfloat16"], ["--amp", "bf16"]])
def test_dtype_takes_the_configs_names(flag: list[str], tiny_checkpoint: Path, tmp_path: Path,
                                       capsys) -> None:
    """--dtype bfloat16, as handler.dtype spells it; --amp bf16 still works."""
    out = tmp_path / "out"
    assert main(["prepare", str(tiny_checkpoint), str(out), *flag]) == 0
    assert "safetensors, bfloat16," in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_force_replaces(tiny_checkpoint: Path, tmp_path: Path) -> None:
    prep.prepare(tiny_checkpoint, tmp_path / "out", amp="f32")
    prep.prepare(tiny_checkpoint, tmp_path / "out", amp="bf16", force=True)
    assert next(iter(source_tensors(tmp_path / "out").values())).dtype == torch.bfloat16


def test_failure_leaves_nothing(tiny_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prep, "_write_meta", boom)
    with pytest.raises(OSError):
        prep.prepare(tiny_checkpoint, tmp_path / "out", amp="bf16")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case, expected", [
    ("missing_src", "no such directory"),
    ("no_config", "no config.json"),
    ("no_tokenizer", "no tokenizer files"),
    ("no_weights", "no *.safetensors"),
    ("exists", "exists; pass --force to replace it"),
    ("inside_src", "must not be SRC or inside it"),
])
def test_bad_input_is_one_line_exit_2(tiny_checkpoint: Path, tmp_path: Path, capsys, case: str,
                                      expected: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for p in tiny_checkpoint.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    out = tmp_path / "out"
    if case == "missing_src":
        src = tmp_path / "nope"
    elif case == "no_config":
        (src / "config.json").unlink()
    elif case == "no_tokenizer":
        (src / "tokenizer.json").unlink()
    elif case == "no_weights":
        (src / "model.safetensors").unlink()
    elif case == "exists":
        out.mkdir()
    elif case == "inside_src":
        out = src / "out"
    code = main(["prepare", str(src), str(out), "--amp", "bf16"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and expected in err and err.count("\n") == 1
    if case not in ("exists",):
        assert not out.exists()
