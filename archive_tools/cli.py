"""Root of the `inf2serve` CLI: it only wires command groups, one module each.

Each command module exposes `register(subparsers)`, which adds its parser(s) and
sets `func` to a function taking the parsed args and returning an exit code.
Known errors (our Inf2ServeError hierarchy) print as one line with the remedy;
the traceback only with --debug. SIGTERM unwinds like Ctrl-C, so the cleanup of a
command (e.g. the work dir of `package`) runs whichever way it is stopped.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import signal
import sys
import threading

from handlers.errors import Inf2ServeError

COMMAND_MODULES = (
    "archive_tools.demo_model",
    "archive_tools.prepare",
    "archive_tools.package",
    "archive_tools.compile_cmd",
    "archive_tools.inspect_cmd",
    "archive_tools.serve",
    "archive_tools.export",
    "archive_tools.validate_cmd",
    "archive_tools.cache_cmd",
    "archive_tools.bench_cmd",
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
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(message)s")
    if not args.debug:  # one line per HTTP poll is noise for a CLI user
        logging.getLogger("httpx").setLevel(logging.WARNING)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return int(args.func(args) or 0)
    except Inf2ServeError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
