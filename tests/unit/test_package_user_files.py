"""`package --handler/--extra-files/--requirements-file/--runtime`, as torch-model-archiver
reads them: the same layout in every format, inputs checked with errors naming the flag."""

from __future__ import annotations

import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from archive_tools import package as pkg
from archive_tools.cli import main
from tests.unit.test_cli_package import CONFIG, bytes_written, make_checkpoint

HANDLER = '''
from handlers.torchserve.generation_handler import GenerationHandler


class Base(GenerationHandler):
    pass


class MyHandler(Base):
    """Two classes of ours in the file: the one no other extends is the handler."""
'''


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "ckpt")


@pytest.fixture
def user(tmp_path: Path) -> dict[str, Path]:
    d = tmp_path / "user"
    (d / "assets" / "sub").mkdir(parents=True)
    (d / "my_handler.py").write_text(HANDLER)
    (d / "prompts.json").write_text("{}")
    (d / "assets" / "vocab.txt").write_text("x")
    (d / "assets" / "sub" / "deep.txt").write_text("y")
    (d / "r.txt").write_text("einops==0.8.0\n")
    return {"dir": d, "handler": d / "my_handler.py", "extra": d / "prompts.json",
            "folder": d / "assets", "req": d / "r.txt"}


def members(target: Path) -> dict[str, bytes]:
    """name -> bytes of every archive member, whatever the format."""
    if target.is_dir():
        return {p.relative_to(target).as_posix(): p.read_bytes()
                for p in target.rglob("*") if p.is_file()}
    if target.name.endswith(".tar.gz"):
        with tarfile.open(target) as tar:
            return {m.name.split("/", 1)[1]: tar.extractfile(m).read()
                    for m in tar.getmembers() if m.isfile()}
    with zipfile.ZipFile(target) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


@pytest.mark.parametrize("fmt", list(pkg.FORMATS))
def test_user_files_land_at_the_top_in_every_format(ckpt: Path, user: dict, tmp_path: Path,
                                                    fmt: str) -> None:
    target = pkg.package(CONFIG, ckpt, "tiny", fmt, tmp_path / "store", version="2.5",
                         handler=user["handler"], runtime="python3",
                         extra_files=f"{user['extra']}, {user['folder']}",
                         requirements_file=user["req"])
    files = members(target)
    # a file at the top; a folder's contents at the top (model_packaging_utils.py:201-211)
    assert files["my_handler.py"] == user["handler"].read_bytes()
    assert files["prompts.json"] == b"{}" and files["vocab.txt"] == b"x"
    assert files["sub/deep.txt"] == b"y"
    assert b"USER_HANDLER = 'my_handler'" in files["handler_entry.py"]
    requirements = files["requirements.txt"].decode()
    assert requirements.index("transformers==") < requirements.index("einops==0.8.0")
    manifest = json.loads(files["MAR-INF/MANIFEST.json"])
    assert manifest["runtime"] == "python3"
    assert manifest["model"]["modelVersion"] == "2.5"
    assert manifest["model"]["handler"] == "handler_entry.py"
    assert manifest["model"]["requirementsFile"] == "requirements.txt"


def test_without_flags_the_stock_entry_file_is_copied(ckpt: Path, tmp_path: Path) -> None:
    target = pkg.package(CONFIG, ckpt, "tiny", "no-archive", tmp_path / "store")
    assert (target / "handler_entry.py").read_bytes() == pkg.ENTRY_FILE.read_bytes()
    assert pkg.USER_HANDLER_LINE in pkg.ENTRY_FILE.read_text()


def test_extra_files_are_written_once(ckpt: Path, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (8 << 20))
    before = bytes_written()
    pkg.package(CONFIG, ckpt, "tiny", "mar", tmp_path / "store", extra_files=str(big))
    assert bytes_written() - before < (8 << 20) * 1.5


def test_wildcards_expand(ckpt: Path, user: dict, tmp_path: Path) -> None:
    target = pkg.package(CONFIG, ckpt, "tiny", "no-archive", tmp_path / "store",
                         extra_files=str(user["dir"] / "*.json"))
    assert (target / "prompts.json").is_file() and not (target / "r.txt").exists()


