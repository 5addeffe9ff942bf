"""`inf2serve cache ls|verify|prune|pack`: inspect and maintain a Neuron compile cache.

Thin commands over neuron_cache: destructive ones print their plan first and
`--dry-run` stops there.
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime
from pathlib import Path

from archive_tools.fileops import human
from handlers.errors import Inf2ServeError
from neuron_cache.maintain import (
    execute_pack,
    execute_prune,
    parse_age,
    parse_size,
    plan_pack,
    plan_prune,
)
from neuron_cache.store import CacheStore, Entry, read_entry, verify

DEFAULT_DIR = "neuron_cache"


def _store(args: argparse.Namespace) -> CacheStore:
    root = Path(args.cache_dir)
    if root.is_file():
        raise Inf2ServeError(f"--cache-dir {root}: a file, not a directory; point it at a "
                             "compile cache (handler.neuron.cache_dir inside the model "
                             "directory)")
    if not root.is_dir():
        raise Inf2ServeError(f"--cache-dir {root}: no such directory; point it at a compile cache "
                             "(handler.neuron.cache_dir inside the model directory)")
    if (root / "__init__.py").is_file():  # e.g. ./neuron_cache in a clone of this repository
        raise Inf2ServeError(f"--cache-dir {root}: a Python package (inf2serve's own "
                             "neuron_cache library), not a compile cache; pass the model's "
                             "cache, e.g. --cache-dir model_store/llama/neuron_cache")
    return CacheStore(root)


def _row(entry: Entry) -> list[str]:
    i = entry.inputs
    sdk = i.sdk
    when = datetime.fromtimestamp(entry.created).strftime("%Y-%m-%d %H:%M")
    return [entry.name, str(i.tp_degree), str(i.batch_size), str(i.n_positions), i.amp,
            human(entry.size), sdk.get("neuronx-cc", "?"), sdk.get("transformers-neuronx", "?"),
            when]


def _ls(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    store = _store(args)
    entries = store.entries()
    table = Table(title=f"compile cache {store.root}")
    for col in ("entry", "tp", "batch", "n_pos", "amp", "size", "neuronx-cc",
                "transformers-neuronx", "created"):
        table.add_column(col, justify="right" if col in ("tp", "batch", "n_pos", "size") else
                         "left", overflow="fold")
    for entry in entries:
        table.add_row(*_row(entry))
    console = Console()
    if not console.is_terminal:  # piped: do not fold rows at 80 columns
        console = Console(width=200)
    console.print(table)
    unreadable = len(store.entry_paths()) - len(entries)
    console.print(f"{len(entries)} entries, {human(sum(e.size for e in entries))}"
                  + (f"; {unreadable} unreadable (run `inf2serve cache verify`)" if unreadable
                     else ""))
    return 0


def _verify(args: argparse.Namespace) -> int:
    store = _store(args)
    paths = store.entry_paths()
    if args.names:
        known = {p.name for p in paths}
        unknown = [n for n in args.names if n not in known]
        if unknown:
            raise Inf2ServeError(f"no cache entry named {', '.join(unknown)} in {store.root}; "
                                 "see `inf2serve cache ls`")
        paths = [p for p in paths if p.name in args.names]
    bad = 0
    for path in paths:
        try:
            problems = verify(read_entry(path))
        except Inf2ServeError as exc:
            problems = [str(exc)]
        bad += bool(problems)
        print(f"{'ok ' if not problems else 'BAD'} {path.name}")
        for p in problems:
            print(f"    {p}")
    print(f"{len(paths) - bad} ok, {bad} bad")
    if bad:
        print(f"fix: inf2serve cache prune --corrupt --cache-dir {store.root}, then restart the "
              "model to compile again")
    return 1 if bad else 0


def _prune(args: argparse.Namespace) -> int:
    if args.older_than is None and args.max_size is None and not args.corrupt:
        raise Inf2ServeError("prune needs --older-than, --max-size and/or --corrupt")
    store = _store(args)
    plan = plan_prune(store, older_than_s=parse_age(args.older_than) if args.older_than else None,
                      max_size=parse_size(args.max_size) if args.max_size else None,
                      corrupt=args.corrupt, now=time.time())
    entries, temps = len(plan.removals) - plan.temp_count, plan.temp_count
    what = f"{entries} entries" + (f" and {temps} stale temp dirs" if temps else "")
    print(f"plan: remove {what} ({human(plan.freed_bytes)}), keep {human(plan.kept_bytes)}")
    for r in plan.removals:
        print(f"  remove {r.path} ({human(r.size)}): {r.reason}")
    if args.dry_run or not plan.removals:
        return 0
    execute_prune(plan)
    print(f"removed {what}, freed {human(plan.freed_bytes)}")
    return 0


def _pack(args: argparse.Namespace) -> int:
    store = _store(args)
    plan = plan_pack(store, Path(args.archive_dir), args.entry or None)
    for entry, dest in plan.copies:
        print(f"  copy {entry.name} ({human(entry.size)}) -> {dest}")
    for entry, why in plan.skipped:
        print(f"  skip {entry.name}: {why}")
    if args.dry_run or not plan.copies:
        return 0
    execute_pack(plan)
    print(f"packed {len(plan.copies)} entries into {Path(args.archive_dir) / 'neuron_cache'}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cache", help="list, verify, prune and pack Neuron compile-cache entries",
        description="Inspect and maintain a Neuron compile cache (handler.neuron.cache_dir)."
        "\n\nexamples:\n  inf2serve cache ls --cache-dir model_store/llama/neuron_cache\n"
        "  inf2serve cache verify\n  inf2serve cache prune --older-than 30d --max-size 50GB "
        "--dry-run\n  inf2serve cache pack staging/llama-2-7b",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = p.add_subparsers(dest="cache_command", metavar="ACTION")
    groups.required = True

    def add(name: str, help_text: str, func) -> argparse.ArgumentParser:
        q = groups.add_parser(name, help=help_text, description=help_text)
        q.add_argument("--cache-dir", default=DEFAULT_DIR,
                       help=f"compile-cache directory (default: ./{DEFAULT_DIR})")
        q.set_defaults(func=func)
        return q

    add("ls", "list entries with sizes and SDK versions", _ls)
    q = add("verify", "check every file against its sha256; exit 1 if any entry is bad", _verify)
    q.add_argument("names", nargs="*", help="entries to check (default: all)")
    q = add("prune", "remove old, oversized or corrupt entries and stale temp dirs (prints the "
            "plan first)", _prune)
    q.add_argument("--older-than", metavar="AGE", help="e.g. 30d, 12h, 2w")
    q.add_argument("--max-size", metavar="SIZE", help="keep the newest entries within, e.g. 50GB")
    q.add_argument("--corrupt", action="store_true", help="also remove entries failing verify")
    q.add_argument("--dry-run", action="store_true", help="print the plan only")
    q = add("pack", "copy entries into ARCHIVE_DIR/neuron_cache/ (verified, atomic)", _pack)
    q.add_argument("archive_dir", metavar="ARCHIVE_DIR", help="model directory to ship")
    q.add_argument("--entry", action="append", metavar="NAME", help="entry to pack (repeatable; "
                   "default: all)")
    q.add_argument("--dry-run", action="store_true", help="print the plan only")
