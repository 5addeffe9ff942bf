"""`inf2serve export`: SageMaker and KServe layouts, next steps, atomic output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from archive_tools.cli import main
from archive_tools.jvm_options import FrontendMemory
from archive_tools.package import package

CONFIG = Path(__file__).resolve().parents[2] / "model_configs" / "tiny-llama-cpu.yaml"


@pytest.fixture(scope="module")
def archives(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("store")
    return {fmt: package(CONFIG, tiny_checkpoint, "tiny", fmt, out / fmt)
            for fmt in ("mar", "no-archive")}


def props(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_sagemaker_layout(archives: dict[str, Path], tmp_path: Path, capsys) -> None:
    out = tmp_path / "sm"
    assert main(["export", "--target", "sagemaker", str(archives["no-archive"]), str(out)]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.properties", "serve", "tiny"]
    assert (out / "tiny" / "MAR-INF" / "MANIFEST.json").is_file()
    p = props(out / "config.properties")
    assert p["inference_address"] == "http://0.0.0.0:8080"  # SageMaker's /ping, /invocations
    assert p["model_store"] == "/opt/ml/model" and p["load_models"] == "tiny=tiny"
    assert p["disable_token_authorization"] == "true"
    assert p["management_address"].startswith("http://127.0.0.1")
    assert (out / "serve").stat().st_mode & 0o111
    assert "--models tiny=tiny" in (out / "serve").read_text()
    assert "aws s3 sync" in printed and '"CompressionType": "None"' in printed
    assert p["vmargs"] == FrontendMemory().vmargs()  # the frontend JVM's memory, bounded


def test_kserve_layout(archives: dict[str, Path], tmp_path: Path, capsys) -> None:
    out = tmp_path / "ks"
    assert main(["export", "--target", "kserve", str(archives["mar"]), str(out)]) == 0
    printed = capsys.readouterr().out
    assert (out / "model-store" / "tiny.mar").read_bytes() == archives["mar"].read_bytes()
    p = props(out / "config" / "config.properties")
    assert p["model_store"] == "/mnt/models/model-store"
    snap = json.loads(p["model_snapshot"])
    assert snap["models"]["tiny"]["1.0"]["marName"] == "tiny.mar"
    assert snap["models"]["tiny"]["1.0"]["batchSize"] == 1  # batchSize of model-config.yaml
    assert "kind: InferenceService" in printed and "storageUri: s3://BUCKET/tiny" in printed
    assert p["vmargs"] == FrontendMemory().vmargs()


def test_frontend_heap_option(archives: dict[str, Path], tmp_path: Path) -> None:
    assert main(["export", "--target", "sagemaker", "--frontend-heap-mb", "512",
                 str(archives["mar"]), str(tmp_path / "sm")]) == 0
    assert props(tmp_path / "sm" / "config.properties")["vmargs"] == \
        FrontendMemory(heap_mib=512).vmargs()


def test_link_shares_inodes(archives: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "ks"
    assert main(["export", "--target", "kserve", "--link", str(archives["no-archive"]),
                 str(out)]) == 0
    a = archives["no-archive"] / "model" / "model.safetensors"
    b = out / "model-store" / "tiny" / "model" / "model.safetensors"
    assert a.stat().st_ino == b.stat().st_ino


@pytest.mark.parametrize("case, expected", [
    ("missing", "no such file or directory"),
    ("exists", "exists; pass --force to replace it"),
    ("not_archive", "expected a .mar, a .tar.gz or an archive folder"),
])
def test_bad_input_is_one_line_exit_2(archives: dict[str, Path], tmp_path: Path, capsys,
                                      case: str, expected: str) -> None:
    archive, out = archives["mar"], tmp_path / "out"
    if case == "missing":
        archive = tmp_path / "nope.mar"
    elif case == "exists":
        out.mkdir()
        (out / "keep").write_text("mine")
    elif case == "not_archive":
        archive = tmp_path / "notes.txt"
        archive.write_text("hello")
    code = main(["export", "--target", "kserve", str(archive), str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and expected in err and err.count("\n") == 1
    assert (out / "keep").read_text() == "mine" if case == "exists" else not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_force_replaces(archives: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("old")
    assert main(["export", "--target", "kserve", "--force", str(archives["mar"]), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config", "model-store"]
