"""Shipped nxdi configs validate on their instance; `validate` applies the NxD Inference rules."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from archive_tools.cli import main
from archive_tools.validate_cmd import ARCHITECTURES, INSTANCES, validate
from handlers.config import load_config
from handlers.errors import ConfigError

SHIPPED = sorted((Path(__file__).resolve().parents[2] / "model_configs" / "nxdi").glob("*/*.yaml"))


def _instance(path: Path) -> str:
    return re.match(r"inf2\.\d*xlarge", path.name).group(0)


def test_the_set_covers_the_models_and_instances() -> None:
    assert {p.parent.name for p in SHIPPED} == {
        "llama-2-7b", "llama-2-13b", "llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b-instruct",
        "qwen2.5-32b-instruct", "qwen3-8b", "mistral-7b-instruct-v0.3", "mixtral-8x7b-instruct"}
    assert {_instance(p) for p in SHIPPED} == set(INSTANCES)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_config_validates_on_its_instance(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.handler.backend == "nxdi" and cfg.handler.batching == "continuous"
    report = validate(cfg, ARCHITECTURES[cfg.handler.neuron.architecture], _instance(path))
    assert report.problems == []
    assert (cfg.handler.batch_size == 1) == path.name.endswith(("latency.yaml",
                                                               "speculation.yaml"))
    assert main(["validate", str(path), "--instance", _instance(path)]) == 0


def test_70b_padding_and_replication_are_warned_with_numbers(capsys) -> None:
    path = next(p for p in SHIPPED if p.parent.name == "llama-3.1-70b"
                and p.name.startswith("inf2.48xlarge"))
    assert main(["validate", str(path), "--instance", "inf2.48xlarge"]) == 0
    out = capsys.readouterr().out
    assert "64 attention heads are padded to 72 (8 zero heads" in out
    assert "8 K/V heads are replicated to 24 (one per NeuronCore, 3x the KV cache)" in out


def _variant(tmp_path: Path, handler: dict) -> Path:
    path = next(p for p in SHIPPED if p.name == "inf2.24xlarge-latency.yaml"
                and p.parent.name == "llama-2-7b")
    data = yaml.safe_load(path.read_text())
    for key, value in handler.items():
        target = data["handler"]
        if isinstance(value, dict):
            target[key].update(value)
        else:
            target[key] = value
    out = tmp_path / "x.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


@pytest.mark.parametrize("handler,expected", [
    ({"neuron": {"tp_degree": 16}}, "tp_degree 16: the Neuron runtime on Inf2 supports"),
    ({"neuron": {"tp_degree": 24}, "batch_size": 1}, "tp_degree 24 needs 24 NeuronCores"),
    ({"neuron": {"tp_degree": 1}, "batch_size": 8}, "device memory (estimate)"),
])
def test_impossible_placements_fail(tmp_path, capsys, handler, expected) -> None:
    assert main(["validate", str(_variant(tmp_path, handler)), "--instance",
                 "inf2.24xlarge"]) == 1
    assert expected in capsys.readouterr().out


@pytest.mark.parametrize("handler,match", [
    ({"nxdi": {"token_generation_buckets": [1024, 8192]}}, "token_generation_buckets"),
    ({"neuron": {"context_length_estimate": [256, 8192]}}, "context_length_estimate"),
    ({"nxdi": {"max_context_length": 1024}}, "exceed handler.nxdi.max_context_length 1024"),
    ({"batching": "micro"}, "continuous batching only"),
])
def test_nxdi_config_rules(tmp_path, handler, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(_variant(tmp_path, handler))


def test_host_memory_is_estimated_and_warned(capsys) -> None:
    path = next(p for p in SHIPPED if p.name == "inf2.xlarge-latency.yaml")
    assert main(["validate", str(path), "--instance", "inf2.xlarge"]) == 0
    out = capsys.readouterr().out
    assert "host memory (estimate)" in out and "inf2.xlarge has 16 GiB" in out
