"""`inf2serve package`: validation first, bytes written once, never a half-written archive."""

from __future__ import annotations

import json
import tarfile
import tempfile
import threading
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest

from archive_tools import fileops
from archive_tools import package as pkg
from archive_tools.cli import main

CONFIG = Path(__file__).resolve().parents[2] / "model_configs" / "tiny-llama-cpu.yaml"
CKPT_BYTES = 16 << 20


def make_checkpoint(path: Path, nbytes: int = 1 << 16) -> Path:
    """A serving checkpoint as `package` sees it: config, tokenizer, one real safetensors file
    of about `nbytes`: a one-layer Llama over the tokenizer's 2 words, whose
    config.json describes its tensors (7 h x h matrices and a few vectors, float32)."""
    import torch
    from safetensors.torch import save_file

    from handlers.checkpoint_shapes import llama

    h = max(8, int((nbytes / 4 / 7) ** 0.5) // 4 * 4)  # two heads of an even size (RoPE)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float32",
              "vocab_size": 2, "hidden_size": h, "intermediate_size": h, "num_hidden_layers": 1,
              "num_attention_heads": 2, "max_position_embeddings": 2048}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(tiny_tokenizer_json())
    tensors = {name: torch.randn(want.shape) for name, want in llama(config).items()}
    save_file(tensors, str(path / "model.safetensors"))
    return path


def tiny_tokenizer_json() -> str:
    """A tokenizer.json that loads (package loads it as the worker will)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    return Tokenizer(WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).to_str()


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root (hidden ones too) with size and mtime: 'unchanged' means equal."""
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*")}


def bytes_written() -> int:
    """This process's write() total (Linux /proc/self/io wchar), sendfile included."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "ckpt")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("fmt", list(pkg.FORMATS))
def test_each_format_has_layout_and_manifest(ckpt: Path, tmp_path: Path, fmt: str) -> None:
    target = pkg.package(CONFIG, ckpt, "tiny", fmt, tmp_path / "store")
    if fmt == "no-archive":
        names = {p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()}
        manifest = json.loads((target / "MAR-INF/MANIFEST.json").read_text())
    elif fmt == "tgz":
        with tarfile.open(target) as tar:
            names = {n.split("/", 1)[1] for n in tar.getnames()}
            manifest = json.load(tar.extractfile("tiny/MAR-INF/MANIFEST.json"))
    else:
        with zipfile.ZipFile(target) as zf:
            names = set(zf.namelist())
            manifest = json.loads(zf.read("MAR-INF/MANIFEST.json"))
            kinds = {i.compress_type for i in zf.infolist()}
            assert kinds == ({zipfile.ZIP_STORED} if fmt == "zip-store" else {zipfile.ZIP_DEFLATED})
    assert {"handler_entry.py", "model-config.yaml", "requirements.txt", "model/model.safetensors",
            "runtime/handlers/config.py", "MAR-INF/MANIFEST.json"} <= names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert manifest["model"] == {"modelName": "tiny", "handler": "handler_entry.py",
                                 "modelVersion": "1.0", "requirementsFile": "requirements.txt",
                                 "configFile": "model-config.yaml"}
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no leftovers


def test_requirements_are_pinned(ckpt: Path, tmp_path: Path) -> None:
    target = pkg.package(CONFIG, ckpt, "tiny", "no-archive", tmp_path / "store")
    lines = [ln for ln in (target / "requirements.txt").read_text().splitlines()
             if not ln.startswith("#")]
    assert {ln.split("==")[0] for ln in lines} == set(pkg.PINNED)
    assert all("==" in ln for ln in lines)


@pytest.mark.parametrize("fmt", list(pkg.FORMATS))
def test_checkpoint_bytes_are_written_once(tmp_path: Path, fmt: str) -> None:
    ckpt = make_checkpoint(tmp_path / "big", CKPT_BYTES)
    before = bytes_written()
    pkg.package(CONFIG, ckpt, "big", fmt, tmp_path / "store")
    written = bytes_written() - before
    # torch-model-archiver writes extra files twice ($TMPDIR/<name>, then the export): >= 2x
    assert CKPT_BYTES * 0.9 < written < CKPT_BYTES * 1.3, f"{written} bytes for {CKPT_BYTES}"


def test_link_writes_no_checkpoint_bytes(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "big", CKPT_BYTES)
    before = bytes_written()
    target = pkg.package(CONFIG, ckpt, "big", "no-archive", tmp_path / "store", link=True)
    assert bytes_written() - before < CKPT_BYTES * 0.1
    src, dst = (ckpt / "model.safetensors").stat(), (target / "model/model.safetensors").stat()
    assert (src.st_ino, src.st_dev) == (dst.st_ino, dst.st_dev) and dst.st_nlink == 2


def test_nothing_staged_in_tmpdir(ckpt: Path, tmp_path: Path, monkeypatch) -> None:
    """model_archiver stages in $TMPDIR/<name>; we never touch $TMPDIR."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    for fmt in pkg.FORMATS:
        pkg.package(CONFIG, ckpt, f"tiny-{fmt}", fmt, tmp_path / "store")
    assert list(tmp.iterdir()) == []


