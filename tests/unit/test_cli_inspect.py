"""`inf2serve inspect`: names files and config values for every format, without extracting."""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pytest

from archive_tools import inspect_cmd
from archive_tools.cli import main
from archive_tools.package import FORMATS, package

CONFIG = Path(__file__).resolve().parents[2] / "model_configs" / "tiny-llama-cpu.yaml"


@pytest.fixture(scope="module")
def store(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("store")
    return {fmt: package(CONFIG, tiny_checkpoint, f"tiny-{fmt}", fmt, out) for fmt in FORMATS}


def _cache_entry(archive: Path) -> None:
    """What neuron_cache writes: <cache>/<entry>/metadata.json (+ artifacts)."""
    entry = archive / "neuron_cache" / "llama-l2-h64-tp2-b8-n512-bf16-0123456789ab"
    (entry / "artifacts").mkdir(parents=True)
    (entry / "artifacts" / "model.neff").write_bytes(b"x" * 10)
    (entry / "metadata.json").write_text(json.dumps({
        "format": 1, "key": "0123456789ab", "created_unix": 0,
        "inputs": {"tp_degree": 2, "batch_size": 8, "n_positions": 512, "amp": "bf16",
                   "sdk": {"neuronx-cc": "2.15.128.0", "transformers-neuronx": "0.12.313"}},
        "files": {"artifacts/model.neff": {"size": 10, "sha256": "0"}}}))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_output_names_files_and_config_values(store: dict[str, Path], fmt: str, capsys,
                                              monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["inspect", str(store[fmt])]) == 0
    out = capsys.readouterr().out
    for text in (f"tiny-{fmt}", "handler_entry.py", "model/model.safetensors", "model-config.yaml",
                 "continuous", "max_length", "2048", "LlamaForCausalLM", "F32", "runtime/ ("):
        assert text in out, text
    # a torch archive: no Neuron settings and no compile-cache section
    assert "tp_degree" not in out and "Neuron compile cache" not in out


def test_file_count_is_the_one_package_prints(tiny_checkpoint: Path, tmp_path: Path,
                                              capsys) -> None:
    """package's plan and inspect both count MAR-INF/MANIFEST.json."""
    assert main(["package", "--config", str(CONFIG), "--checkpoint", str(tiny_checkpoint),
                 "--name", "t", "--out", str(tmp_path)]) == 0
    planned = re.search(r"(\d+) files", capsys.readouterr().out)[1]
    assert main(["inspect", str(tmp_path / "t.mar"), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["files"]) == int(planned)


def test_neuron_archive_shows_its_neuron_settings(tiny_checkpoint: Path, tmp_path: Path,
                                                  capsys, monkeypatch) -> None:
    config = tmp_path / "neuron.yaml"
    config.write_text(CONFIG.read_text().replace("backend: torch", "backend: neuron"))
    archive = package(config, tiny_checkpoint, "n", "no-archive", tmp_path / "store")
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["inspect", str(archive)]) == 0
    out = capsys.readouterr().out
    assert "tp_degree=" in out and "Neuron compile cache: none" in out
    assert "amp=bf16" in out  # handler.dtype auto, resolved for the neuron backend
    assert "speedups" in out and "none" in out
    # the checkpoint's family, with the class the backend builds it with
    assert "family" in out and "llama (llama.model.LlamaForSampling)" in out


def test_a_family_the_backend_cannot_run_says_so(tmp_path: Path, tiny_checkpoint: Path,
                                                  capsys, monkeypatch) -> None:
    from tests.family_checkpoints import build_family_checkpoint

    config = tmp_path / "nxdi.yaml"
    config.write_text(CONFIG.read_text().replace("backend: torch", "backend: nxdi"))
    ckpt = build_family_checkpoint(tmp_path / "qwen", "qwen2", tiny_checkpoint)
    archive = package(config, ckpt, "q", "no-archive", tmp_path / "store")
    (archive / "model-config.yaml").write_text(
        (archive / "model-config.yaml").read_text().replace("backend: nxdi", "backend: neuron"))
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["inspect", str(archive)]) == 0
    out = capsys.readouterr().out
    assert "qwen2 (refused: qwen2 on backend neuron: transformers-neuronx 0.13 has no Qwen2" in out
    assert main(["inspect", "--json", str(archive)]) == 0
    assert '"family": "qwen2 (refused: ' in capsys.readouterr().out


