"""Ready configs for Qwen2.5, Qwen3, Mistral and Mixtral, and the int8 ones on nxdi: each fits
its instance per `validate`, and the bf16 variant that does not fit is refused with numbers.

The architectures are the models' public config.json values (handlers/families.py);
their parameter counts are the published ones, so the memory arithmetic starts right: tied
embeddings counted once, Qwen2's q/k/v bias, Qwen3's q/k norms, Mixtral's eight experts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from archive_tools.cli import main
from archive_tools.nxdi_sizing import nxdi_heads
from archive_tools.validate_cmd import ARCHITECTURES, arch_from_config_json, validate
from handlers.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "model_configs"
FAMILY_MODELS = ("qwen2.5-7b-instruct", "qwen2.5-32b-instruct", "qwen3-8b",
                 "mistral-7b-instruct-v0.3", "mixtral-8x7b-instruct")
SHIPPED = sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent.name in FAMILY_MODELS
                 or (p.parent.parent.name == "nxdi" and "int8" in p.name))


def _instance(path: Path) -> str:
    return re.match(r"inf2\.\d*xlarge", path.name).group(0)


def _id(path: Path) -> str:
    return str(path.relative_to(CONFIGS))


def test_the_set_covers_every_family_and_the_nxdi_int8_configs() -> None:
    names = {_id(p) for p in SHIPPED}
    for model in FAMILY_MODELS:
        assert any(f"nxdi/{model}/" in n for n in names), model
    assert {"mistral-7b-instruct-v0.3", "mixtral-8x7b-instruct"} <= {
        p.parent.name for p in SHIPPED if p.parent.parent == CONFIGS}  # transformers-neuronx
    assert not any(p.parent.parent == CONFIGS and p.parent.name.startswith("qwen")
                   for p in SHIPPED)  # no transformers-neuronx class for Qwen
    assert {"nxdi/llama-3.1-8b/inf2.48xlarge-int8-throughput.yaml",
            "nxdi/qwen2.5-32b-instruct/inf2.24xlarge-int8-throughput.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=_id)
def test_every_family_config_validates_on_its_instance(path: Path, capsys) -> None:
    cfg = load_config(path)
    report = validate(cfg, ARCHITECTURES[cfg.handler.neuron.architecture], _instance(path))
    assert report.problems == []
    assert (cfg.handler.batch_size == 1) == path.name.endswith("latency.yaml")
    assert cfg.handler.neuron.quantization.weights == ("int8" if "int8" in path.name else "")
    assert main(["validate", str(path), "--instance", _instance(path)]) == 0
    assert f"ok on {_instance(path)}" in capsys.readouterr().out


@pytest.mark.parametrize("name,params,active", [
    # published totals: Qwen2.5-7B 7.61B, Qwen2.5-32B 32.8B, Qwen3-8B 8.2B, Mistral-7B 7.25B,
    # Mixtral-8x7B 46.7B of which 12.9B active per token
    ("qwen2.5-7b-instruct", 7_615_616_512, None),
    ("qwen2.5-32b-instruct", 32_763_876_352, None),
    ("qwen3-8b", 8_190_735_360, None),
    ("mistral-7b-instruct-v0.3", 7_248_023_552, None),
    ("mixtral-8x7b-instruct", 46_702_792_704, 12_879_925_248),
])
def test_parameter_counts_are_the_published_ones(name: str, params: int, active) -> None:
    arch = ARCHITECTURES[name]
    assert arch.params == params
    assert arch.active_params == (active or params)


def test_a_checkpoint_config_json_gives_the_family_fields() -> None:
    qwen3 = arch_from_config_json({
        "model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 1024,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "tie_word_embeddings": True, "sliding_window": None, "use_sliding_window": False})
    assert (qwen3.head_dim, qwen3.tied_embeddings, qwen3.qk_norm) == (128, True, True)
    assert qwen3.params == 596_049_920  # Qwen3-0.6B: 0.6B with the embedding counted once
    qwen2 = arch_from_config_json({  # Qwen2.5-0.5B-Instruct: the window is switched off
        "model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "intermediate_size": 4864, "tie_word_embeddings": True, "sliding_window": 32768,
        "use_sliding_window": False})
    assert (qwen2.sliding_window, qwen2.qkv_bias) == (0, True)
    assert qwen2.params == 494_032_768  # Qwen2.5-0.5B: 0.49B
    mistral01 = arch_from_config_json({
        "model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "intermediate_size": 14336, "sliding_window": 4096})
    assert mistral01.sliding_window == 4096
    mixtral = arch_from_config_json({
        "model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2})
    assert mixtral.params == ARCHITECTURES["mixtral-8x7b-instruct"].params


def test_qwen2_5_7b_heads_at_tp_8_and_24_on_nxdi() -> None:
    """28 heads and 4 K/V heads: padded to a multiple of tp, K/V heads replicated to tp
    (aws-neuron/neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/
    modules/attention/gqa.py:L89-L127, as nxdi_sizing mirrors it)."""
    arch = ARCHITECTURES["qwen2.5-7b-instruct"]
    assert [(h.heads_padded, h.kv_heads_used) for h in
            (nxdi_heads(arch, t) for t in (4, 8, 24))] == [(28, 4), (32, 8), (48, 24)]


def _variant(tmp_path: Path, path: Path, **changes) -> Path:
    data = yaml.safe_load(path.read_text())
    workers = changes.pop("workers", None)
    if workers is not None:
        data["minWorkers"] = data["maxWorkers"] = workers
    data["handler"]["neuron"].update(changes)  # quantization {} = handler.dtype (bf16)
    out = tmp_path / path.name
    out.write_text(yaml.safe_dump(data))
    return out


@pytest.mark.parametrize("config,changes,instance,expected", [
    # Qwen2.5-32B in bf16 at the int8 config's tp 4
    ("nxdi/qwen2.5-32b-instruct/inf2.24xlarge-int8-throughput.yaml", {"quantization": {}},
     "inf2.24xlarge", "qwen2.5-32b-instruct needs 20.7 GB per NeuronCore at tp_degree 4 "
     "(weights 16.4 GB at bf16 + KV cache 4.3 GB at bf16 for batch 8 x 8192 positions)"),
    # ... and on one Inferentia2 chip even in int8
    ("nxdi/qwen2.5-32b-instruct/inf2.24xlarge-int8-throughput.yaml",
     {"tp_degree": 2, "workers": 1}, "inf2.8xlarge",
     "qwen2.5-32b-instruct needs 25.8 GB per NeuronCore at tp_degree 2 (weights 17.2 GB at "
     "int8 + KV cache 8.6 GB at bf16"),  # the weights alone are over a core's 14.6 GB
    # Mixtral-8x7B in bf16 on half the cores, with either SDK
    ("nxdi/mixtral-8x7b-instruct/inf2.24xlarge-latency.yaml", {"tp_degree": 4},
     "inf2.24xlarge", "mixtral-8x7b-instruct needs 23.6 GB per NeuronCore at tp_degree 4 "
     "(weights 23.4 GB at bf16 + KV cache 0.3 GB"),
    ("mixtral-8x7b-instruct/inf2.24xlarge-latency.yaml", {"tp_degree": 4},
     "inf2.24xlarge", "mixtral-8x7b-instruct needs 23.6 GB per NeuronCore at tp_degree 4 "
     "(weights 23.3 GB at bf16 + KV cache 0.3 GB"),
    # Llama-3.1-70B in bf16 where the int8 config runs
    ("nxdi/llama-3.1-70b/inf2.24xlarge-int8-latency.yaml", {"quantization": {}},
     "inf2.24xlarge", "llama-3.1-70b needs 17.8 GB per NeuronCore at tp_degree 8 "
     "(weights 17.6 GB at bf16"),
])
def test_the_bf16_variant_that_does_not_fit_is_refused_with_numbers(
        tmp_path, capsys, config, changes, instance, expected) -> None:
    path = _variant(tmp_path, CONFIGS / config, **changes)
    assert main(["validate", str(path), "--instance", instance]) == 1
    out = capsys.readouterr().out
    assert expected in out, out
    assert "a core has 14.6 GB available" in out
    assert out.rstrip().endswith("1 problem(s)")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "mixtral"])
def test_the_arithmetic_counts_what_transformers_builds(family_checkpoint, arch: str) -> None:
    """Each family's config.json read as validate reads a checkpoint's gives the parameter
    count of the model transformers builds from it (tied weights once)."""
    from transformers import AutoModelForCausalLM

    ckpt = family_checkpoint(arch)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    built = sum(p.numel() for p in model.parameters())
    config = json.loads((ckpt / "config.json").read_text())
    assert arch_from_config_json(config).params == built