def test_concurrent_runs_of_the_same_name(ckpt: Path, tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            pkg.package(CONFIG, ckpt, "same", "no-archive", tmp_path / f"store{i}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i in range(4):
        got = tree(tmp_path / f"store{i}" / "same")
        assert got.keys() == tree(tmp_path / "store0" / "same").keys()


def _failing_bar(after: int, exc: BaseException):
    @contextmanager
    def bar(total: int, label: str, enabled: bool = True):
        done = [0]

        def advance(n: int) -> None:
            done[0] += n
            if done[0] > after:
                raise exc
        yield advance
    return bar


@pytest.mark.parametrize("fmt", list(pkg.FORMATS))
@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_interrupted_run_leaves_store_unchanged(tmp_path: Path, monkeypatch, fmt: str,
                                                exc: BaseException) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", 1 << 20)
    store = tmp_path / "store"
    pkg.package(CONFIG, ckpt, "tiny", fmt, store)  # the archive a --force run would replace
    (store / "other.mar").write_bytes(b"another model")
    before = tree(store)
    monkeypatch.setattr(fileops, "CHUNK", 4096)  # so the failure lands inside the weights file
    monkeypatch.setattr(pkg, "progress_bar", _failing_bar(600 << 10, exc))
    with pytest.raises(type(exc)):
        pkg.package(CONFIG, ckpt, "tiny", fmt, store, force=True)
    assert tree(store) == before


def test_cli_interrupted_run_is_one_line_and_store_unchanged(ckpt: Path, tmp_path: Path,
                                                             monkeypatch, capsys) -> None:
    store = tmp_path / "store"
    store.mkdir()
    monkeypatch.setattr(pkg, "progress_bar", _failing_bar(1000, KeyboardInterrupt()))
    code, _, err = run(capsys, "package", "--config", str(CONFIG), "--checkpoint", str(ckpt),
                       "--name", "tiny", "--out", str(store))
    assert code == 130 and err.strip() == "interrupted"
    assert list(store.iterdir()) == []


def test_force_replaces_only_when_complete_and_removes_other_formats(ckpt: Path,
                                                                     tmp_path: Path) -> None:
    store = tmp_path / "store"
    pkg.package(CONFIG, ckpt, "tiny", "mar", store)
    pkg.package(CONFIG, ckpt, "tiny", "no-archive", store, force=True)
    assert sorted(p.name for p in store.iterdir()) == ["tiny"]
    (store / "tiny" / "stale.txt").write_text("from an older build")
    pkg.package(CONFIG, ckpt, "tiny", "no-archive", store, force=True)
    assert not (store / "tiny" / "stale.txt").exists()
    assert sorted(p.name for p in store.iterdir()) == ["tiny"]


def test_dry_run_writes_nothing(ckpt: Path, tmp_path: Path, capsys) -> None:
    code, out, _ = run(capsys, "package", "--config", str(CONFIG), "--checkpoint", str(ckpt),
                       "--name", "tiny", "--format", "tgz", "--out", str(tmp_path / "store"),
                       "--dry-run")
    assert code == 0 and "tiny.tar.gz" in out and "dry run" in out
    assert not (tmp_path / "store").exists()


def _typo_config(tmp_path: Path) -> Path:
    bad = tmp_path / "typo.yaml"
    bad.write_text(CONFIG.read_text().replace("  batch_size: 8", "  batch_sise: 8"))
    return bad


@pytest.mark.parametrize("case, expected", [
    ("missing_config", "no such file"),
    ("typo", "handler.batch_sise: unknown key; did you mean 'batch_size'?"),
    ("missing_checkpoint", "no such directory"),
    ("no_config_json", "no config.json"),
    ("no_tokenizer", "no tokenizer files"),
    ("exists", "exists; pass --force to replace it"),
    ("bad_name", "--name 'bad/name'"),
])
def test_bad_input_is_one_line_exit_2(ckpt: Path, tmp_path: Path, capsys, case: str,
                                      expected: str) -> None:
    config, checkpoint, name, store = CONFIG, ckpt, "tiny", tmp_path / "store"
    if case == "missing_config":
        config = tmp_path / "nope.yaml"
    elif case == "typo":
        config = _typo_config(tmp_path)
    elif case == "missing_checkpoint":
        checkpoint = tmp_path / "nope"
    elif case == "no_config_json":
        (ckpt / "config.json").unlink()
    elif case == "no_tokenizer":
        (ckpt / "tokenizer.json").unlink()
    elif case == "exists":
        pkg.package(CONFIG, ckpt, "tiny", "mar", store)
    elif case == "bad_name":
        name = "bad/name"
    before = tree(tmp_path)
    code, out, err = run(capsys, "package", "--config", str(config), "--checkpoint",
                         str(checkpoint), "--name", name, "--out", str(store))
    assert code == 2
    assert err.startswith("error: ") and expected in err and err.count("\n") == 1, err
    assert tree(tmp_path) == before  # validated before anything was written


def test_staged_fsyncs_the_build_before_rename_and_the_parent_after(tmp_path: Path,
                                                                     monkeypatch) -> None:
    from neuron_cache import store as store_mod

    target = tmp_path / "store" / "model"
    synced: list[tuple[str, bool]] = []  # (path name, target published?)
    real = store_mod._fsync

    def record(path: Path, *, directory: bool = False) -> None:
        synced.append((Path(path).name, target.exists()))
        real(path, directory=directory)

    monkeypatch.setattr(store_mod, "_fsync", record)
    with fileops.staged(target) as built:
        (built / "sub").mkdir(parents=True)
        (built / "sub" / "w.bin").write_bytes(b"w" * 10)
    assert {("w.bin", False), ("sub", False), ("model", False)} <= set(synced)
    assert synced[-1] == ("store", True)
