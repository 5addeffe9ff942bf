"""Every command answers --help with examples, in-process and through the console script."""

from __future__ import annotations

import argparse
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
    assert "examples:" in out


def _options(parser, prefix: tuple[str, ...] = ()):
    """(command path, action) of every option and argument, subcommands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*prefix, name))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield prefix, action


def test_every_option_says_what_it_is_for() -> None:
    """And what it defaults to, where the default is a value (not off, not none)."""
    from archive_tools.cli import build_parser

    for command, action in _options(build_parser()):
        name = " ".join((*command, *(action.option_strings[-1:] or [action.dest])))
        assert action.help, f"inf2serve {name}: no help text"
        default = action.default
        if action.option_strings and default not in (None, False, [], "", argparse.SUPPRESS):
            assert "default" in action.help, f"inf2serve {name}: help does not say the default"


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
