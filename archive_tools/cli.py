"""Root of the `inf2serve` CLI: it only wires command groups, one module each.

Each command module exposes `register(subparsers)`, which adds its parser(s) and
sets `func` to a function taking the parsed args and returning an exit code.
Errors never end in a traceback unless asked for (`--debug`, or INF2SERVE_DEBUG=1):
our Inf2ServeError hierarchy prints its message (what was seen and the fix, exit 2);
the exceptions bad input raises from below us (a path that is not there, a file that
is not JSON, YAML, a zip or safetensors, a command that failed) print as one line with
the remedy (exit 1); anything else prints its type and message and how to see the
traceback (exit 1). SIGTERM unwinds like Ctrl-C, so the cleanup of a command (e.g. the
work dir of `package`) runs whichever way it is stopped.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import logging
import os
import signal
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

from handlers.errors import Inf2ServeError

#: set to 1 for tracebacks, as `--debug` does (handy where the command line is not ours)
DEBUG_ENV = "INF2SERVE_DEBUG"
#: what to do about an OSError, by its kind (the message names the path)
OS_REMEDIES = (
    (FileNotFoundError, "check the path"),
    (NotADirectoryError, "a directory was expected there; pass a directory"),
    (IsADirectoryError, "a file was expected there; pass a file"),
    (FileExistsError, "something is in the way; pass another path or remove it"),
    (PermissionError, "check the owner and mode of the path"),
)

COMMAND_MODULES = (
    "archive_tools.demo_model",
    "archive_tools.prepare",
    "archive_tools.package",
    "archive_tools.compile_cmd",
    "archive_tools.inspect_cmd",
    "archive_tools.serve_cmd",
    "archive_tools.export",
    "archive_tools.validate_cmd",
    "archive_tools.cache_cmd",
    "archive_tools.bench_cmd",
    "archive_tools.chat_cmd",
)


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM, so `finally` blocks run as for Ctrl-C."""


def _on_sigterm(signum: int, frame) -> None:
    raise Terminated


def _version() -> str:
    try:
        return importlib.metadata.version("inf2serve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inf2serve",
        description="Package and serve Llama-class models with TorchServe (Inferentia2, CPU, GPU).",
    )
    parser.add_argument("--debug", action="store_true",
                        help=f"show tracebacks of errors (or set {DEBUG_ENV}=1)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # command group not shipped in this build
                continue
            raise
        module.register(sub)
    return parser


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def known_error(exc: BaseException) -> str | None:
    """One line with the remedy for the exceptions bad input raises from the libraries we
    call (the modules name the file where they can); None for anything else."""
    if isinstance(exc, json.JSONDecodeError):
        return (f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}; fix the "
                "file or write it again")
    if isinstance(exc, OSError) and exc.filename is not None:
        where = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 else "")
        fix = next((fix for kind, fix in OS_REMEDIES if isinstance(exc, kind)), "")
        return f"{where}: {exc.strerror or exc}" + (f"; {fix}" if fix else "")
    if isinstance(exc, subprocess.CalledProcessError):
        cmd = exc.cmd if isinstance(exc.cmd, (list, tuple)) else str(exc.cmd).split()
        return (f"{Path(str(cmd[0])).name if cmd else 'a command'} exited with status "
                f"{exc.returncode}; its output is above, or run it alone: "
                f"{_one_line(' '.join(map(str, cmd)))}")
    if isinstance(exc, zipfile.BadZipFile):
        return f"not a readable zip archive ({exc}); rebuild it with `inf2serve package`"
    if isinstance(exc, tarfile.TarError):
        return f"not a readable tar archive ({exc}); rebuild it with `inf2serve package`"
    if type(exc).__name__ == "SafetensorError":  # safetensors' Rust error, not importable
        return (f"unreadable safetensors file ({_one_line(str(exc))}); the file is damaged "
                "or cut short: download or save it again")
    try:
        import yaml
    except ImportError:  # pragma: no cover - a dependency
        return None
    if isinstance(exc, yaml.YAMLError):
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        return f"invalid YAML: {getattr(exc, 'problem', None) or _one_line(str(exc))}{at}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format="%(message)s")
    if not debug:  # one line per HTTP poll is noise for a CLI user
        logging.getLogger("httpx").setLevel(logging.WARNING)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return int(args.func(args) or 0)
    except Inf2ServeError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # never a traceback unless asked for (the `hf` CLI's rule)
        if debug:
            raise
        message = known_error(exc)
        if message is None:
            message = (f"{type(exc).__name__}: {_one_line(str(exc))} (rerun with --debug, "
                       f"or {DEBUG_ENV}=1, for the traceback)")
        print(f"error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
