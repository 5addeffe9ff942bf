"""Shared fixtures: a tiny demo checkpoint built once per session (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from archive_tools.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "tiny", seed=0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Expose each phase's report on the item, so fixtures can attach server logs on failure."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
