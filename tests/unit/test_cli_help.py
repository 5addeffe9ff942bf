"""Every command answers --help with examples, in-process and through the console script."""

from __future__ import annotations

import subprocess
import sys

import pytest

from archive_tools.cli import main

COMMANDS = ("prepare", "package", "compile", "inspect", "export", "serve", "stop", "demo-model",
            "chat")


@pytest.mark.parametrize("command", COMMANDS)
def test_help(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert f"usage: inf2serve {command}" in out
    if command != "stop":
        assert "examples:" in out


def test_root_help_lists_commands_via_subprocess() -> None:
    r = subprocess.run([sys.executable, "-m", "archive_tools.cli", "--help"], capture_output=True,
                       text=True, check=True)
    for command in COMMANDS:
        assert command in r.stdout


def test_version_via_the_console_script_module() -> None:
    import importlib.metadata

    r = subprocess.run([sys.executable, "-m", "archive_tools.cli", "--version"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == f"inf2serve {importlib.metadata.version('inf2serve')}"