def test_entry_class_is_the_users_subclass(ckpt: Path, user: dict, tmp_path: Path,
                                           monkeypatch) -> None:
    """The written handler_entry.py, imported as TorchServe imports it, serves MyHandler."""
    import importlib
    import inspect
    import sys

    target = pkg.package(CONFIG, ckpt, "tiny", "no-archive", tmp_path / "store",
                         handler=user["handler"])
    monkeypatch.syspath_prepend(str(target))
    for name in ("handler_entry", "my_handler"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module("handler_entry")
    # ts/model_loader.py _get_class_entry_point: exactly one class defined in the module
    ours = [c for _, c in inspect.getmembers(module, inspect.isclass)
            if c.__module__ == module.__name__]
    assert [c.__name__ for c in ours] == ["Inf2ServeHandler"]
    assert [c.__name__ for c in ours[0].__mro__[1:3]] == ["MyHandler", "Base"]


@pytest.mark.parametrize("case, expected", [
    ("handler_missing", "--handler"),
    ("handler_function", "--handler"),
    ("handler_not_ours", "expected one class subclassing GenerationHandler, found none"),
    ("handler_two", "found 2 (A, B)"),
    ("handler_syntax", "not valid Python"),
    ("handler_name", "the module name 'handlers' is the toolkit's own"),
    ("extra_missing", "--extra-files"),
    ("extra_wildcard", "the wildcard matched nothing"),
    ("extra_collision", "would replace the archive's own 'model-config.yaml'"),
    ("extra_collision_ckpt", "would replace the archive's own 'model'"),
    ("extra_twice", "'prompts.json' is also given as"),
    ("extra_is_handler", "'my_handler.py' is also given as"),
    ("req_missing", "--requirements-file"),
    ("runtime", "--runtime"),
])
def test_bad_input_names_the_flag(ckpt: Path, user: dict, tmp_path: Path, capsys, case: str,
                                  expected: str) -> None:
    d = user["dir"]
    args = ["package", "--config", str(CONFIG), "--checkpoint", str(ckpt), "--name", "tiny",
            "--out", str(tmp_path / "store")]
    bad = d / "bad.py"
    sources = {"handler_not_ours": "class H:\n    pass\n",
               "handler_two": "from handlers.torchserve.generation_handler import "
                              "GenerationHandler\n"
                              "class A(GenerationHandler): pass\n"
                              "class B(GenerationHandler): pass\n",
               "handler_syntax": "class (:\n"}
    if case in sources:
        bad.write_text(sources[case])
        args += ["--handler", str(bad)]
    elif case == "handler_missing":
        args += ["--handler", str(d / "nope.py")]
    elif case == "handler_function":
        args += ["--handler", f"{user['handler']}:handle"]
    elif case == "handler_name":
        (d / "handlers.py").write_text(HANDLER)
        args += ["--handler", str(d / "handlers.py")]
    elif case == "extra_missing":
        args += ["--extra-files", f"{user['extra']},{d / 'nope.txt'}"]
    elif case == "extra_wildcard":
        args += ["--extra-files", str(d / "*.nope")]
    elif case == "extra_collision":
        (d / "model-config.yaml").write_text("x")
        args += ["--extra-files", str(d / "model-config.yaml")]
    elif case == "extra_collision_ckpt":
        (d / "model").mkdir()
        (d / "model" / "x").write_text("x")
        args += ["--extra-files", str(d)]
    elif case == "extra_twice":
        (d / "assets" / "prompts.json").write_text("{}")
        args += ["--extra-files", f"{user['extra']},{user['folder']}"]
    elif case == "extra_is_handler":
        args += ["--handler", str(user["handler"]), "--extra-files", str(user["handler"])]
    elif case == "req_missing":
        args += ["--requirements-file", str(d / "nope.txt")]
    elif case == "runtime":
        with pytest.raises(pkg.Inf2ServeError, match=expected):
            pkg.plan_package(CONFIG, ckpt, "tiny", "mar", tmp_path / "store", runtime="LSP")
        return
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "store").exists()
