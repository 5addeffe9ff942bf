"""The Neuron install profile: the toolkit and its archives leave the SDK's packages alone.

On an Inf2 host the Neuron SDK owns torch (one per torch-neuronx build), transformers 4.x
(what transformers-neuronx runs on), tokenizers and the neuron packages. `pip install
inf2serve` there must install none of them (checked with pip's own resolver against an
environment holding an SDK stack), and a neuron archive's requirements.txt, which
TorchServe installs with `pip install -U -t MODEL_DIR`, must install nothing at all.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from archive_tools.package import package

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).resolve().parents[2]
NEURON_CONFIG = ROOT / "model_configs" / "llama-2-7b" / "inf2.xlarge-latency.yaml"
# an SDK 2.21 stack (torch-neuronx 2.5.1.x, transformers-neuronx 0.13.322, neuronx-cc 2.16)
SDK_STACK = {"torch": "2.5.1", "transformers": "4.48.3", "tokenizers": "0.21.4",
             "torch-neuronx": "2.5.1.2.4.0", "transformers-neuronx": "0.13.322",
             "neuronx-cc": "2.16.345.0", "libneuronxla": "2.1.681.0"}
# the ends of what the Neuron SDKs ship: torch-neuronx 2.1-2.8, transformers 4.36-4.57
SDK_VERSIONS = [{"torch": "2.1.2", "transformers": "4.36.2", "tokenizers": "0.15.2"},
                {"torch": "2.8.0", "transformers": "4.57.6", "tokenizers": "0.22.2"}]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("sdk", SDK_VERSIONS, ids=lambda s: f"transformers-{s['transformers']}")
def test_base_and_neuron_requirements_admit_the_sdk_versions(sdk: dict) -> None:
    reqs = [Requirement(r) for r in _project()["dependencies"]
            + _project()["optional-dependencies"]["neuron"]]
    for req in reqs:
        if _norm(req.name) in sdk:
            assert req.specifier.contains(sdk[_norm(req.name)]), str(req)


@pytest.mark.parametrize("transformers", ["4.48.3", "4.57.6"])
def test_the_nxdi_extra_admits_the_sdk_transformers_and_keeps_4(transformers: str) -> None:
    """NxD Inference 0.3.5591 (SDK 2.23) pins transformers 4.48, 0.8.16251 (SDK 2.28) 4.57."""
    specs = [Requirement(r) for r in _project()["optional-dependencies"]["nxdi"]]
    pin = next(r for r in specs if r.name == "transformers")
    assert pin.specifier.contains(transformers) and not pin.specifier.contains("5.0.0")
    assert {_norm(r.name) for r in specs} >= {"neuronx-distributed-inference", "torch-neuronx"}


def test_the_neuron_extra_keeps_transformers_4() -> None:
    specs = [Requirement(r) for r in _project()["optional-dependencies"]["neuron"]]
    transformers = next(r for r in specs if r.name == "transformers")
    assert not transformers.specifier.contains("5.0.0")  # transformers-neuronx needs 4.x


def test_the_cpu_extra_pins_what_make_install_installed() -> None:
    pins = {Requirement(r).name: Requirement(r) for r in _project()["optional-dependencies"]["cpu"]}
    assert set(pins) == {"torch", "transformers", "tokenizers"}
    for name, req in pins.items():
        installed = metadata.version(name).split("+")[0]  # torch's local "+cpu" is not pinned
        assert str(req.specifier) == f"=={installed}"


def _fake_dist(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


@pytest.fixture(scope="module")
def sdk_env(tmp_path_factory) -> tuple[Path, Path]:
    """(python of a venv holding SDK_STACK and the other base dependencies, inf2serve wheel dir)."""
    root = tmp_path_factory.mktemp("sdk-env")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True,
                               text=True).stdout.strip())
    for name, version in SDK_STACK.items():
        _fake_dist(site, name, version)
    for req in map(Requirement, _project()["dependencies"]):  # the rest at their floor or pin
        if _norm(req.name) not in SDK_STACK:
            _fake_dist(site, req.name, next(iter(req.specifier)).version)
    wheels = root / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(ROOT)], check=True,
                   capture_output=True)
    return python, wheels


def _dry_run(sdk_env: tuple[Path, Path], target: str, *report: str) -> subprocess.CompletedProcess:
    python, wheels = sdk_env
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no index or find-links but the toolkit's wheel
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                           "--dry-run", "--no-index", "--find-links", str(wheels), *report,
                           target], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("target", ["inf2serve", "inf2serve[neuron]"])
def test_pip_installs_only_the_toolkit_beside_the_sdk(sdk_env, target: str) -> None:
    r = _dry_run(sdk_env, target, "--quiet", "--report", "-")
    assert r.returncode == 0, r.stderr
    assert [i["metadata"]["name"] for i in json.loads(r.stdout)["install"]] == ["inf2serve"]


def test_the_tested_pins_would_replace_the_sdk(sdk_env) -> None:
    """The control: pip sees the SDK stack, so the exact pins of [cpu] cannot be met offline."""
    r = _dry_run(sdk_env, "inf2serve[cpu]")
    assert r.returncode != 0
    assert re.search(r"(torch==2\.13\.0|transformers==5\.23\.0)", r.stdout + r.stderr)


def test_a_neuron_archive_requirements_install_nothing(tiny_checkpoint: Path,
                                                       tmp_path: Path) -> None:
    import yaml

    # a shipped Inf2 config on the tiny checkpoint: within its 512 positions, as package
    # now refuses max_length above max_position_embeddings
    data = yaml.safe_load(NEURON_CONFIG.read_text())
    data["handler"].update(max_length=512, max_new_tokens_limit=256)
    data["handler"]["neuron"]["context_length_estimate"] = [128, 512]
    config = tmp_path / "neuron.yaml"
    config.write_text(yaml.safe_dump(data))
    target = package(config, tiny_checkpoint, "llama-neuron", "no-archive", tmp_path / "store")
    text = (target / "requirements.txt").read_text()
    assert [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")] == []
    # what TorchServe runs with TS_INSTALL_PY_DEP_PER_MODEL=true (offline here)
    deps = tmp_path / "model-dir"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-U", "--no-index", "-t",
                        str(deps), "-r", str(target / "requirements.txt")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not deps.exists() or list(deps.iterdir()) == []


def test_a_torch_archive_still_pins_the_transformers_it_was_built_with(tiny_checkpoint: Path,
                                                                      tmp_path: Path) -> None:
    target = package(ROOT / "model_configs" / "tiny-llama-cpu.yaml", tiny_checkpoint, "tiny",
                     "no-archive", tmp_path / "store")
    reqs = [Requirement(ln) for ln in (target / "requirements.txt").read_text().splitlines()
            if ln and not ln.startswith("#")]
    pins = {r.name: str(r.specifier) for r in reqs}
    assert pins["transformers"] == f"=={metadata.version('transformers')}"


def test_the_torch_backend_on_transformers_4_names_the_key(monkeypatch, tmp_path: Path) -> None:
    """A Neuron SDK stack has transformers 4.x, where the torch backend cannot import."""
    from handlers.backends import load_backend
    from handlers.config import parse_config
    from handlers.errors import ConfigError

    monkeypatch.setitem(sys.modules, "handlers.backends.torch_backend", None)  # ImportError
    with pytest.raises(ConfigError, match=r"handler\.backend: 'torch' needs transformers>=5"):
        load_backend(parse_config({"handler": {}}).handler, tmp_path)
