"""Shared fixtures: a tiny demo checkpoint built once per session (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest


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
