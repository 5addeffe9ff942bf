"""The shared tiny-model server of tests/e2e/shared_server.py: a fixture to get it, and its
stop once the next test is not of its group (the last of the group, or a run without xdist
moving on to another file)."""

from __future__ import annotations

import pytest

from tests.e2e.shared_server import SHARED, in_group


@pytest.fixture
def tiny_server(tiny_checkpoint, tmp_path_factory):
    """The group's running server (started by the first test that asks)."""
    return SHARED.get(tiny_checkpoint, tmp_path_factory)


@pytest.hookimpl(trylast=True)  # after the test's fixtures (a failure's logs are read first)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if in_group(item) and not in_group(nextitem):
        SHARED.stop()
