"""`inf2serve demo-model` keeps a demo model already there, so the quick start runs after
`make demo`, and still refuses to overwrite anything else."""

from __future__ import annotations

import shutil
from pathlib import Path

from archive_tools.cli import main


def test_existing_demo_model_is_kept(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "tiny-llama"
    shutil.copytree(tiny_checkpoint, out)
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["demo-model", str(out)]) == 0
    assert "already holds the tiny demo model; kept" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == before


def test_other_contents_are_refused(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "tiny-llama"
    shutil.copytree(tiny_checkpoint, out)
    assert main(["demo-model", str(out), "--size", "bench"]) == 2  # another size
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main(["demo-model", str(tmp_path / "other")]) == 2
    assert "pass --force to replace it" in capsys.readouterr().err
