"""`inf2serve compile`: clear one-line failures here (no Neuron), and the call it makes there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from archive_tools import compile_cmd
from archive_tools.cli import main
from archive_tools.package import package

CONFIG = Path(__file__).resolve().parents[2] / "model_configs" / "tiny-llama-cpu.yaml"


@pytest.fixture(scope="module")
def neuron_archive(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("neuron")
    cfg = tmp / "neuron.yaml"
    cfg.write_text(CONFIG.read_text().replace("backend: torch", "backend: neuron")
                   .replace("deviceType: cpu", "deviceType: neuron"))
    return package(cfg, tiny_checkpoint, "tiny-neuron", "no-archive", tmp / "store")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_without_neuron_says_so_with_remedy(neuron_archive: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(compile_cmd, "neuron_available", lambda *backend: False)
    code, _, err = run(capsys, "compile", str(neuron_archive))
    assert code == 2 and err.count("\n") == 1
    assert "transformers-neuronx is not installed" in err
    # AWS's instruction (archive/transformers-neuronx/setup/index.txt:6), not our unpublished name
    assert "pip install transformers-neuronx --extra-index-url=" in err and "inf2serve[" not in err
    assert not (neuron_archive / "neuron_cache").exists()


def test_this_machine_has_no_neuron(neuron_archive: Path, capsys) -> None:
    """Real detection (importlib.util.find_spec), not the monkeypatched one above."""
    if compile_cmd.neuron_available():
        pytest.skip("transformers_neuronx is installed here")
    code, _, err = run(capsys, "compile", str(neuron_archive))
    assert code == 2 and "transformers-neuronx is not installed" in err


def test_dry_run_needs_no_sdk(neuron_archive: Path, capsys) -> None:
    code, out, _ = run(capsys, "compile", str(neuron_archive), "--dry-run")
    assert code == 0 and "tp_degree=2" in out and "neuron_cache" in out


def test_with_neuron_goes_through_the_backend(neuron_archive: Path, capsys, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(compile_cmd, "neuron_available", lambda *backend: True)
    monkeypatch.setattr(compile_cmd, "compile_archive",
                        lambda archive, config: calls.append((archive, config)) or "compiled x")
    code, out, _ = run(capsys, "compile", str(neuron_archive))
    assert code == 0 and "compiled x" in out
    assert calls[0][0] == neuron_archive and calls[0][1].handler.backend == "neuron"


@pytest.mark.parametrize("case, expected", [
    ("missing", "no such file or directory"),
    ("file", "needs a folder; repackage with `inf2serve package --format no-archive`"),
    ("no_manifest", "no MAR-INF/MANIFEST.json"),
    ("torch", "handler.backend is 'torch'"),
])
def test_bad_input_is_one_line_exit_2(tiny_checkpoint: Path, tmp_path: Path, capsys, case: str,
                                      expected: str) -> None:
    path = tmp_path / "x"
    if case == "file":
        path = package(CONFIG, tiny_checkpoint, "tiny", "mar", tmp_path / "store")
    elif case == "no_manifest":
        path.mkdir()
    elif case == "torch":
        path = package(CONFIG, tiny_checkpoint, "tiny", "no-archive", tmp_path / "store")
    code, _, err = run(capsys, "compile", str(path))
    assert code == 2 and err.startswith("error: ") and expected in err and err.count("\n") == 1


NXDI = Path(__file__).resolve().parents[1] / "fakes" / "nxdi"


def test_nxdi_archive_compiles_once_then_cache_and_inspect_see_it(
        tiny_checkpoint: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """On the NxD Inference fake: compile, compile again (cached), cache ls/verify, inspect."""
    import sys

    monkeypatch.syspath_prepend(str(NXDI))
    monkeypatch.setenv("INF2SERVE_FAKE_NEURON_DEVICE_DIR", str(tmp_path / "device"))
    for var in ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "NEURON_CC_FLAGS",
                "NEURON_COMPILE_CACHE_URL"):
        monkeypatch.setenv(var, "")
    cfg = tmp_path / "nxdi.yaml"
    cfg.write_text(CONFIG.read_text().replace("backend: torch", "backend: nxdi")
                   .replace("deviceType: cpu", "deviceType: neuron")
                   + f"  dtype: float32\n  neuron:\n    cores_per_instance: 2\n"
                     f"    core_lock_dir: {tmp_path / 'locks'}\n")
    archive = package(cfg, tiny_checkpoint, "tiny-nxdi", "no-archive", tmp_path / "store")
    try:
        code, out, err = run(capsys, "compile", str(archive))
        assert code == 0, err
        assert "(nxdi)" in out and "compiled nxdi-llama-" in out
        code, out, _ = run(capsys, "compile", str(archive))
        assert code == 0 and "already cached: nxdi-llama-" in out
        cache = str(archive / "neuron_cache")
        code, out, _ = run(capsys, "cache", "ls", "--cache-dir", cache)
        assert code == 0 and "nxdi-llama-" in out
        code, out, _ = run(capsys, "cache", "verify", "--cache-dir", cache)
        assert code == 0
        code, out, _ = run(capsys, "inspect", str(archive), "--json")
        (entry,) = json.loads(out)["cache"]
        assert code == 0 and entry["entry"].startswith("nxdi-llama-")
        assert entry["sdk"]["neuronx-distributed-inference"] == "0.8.16251"
    finally:
        for name in [m for m in sys.modules if m.startswith("neuronx_distributed_inference")]:
            del sys.modules[name]
