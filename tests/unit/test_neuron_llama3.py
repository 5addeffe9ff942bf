"""The neuron backend serves Llama-3.x: a grouped-query checkpoint with Llama-3.1's RoPE
scaling (rope_theta 500000, rope_type llama3), through `prepare` as a user's 5.x checkpoint
arrives, greedy tokens equal to plain transformers'. transformers-neuronx accepts default and
llama3 scaling only (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/llama/
config.py:L45-L48), which the fake enforces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_checkpoint_compat import LLAMA3_ROPE, _raw_5x_source
from tests.unit.test_neuron_backend import _backend, _greedy, _reference

PROMPT = [1, 50, 60, 70, 80, 90]
pytestmark = pytest.mark.skipif(
    int(__import__("transformers").__version__.split(".")[0]) < 5,
    reason="builds the source checkpoint as transformers 5 saves one; test_checkpoint_compat "
           "shows 4.x reads what prepare writes")


@pytest.fixture(scope="module")
def llama31(tiny_checkpoint: Path, tmp_path_factory) -> Path:
    from archive_tools.prepare import prepare

    root = tmp_path_factory.mktemp("llama31")
    return prepare(_raw_5x_source(root / "src", tiny_checkpoint, LLAMA3_ROPE), root / "ckpt")


@pytest.mark.usefixtures("fake_sdk")
def test_a_llama31_checkpoint_with_gqa_and_llama3_rope_matches_transformers(
        llama31, tmp_path) -> None:
    config = json.loads((llama31 / "config.json").read_text())
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    b = _backend(llama31, tmp_path)
    try:
        assert _greedy(b, 0, PROMPT, 12) == _reference(llama31, PROMPT, 12)
    finally:
        b.close()


@pytest.mark.usefixtures("fake_sdk")
def test_a_rope_scaling_transformers_neuronx_lacks_is_refused(llama31, tmp_path) -> None:
    import shutil

    other = tmp_path / "yarn"
    shutil.copytree(llama31, other)
    config = json.loads((other / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(config.get(key), dict):
            config[key] = {**config[key], "rope_type": "yarn", "type": "yarn"}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Only default and llama3 ropes scaling types"):
        _backend(other, tmp_path)
