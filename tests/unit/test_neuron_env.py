"""neuron_env is pure: config + cores in, variables out; apply_neuron_env is the one writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from handlers.backends.neuron_env import apply_neuron_env, format_cores, neuron_env
from handlers.config import parse_config
from handlers.errors import ConfigError


def _cfg(**neuron):
    return parse_config({"handler": {"backend": "neuron", "neuron": neuron}}).handler


def test_env_names_cores_flags_and_cache(tmp_path: Path) -> None:
    cfg = _cfg(tp_degree=2, compiler_flags=["--model-type=transformer", "-O2"])
    env = neuron_env(cfg, [4, 5], tmp_path)
    assert env == {
        "NEURON_CC_FLAGS": "--model-type=transformer -O2",
        "NEURON_RT_NUM_CORES": "2",
        "NEURON_RT_VISIBLE_CORES": "4-5",
        "NEURON_COMPILE_CACHE_URL": str((tmp_path / "neuron_cache" / "neuronx-cc").resolve()),
    }


def test_absolute_cache_dir_wins_over_model_dir(tmp_path: Path) -> None:
    env = neuron_env(_cfg(tp_degree=1, cache_dir=str(tmp_path / "shared")), [0], Path("/models/x"))
    assert env["NEURON_COMPILE_CACHE_URL"] == str(tmp_path / "shared" / "neuronx-cc")
    assert env["NEURON_RT_VISIBLE_CORES"] == "0"


def test_env_is_pure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    neuron_env(_cfg(tp_degree=2), [0, 1], tmp_path)
    import os

    assert "NEURON_RT_VISIBLE_CORES" not in os.environ


def test_flag_with_space_is_rejected_with_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="own list item"):
        neuron_env(_cfg(tp_degree=1, compiler_flags=["--model-type transformer"]), [0], tmp_path)


def test_core_count_must_match_tp_degree(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="3 visible NeuronCores for tp_degree 2"):
        neuron_env(_cfg(tp_degree=2), [0, 1, 2], tmp_path)


def test_format_cores() -> None:
    assert format_cores([3, 2]) == "2-3"
    assert format_cores([7]) == "7"
    assert format_cores([0, 2]) == "0,2"


def test_apply_writes_only_the_given_mapping() -> None:
    environ = {"NEURON_RT_VISIBLE_CORES": "0-23", "OTHER": "x"}
    apply_neuron_env({"NEURON_RT_VISIBLE_CORES": "2-3"}, environ)
    assert environ == {"NEURON_RT_VISIBLE_CORES": "2-3", "OTHER": "x"}
