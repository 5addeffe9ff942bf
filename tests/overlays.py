"""transformers 4.x overlays: this interpreter with the Neuron SDKs' transformers.

`make test` builds each overlay with `pip install --no-deps --target DIR transformers==4.x
tokenizers huggingface_hub requests ...` and lists them in $INF2SERVE_TF4_OVERLAYS
(os.pathsep-separated). First on PYTHONPATH, a directory replaces the 5.x transformers,
tokenizers and huggingface_hub of the venv; torch and everything else stay the venv's.
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

import pytest

ENV = "INF2SERVE_TF4_OVERLAYS"
NONE_REASON = f"no transformers 4.x overlays: `make test` builds them and sets ${ENV}"
#: $INF2SERVE_TF4_OVERLAYS as the suite was started with it, kept here by tests/conftest.py,
#: which empties that variable so that `validate` loads under each 4.x only in the tests that
#: ask for it (`validate_under_overlays`); in the environment, so xdist's workers inherit it
SUITE_ENV = "INF2SERVE_TEST_TF4_OVERLAYS"


def listed() -> str:
    """The suite's overlays, os.pathsep-separated."""
    return os.environ.get(SUITE_ENV, os.environ.get(ENV, ""))


def overlays() -> list[Path]:
    """The overlay directories $INF2SERVE_TF4_OVERLAYS names (each must hold transformers)."""
    dirs = [Path(p) for p in listed().split(os.pathsep) if p]
    for d in dirs:
        if not (d / "transformers").is_dir():
            raise RuntimeError(f"${ENV}: {d} holds no transformers package; run `make overlays`")
    return dirs


def transformers_version(overlay: Path) -> str:
    """The version of the transformers distribution installed in `overlay`."""
    dists = [d for d in metadata.distributions(path=[str(overlay)])
             if re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() == "transformers"]
    return dists[0].version


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def overlay_env(overlay: Path) -> dict[str, str]:
    """os.environ with `overlay` alone on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": str(overlay)}


def overlay_params() -> list:
    """pytest params, one per overlay (id: its transformers version); skipped when none."""
    found = overlays()
    if not found:
        return [pytest.param(None, id="no-overlay", marks=pytest.mark.skip(reason=NONE_REASON))]
    return [pytest.param(d, id=f"transformers-{transformers_version(d)}") for d in found]
