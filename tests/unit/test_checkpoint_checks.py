"""What a newcomer's checkpoint meets at `prepare` / `package` / `inspect`: one weight format,
a tokenizer and config that load as the worker loads them, a chat template that renders."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from archive_tools import package as pkg
from archive_tools import prepare as prep
from archive_tools.cli import main
from archive_tools.inspect_cmd import scan, summarize
from handlers.presets.chat_templates import PRESETS
from tests.unit.test_package_user_files import members

CONFIG = Path(__file__).resolve().parents[2] / "model_configs" / "tiny-llama-cpu.yaml"


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def save_bin(ckpt: Path) -> None:
    """pytorch_model.bin beside the safetensors, as many hub repos ship both."""
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(ckpt / "model.safetensors"), ckpt / "pytorch_model.bin")


def tokenizer_model_only(ckpt: Path) -> None:
    """tokenizer.model and no tokenizer.json (the bytes do not matter: without sentencepiece
    transformers falls back to tiktoken, which is not installed either)."""
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer.model").write_bytes(b"\x0a\x0bsentencepiece")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("fmt", ["mar", "no-archive"])
def test_dual_format_checkpoint_ships_the_safetensors_only(tiny_checkpoint: Path, tmp_path: Path,
                                                           capsys, fmt: str) -> None:
    ckpt = copy(tiny_checkpoint, tmp_path / "ckpt")
    save_bin(ckpt)
    (ckpt / "original").mkdir()
    (ckpt / "original" / "consolidated.00.pth").write_bytes(b"x" * 100)
    code, out, _ = run(capsys, "package", "--config", str(CONFIG), "--checkpoint", str(ckpt),
                       "--name", "tiny", "--format", fmt, "--out", str(tmp_path / "store"))
    assert code == 0 and "leaves out consolidated.00.pth, pytorch_model.bin" in out
    names = set(members(next((tmp_path / "store").iterdir())))
    assert "model/model.safetensors" in names
    assert not {"model/pytorch_model.bin", "model/original/consolidated.00.pth"} & names


def test_pickled_weights_go_through_prepare(tiny_checkpoint: Path, tmp_path: Path,
                                            capsys) -> None:
    ckpt = copy(tiny_checkpoint, tmp_path / "ckpt")
    save_bin(ckpt)
    (ckpt / "model.safetensors").unlink()
    code, _, err = run(capsys, "package", "--config", str(CONFIG), "--checkpoint", str(ckpt),
                       "--name", "tiny", "--out", str(tmp_path / "store"))
    assert code == 2 and "pickled weights (pytorch_model.bin)" in err
    assert "inf2serve prepare SRC OUT" in err
    # the fix works: prepare converts, package takes the result
    out = prep.prepare(ckpt, tmp_path / "prepared")
    assert (out / "model.safetensors").is_file() and not (out / "pytorch_model.bin").exists()
    pkg.package(CONFIG, out, "tiny", "mar", tmp_path / "store")


def test_split_layout_beside_safetensors_is_refused(tiny_checkpoint: Path,
                                                     tmp_path: Path) -> None:
    ckpt = copy(tiny_checkpoint, tmp_path / "ckpt")
    (ckpt / "pytorch_model.bin").mkdir()
    with pytest.raises(pkg.Inf2ServeError, match="keep one"):
        pkg.plan_package(CONFIG, ckpt, "tiny", "mar", tmp_path / "store")


def test_tokenizer_model_only_is_refused_with_the_fix(tiny_checkpoint: Path, tmp_path: Path,
                                                      capsys) -> None:
    ckpt = copy(tiny_checkpoint, tmp_path / "ckpt")
    tokenizer_model_only(ckpt)
    code, _, err = run(capsys, "package", "--config", str(CONFIG), "--checkpoint", str(ckpt),
                       "--name", "tiny", "--out", str(tmp_path / "store"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "the tokenizer does not load as the worker loads it" in err
    assert "pip install sentencepiece" in err and "inf2serve prepare" in err
    assert not (tmp_path / "store").exists()
    code, _, err = run(capsys, "prepare", str(ckpt), str(tmp_path / "out"))
    assert code == 2 and "only tokenizer.model" in err and "pip install sentencepiece" in err
    assert not (tmp_path / "out").exists()


def test_prepare_writes_tokenizer_json_from_tokenizer_model(tiny_checkpoint: Path,
                                                            tmp_path: Path, monkeypatch) -> None:
    """With sentencepiece (stood in for by a loader that returns a fast tokenizer, as
    AutoTokenizer converts tokenizer.model into one), prepare writes its tokenizer.json."""
    import transformers

    src = copy(tiny_checkpoint, tmp_path / "src")
    reference = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    tokenizer_model_only(src)
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, **kw: reference if Path(path) == src.resolve()
                        else real(path, **kw))
    out = prep.prepare(src, tmp_path / "out")
    loaded = real(out)
    assert loaded("Hello world")["input_ids"] == reference("Hello world")["input_ids"]


def test_config_json_that_does_not_load(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = copy(tiny_checkpoint, tmp_path / "ckpt")
    (ckpt / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(pkg.Inf2ServeError, match="config.json does not load with AutoConfig"):
        pkg.plan_package(CONFIG, ckpt, "tiny", "mar", tmp_path / "store")


@pytest.mark.parametrize("setting, expected", [
    ("llama2", "did you mean 'llama-2'?"),
    ("chat.jinja", f"not a preset ({', '.join(PRESETS)}), inline Jinja, or a file"),
    ("{% for m in messages %}{{ m['content'] }",
     "handler.chat_template: the chat template does not compile: unexpected '}' "
     "(template line 1)"),
    ("{{ raise_exception('a system message is required') }}",
     "does not render a user/assistant/user conversation: "),
])
def test_chat_template_is_checked_when_packaging(tiny_checkpoint: Path, tmp_path: Path,
                                                 setting: str, expected: str) -> None:
    import yaml

    data = yaml.safe_load(CONFIG.read_text())
    data["handler"]["chat_template"] = setting
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match=re.escape(expected)):
        pkg.plan_package(cfg, tiny_checkpoint, "tiny", "mar", tmp_path / "store")
    # a file in the checkpoint is found as the worker finds it
    if setting == "chat.jinja":
        ckpt = copy(tiny_checkpoint, tmp_path / "ckpt")
        (ckpt / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
        pkg.plan_package(cfg, ckpt, "tiny", "mar", tmp_path / "store")


def test_inspect_reports_the_split_layout_like_safetensors(tiny_checkpoint: Path,
                                                           tmp_path: Path) -> None:
    split = prep.prepare(tiny_checkpoint, tmp_path / "split", amp="bf16", legacy_split=True)
    plain = prep.prepare(tiny_checkpoint, tmp_path / "plain", amp="bf16")
    want = summarize(scan(pkg.package(CONFIG, plain, "st", "mar", tmp_path / "s")))["checkpoint"]
    assert want["layout"] == "safetensors" and want["dtypes"] == {"BF16": want["params"]}
    for fmt in ("mar", "tgz", "no-archive"):
        got = summarize(scan(pkg.package(CONFIG, split, f"sp-{fmt}", fmt, tmp_path / "s")))
        k = got["checkpoint"]
        assert (k["layout"], k["params"], k["dtypes"]) == ("legacy split", want["params"],
                                                           want["dtypes"])


def test_inspect_reads_a_pickled_bin_of_an_older_archive(tiny_checkpoint: Path,
                                                         tmp_path: Path) -> None:
    """Archives packaged before one-format packaging may hold pytorch_model.bin."""
    target = pkg.package(CONFIG, tiny_checkpoint, "old", "no-archive", tmp_path / "s")
    want = summarize(scan(target))["checkpoint"]
    save_bin(target / "model")
    (target / "model" / "model.safetensors").unlink()
    k = summarize(scan(target))["checkpoint"]
    assert (k["layout"], k["params"], k["dtypes"]) == ("pickled .bin", want["params"],
                                                       want["dtypes"])


@pytest.mark.parametrize("legacy_split", [False, True])
def test_prepare_writes_what_the_workers_checks_accept(tiny_checkpoint: Path, tmp_path: Path,
                                                       legacy_split: bool) -> None:
    """`prepare`'s output passes the checks every worker runs at its start (headers read,
    no tensor loaded; the legacy split folder has no safetensors header to read)."""
    from handlers.checkpoint_checks import check_checkpoint_files
    from handlers.config import load_config

    out = prep.prepare(tiny_checkpoint, tmp_path / "out", amp="bf16", legacy_split=legacy_split)
    assert check_checkpoint_files(load_config(CONFIG), out) == []
