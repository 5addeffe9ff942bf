"""Prune and pack: a frozen plan first (paths and bytes), then its execution.

Removal renames an entry to a hidden temp name before deleting it, so a worker never
sees half an entry; packing copies into a hidden temp directory in the target and
renames it into place.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from handlers.errors import CacheError, Inf2ServeError
from neuron_cache.store import TMP_PREFIX, CacheStore, Entry, read_entry, verify

_SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
               "GB": 10**9, "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
               "TIB": 2**40}
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """"20GB", "500M", "1.5GiB", "1024" -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise Inf2ServeError(f"size {text!r}: expected a number with an optional unit "
                             "(B, KB, MB, GB, TB, KiB, MiB, GiB), e.g. 20GB")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def parse_age(text: str) -> float:
    """"30d", "12h", "90m", "2w", "45s" -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhdw])\s*", text)
    if not m:
        raise Inf2ServeError(f"age {text!r}: expected a number and a unit s, m, h, d or w, "
                             "e.g. 30d")
    return float(m.group(1)) * _AGE_UNITS[m.group(2)]


@dataclass(frozen=True)
class Removal:
    path: Path
    size: int
    reason: str


@dataclass(frozen=True)
class PrunePlan:
    removals: tuple[Removal, ...]
    kept_bytes: int

    @property
    def freed_bytes(self) -> int:
        return sum(r.size for r in self.removals)


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def plan_prune(store: CacheStore, *, older_than_s: float | None = None,
               max_size: int | None = None, corrupt: bool = False,
               now: float | None = None) -> PrunePlan:
    """Entries to remove: corrupt ones (if asked), older than the age, then oldest-first to fit."""
    now = time.time() if now is None else now
    removals: list[Removal] = []
    kept: list[Entry] = []
    for path in store.entry_paths():
        try:
            entry = read_entry(path)
        except CacheError as exc:
            if corrupt:
                removals.append(Removal(path, _dir_size(path), f"unreadable: {exc}"))
            continue
        problems = verify(entry) if corrupt else []
        if problems:
            removals.append(Removal(path, _dir_size(path), "corrupt: " + "; ".join(problems)))
        elif older_than_s is not None and now - entry.created > older_than_s:
            age_d = (now - entry.created) / 86400
            removals.append(Removal(path, entry.size, f"created {age_d:.1f} days ago"))
        else:
            kept.append(entry)
    total = sum(e.size for e in kept)
    if max_size is not None:
        for entry in sorted(kept, key=lambda e: e.created):
            if total <= max_size:
                break
            removals.append(Removal(entry.path, entry.size,
                                    f"cache is {total / 1e9:.2f} GB, over {max_size / 1e9:.2f} GB"))
            total -= entry.size
    return PrunePlan(tuple(removals), kept_bytes=total)


def remove_entry(path: Path) -> None:
    """Rename out of sight first (atomic), then delete."""
    hidden = path.with_name(f"{TMP_PREFIX}removing.{path.name}.{os.getpid()}")
    os.rename(path, hidden)
    shutil.rmtree(hidden)


def execute_prune(plan: PrunePlan) -> None:
    for removal in plan.removals:
        remove_entry(removal.path)


@dataclass(frozen=True)
class PackPlan:
    copies: tuple[tuple[Entry, Path], ...]  # (entry, destination)
    skipped: tuple[tuple[Entry, str], ...]  # (entry, why)


def plan_pack(store: CacheStore, archive_dir: Path, names: list[str] | None = None) -> PackPlan:
    """Which entries go into `archive_dir/neuron_cache/`; every one is verified first."""
    entries = store.entries()
    if names:
        known = {e.name: e for e in entries}
        missing = [n for n in names if n not in known]
        if missing:
            raise Inf2ServeError(f"no cache entry named {', '.join(missing)} in {store.root}; "
                                 "see `inf2serve cache ls`")
        entries = [known[n] for n in names]
    if not entries:
        raise Inf2ServeError(f"{store.root}: no cache entries to pack; start the model once on "
                             "an Inf2 instance (or `inf2serve compile`) to fill the cache")
    target = Path(archive_dir) / "neuron_cache"
    copies, skipped = [], []
    for entry in entries:
        problems = verify(entry)
        if problems:
            raise CacheError(f"{entry.path} is corrupt ({'; '.join(problems)}); it will not be "
                             "packed. Run `inf2serve cache prune --corrupt` and compile again")
        dest = target / entry.name
        if (dest / "metadata.json").exists():
            skipped.append((entry, "already in the archive"))
        else:
            copies.append((entry, dest))
    return PackPlan(tuple(copies), tuple(skipped))


def execute_pack(plan: PackPlan) -> None:
    for entry, dest in plan.copies:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{entry.name}.", dir=dest.parent))
        try:
            shutil.copytree(entry.path, tmp / "entry")
            os.rename(tmp / "entry", dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