def test_neuron_archive_shows_its_quantization_and_device_sampling(
        tiny_checkpoint: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    import yaml

    data = yaml.safe_load(CONFIG.read_text())
    data["handler"]["backend"] = "neuron"
    data["handler"].setdefault("neuron", {}).update(
        on_device_sampling=True, quantization={"weights": "int8", "kv_cache": "fp8"})
    config = tmp_path / "q.yaml"
    config.write_text(yaml.safe_dump(data))
    archive = package(config, tiny_checkpoint, "q", "no-archive", tmp_path / "store")
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["inspect", str(archive)]) == 0
    out = capsys.readouterr().out
    assert "int8 weights (per_channel), fp8 KV cache, on-device sampling" in out


def test_json_summary(store: dict[str, Path], capsys) -> None:
    assert main(["inspect", str(store["tgz"]), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["manifest"]["model"]["modelName"] == "tiny-tgz"
    assert s["config"]["handler"]["batch_size"] == 8
    ck = s["checkpoint"]
    assert ck["architecture"] == "LlamaForCausalLM" and ck["dtypes"] == {"F32": ck["params"]}
    assert 200_000 < ck["params"] < 300_000  # tiny demo model: ~0.22M parameters


def test_cache_entries_and_sdk_versions(store: dict[str, Path], tmp_path: Path, capsys,
                                        monkeypatch) -> None:
    folder = tmp_path / "tiny"
    folder.mkdir()
    for p in store["no-archive"].rglob("*"):
        dst = folder / p.relative_to(store["no-archive"])
        dst.mkdir(exist_ok=True) if p.is_dir() else dst.write_bytes(p.read_bytes())
    _cache_entry(folder)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "llama-l2-h64-tp2-b8-n512-bf16-0123456789ab" in out
    assert "neuronx-cc 2.15.128.0" in out and "transformers-neuronx 0.12.313" in out


def test_tgz_is_read_in_one_forward_pass(store: dict[str, Path], monkeypatch) -> None:
    """Stream mode ('r|gz') cannot seek back: a second pass or extraction would fail."""
    opened = []
    real_open = tarfile.open

    def spy(*args, **kwargs):
        opened.append(args[1] if len(args) > 1 else kwargs.get("mode"))
        return real_open(*args, **kwargs)

    monkeypatch.setattr(tarfile, "open", spy)
    snap = inspect_cmd.scan(store["tgz"])
    assert opened == ["r|gz"]
    assert "model/model.safetensors" in snap.sizes
    assert snap.files["model/model.safetensors"].startswith(b"{")  # header only


@pytest.mark.parametrize("case, expected", [
    ("missing", "no such file or directory"),
    ("not_archive", "expected a .mar, a .tar.gz or an archive folder"),
    ("no_manifest", "no MAR-INF/MANIFEST.json"),
    ("typo", "handler.batch_sise: unknown key; did you mean 'batch_size'?"),
])
def test_bad_input_is_one_line_exit_2(store: dict[str, Path], tmp_path: Path, capsys, case: str,
                                      expected: str) -> None:
    path = tmp_path / "x"
    if case == "not_archive":
        path.write_text("hello")
    elif case == "no_manifest":
        path.mkdir()
    elif case == "typo":
        path.mkdir()
        (path / "MAR-INF").mkdir()
        (path / "MAR-INF" / "MANIFEST.json").write_text("{}")
        (path / "model-config.yaml").write_text(
            CONFIG.read_text().replace("  batch_size: 8", "  batch_sise: 8"))
    code = main(["inspect", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and expected in err and err.count("\n") == 1
