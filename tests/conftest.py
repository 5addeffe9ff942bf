"""Shared fixtures: a tiny demo checkpoint built once per session (no download).

Every process the tests start (pytest-xdist workers, TorchServe's Python workers, engine
processes) runs torch on one intra-op thread. The suite runs several processes per core, and
with torch's default of a thread per core their OpenMP threads spin against each other: at a
load of ~20 on 2 cores one forward of the tiny Llama took 1.24 s on 2 threads and 54 ms on 1.
Set in the environment, so children inherit it; a value already set is kept.

`validate` of a Neuron backend's checkpoint loads it under each transformers 4.x overlay
(archive_tools/transformers4.py), a subprocess importing its transformers apiece: 10 s on 2
cores, and most of each family-matrix row. The suite checks that load where it is the
subject (tests/unit/test_transformers4.py, through `validate_under_overlays`), and everywhere
else `validate` checks by rule only: the variable is emptied here, for every child as well.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import overlays

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault(overlays.SUITE_ENV, os.environ.get(overlays.ENV, ""))
os.environ[overlays.ENV] = ""


@pytest.fixture
def validate_under_overlays(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """`validate` in this test loads under the overlays the suite was given (none: [])."""
    monkeypatch.setenv(overlays.ENV, overlays.listed())
    return overlays.overlays()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from archive_tools.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "tiny", seed=0)


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """`family_checkpoint("qwen3")`: a tiny `demo-model --arch` checkpoint of that family,
    built once per session on first use (read it, never change it)."""
    from archive_tools.demo_model import build_demo_model

    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            root = tmp_path_factory.mktemp(f"ckpt-{arch}")
            built[arch] = build_demo_model(root / f"tiny-{arch}", "tiny", seed=0, arch=arch)
        return built[arch]

    return get


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Expose each phase's report on the item, so fixtures can attach server logs on failure."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
