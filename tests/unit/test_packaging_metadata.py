"""pyproject.toml builds without setuptools deprecation warnings (the license is an SPDX
expression, PEP 639) and declares what `inf2serve --version` reports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD_METADATA = """
import sys, setuptools.build_meta as b
print(b.prepare_metadata_for_build_wheel(sys.argv[1]))
"""


def test_metadata_builds_without_deprecation_warnings(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for pkg in ("handlers", "archive_tools", "neuron_cache"):
        (src / pkg).mkdir()
        (src / pkg / "__init__.py").write_text("")
    r = subprocess.run([sys.executable, "-W", "always", "-c", BUILD_METADATA, str(tmp_path)],
                       cwd=src, capture_output=True, text=True, check=True)
    assert "Deprecat" not in r.stderr, r.stderr
    metadata = (tmp_path / r.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata
