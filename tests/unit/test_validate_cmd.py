"""`inf2serve validate`: shipped configs pass; impossible placements fail with the numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from archive_tools.cli import main
from archive_tools.validate_cmd import ARCHITECTURES, INSTANCES, Arch, validate
from handlers.config import load_config, parse_config

CONFIGS = Path(__file__).resolve().parents[2] / "model_configs"
SHIPPED = sorted(CONFIGS.glob("llama-2-*/*.yaml"))


def _instance(path: Path) -> str:
    return re.sub(r"-(latency|throughput)\.yaml$", "", path.name)


def test_the_shipped_set_covers_every_size() -> None:
    sizes = {p.parent.name for p in SHIPPED}
    assert sizes >= {"llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-2-7b-chat",
                     "llama-2-13b-chat", "llama-2-70b-chat"}
    assert {_instance(p) for p in SHIPPED} == set(INSTANCES)
    assert {p.name.rsplit("-", 1)[1] for p in SHIPPED} == {"latency.yaml", "throughput.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_config_validates_on_its_instance(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.handler.backend == "neuron" and cfg.frontend.async_communication
    arch = ARCHITECTURES[cfg.handler.neuron.architecture]
    report = validate(cfg, arch, _instance(path))
    assert report.problems == []
    if path.name.endswith("latency.yaml"):
        assert cfg.handler.batch_size == 1
    else:
        assert cfg.handler.batch_size >= 4
    assert main(["validate", str(path), "--instance", _instance(path)]) == 0


def _seventy_b(tmp_path: Path, tp: int) -> Path:
    data = yaml.safe_load((CONFIGS / "llama-2-70b" / "inf2.48xlarge-latency.yaml").read_text())
    data["handler"]["neuron"]["tp_degree"] = tp
    out = tmp_path / "70b.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def test_70b_on_xlarge_is_rejected_with_required_and_available_memory(tmp_path: Path,
                                                                      capsys) -> None:
    assert main(["validate", str(_seventy_b(tmp_path, 2)), "--instance", "inf2.xlarge"]) == 1
    out = capsys.readouterr().out
    assert "needs 69.6 GB per NeuronCore at tp_degree 2" in out
    assert "a core has 14.6 GB available" in out
    assert "needs 139.3 GB in all, but inf2.xlarge has 29.2 GB available" in out
    assert "use tp_degree 16 or more" in out


def test_70b_at_tp16_needs_more_cores_than_xlarge(tmp_path: Path, capsys) -> None:
    assert main(["validate", str(_seventy_b(tmp_path, 16)), "--instance", "inf2.xlarge"]) == 1
    assert "1 x tp_degree 16 = 16 cores, but inf2.xlarge has 2" in capsys.readouterr().out


def _cfg(**neuron):
    return parse_config({"deviceType": "neuron",
                         "handler": {"backend": "neuron", "max_length": 2048,
                                     "neuron": neuron}})


def test_heads_must_divide_by_tp() -> None:
    report = validate(_cfg(tp_degree=3), ARCHITECTURES["llama-2-7b"], None)
    assert any("32 attention heads are not divisible" in p for p in report.problems)


def test_kv_heads_must_shard_or_replicate() -> None:
    arch = ARCHITECTURES["llama-2-70b"]  # 64 heads, 8 K/V heads
    assert validate(_cfg(tp_degree=16), arch, None).problems == []  # replicated 2x
    assert validate(_cfg(tp_degree=32, gqa="shard-over-heads"), arch, None).problems == []
    arch6 = Arch(80, 8192, 64, 6, 32000, 28672, 4096)
    assert any("6 K/V heads" in p for p in validate(_cfg(tp_degree=16), arch6, None).problems)


def test_unknown_architecture_names_the_closest(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"handler": {"backend": "neuron",
                                                "neuron": {"architecture": "llama2-7b"}}}))
    assert main(["validate", str(path)]) == 2
    assert "did you mean 'llama-2-7b'" in capsys.readouterr().err


def test_unknown_key_names_the_closest(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"handler": {"backend": "neuron",
                                                "neuron": {"tp_degre": 2}}}))
    assert main(["validate", str(path)]) == 2
    assert "did you mean 'tp_degree'" in capsys.readouterr().err


def test_checkpoint_config_json_is_used(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2, "hidden_size": 64, '
                                          '"num_attention_heads": 4, "num_key_value_heads": 2, '
                                          '"vocab_size": 1024, "intermediate_size": 172, '
                                          '"max_position_embeddings": 512}')
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"handler": {"backend": "neuron", "max_length": 512,
                                                "max_new_tokens_limit": 256,
                                                "neuron": {"tp_degree": 2}}}))
    assert main(["validate", str(path), "--checkpoint", str(tmp_path),
                 "--instance", "inf2.xlarge"]) == 0
    path.write_text(yaml.safe_dump({"handler": {"backend": "neuron", "max_length": 1024,
                                                "neuron": {"tp_degree": 2}}}))
    assert main(["validate", str(path), "--checkpoint", str(tmp_path)]) == 1
    assert "exceeds the model's max_position_embeddings 512" in capsys.readouterr().out
