"""Prune and pack: a frozen plan first (paths and bytes), then its execution.

Removal renames an entry to a hidden temp name before deleting it, so a worker never
sees half an entry; packing copies into a hidden temp directory in the target and
renames it into place. Hidden `.tmp-*` directories that a killed compile, pack or
removal left in the cache root are pruned once nothing has touched them for an hour.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from neuron_cache.errors import CacheError, Inf2ServeError
from neuron_cache.store import (
    TMP_PREFIX,
    CacheStore,
    Entry,
    fsync_dir,
    fsync_tree,
    read_entry,
    verify,
)

_SIZE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
               "GB": 10**9, "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
               "TIB": 2**40}
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
#: a `.tmp-*` directory untouched this long is left over (a live publish writes to it)
STALE_TMP_S = 3600.0


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
    temp: bool = False  # a leftover `.tmp-*` directory, not an entry


@dataclass(frozen=True)
class PrunePlan:
    removals: tuple[Removal, ...]
    kept_bytes: int

    @property
    def freed_bytes(self) -> int:
        return sum(r.size for r in self.removals)

    @property
    def temp_count(self) -> int:
        return sum(r.temp for r in self.removals)


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _stale_temps(store: CacheStore, now: float, stale_s: float) -> list[Removal]:
    """`.tmp-*` paths in the cache root whose newest mtime, anywhere inside, is stale_s old."""
    if not store.root.is_dir():
        return []
    out = []
    for path in sorted(store.root.iterdir()):
        if not path.name.startswith(TMP_PREFIX):
            continue
        try:
            inside = list(path.rglob("*")) if path.is_dir() and not path.is_symlink() else []
            stats = [path.lstat(), *(p.lstat() for p in inside)]
        except FileNotFoundError:  # finished or removed while we looked
            continue
        idle = now - max(st.st_mtime for st in stats)
        if idle > stale_s:
            size = sum(st.st_size for st in stats if stat.S_ISREG(st.st_mode))
            out.append(Removal(path, size, f"temporary directory untouched for {idle / 3600:.1f} "
                               "h (left by an interrupted compile, pack or prune)", temp=True))
    return out


def plan_prune(store: CacheStore, *, older_than_s: float | None = None,
               max_size: int | None = None, corrupt: bool = False,
               now: float | None = None, stale_tmp_s: float = STALE_TMP_S) -> PrunePlan:
    """What to remove: stale temp dirs, corrupt entries (if asked), entries older than the age,
    then the oldest entries until the rest fit in max_size."""
    now = time.time() if now is None else now
    removals = _stale_temps(store, now, stale_tmp_s)
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


def _key_lock(path: Path):
    """The lock a worker holds while it compiles, publishes or re-checks this entry's key."""
    try:
        digest = read_entry(path).digest
    except CacheError:  # unreadable metadata: no key to lock, and no worker will load it
        return nullcontext()
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        return nullcontext()
    return CacheStore(path.parent).lock_for(digest)


def remove_entry(path: Path) -> None:
    """Under the key's lock, rename out of sight (atomic); then delete, lock released."""
    hidden = path.with_name(f"{TMP_PREFIX}removing.{path.name}.{os.getpid()}")
    with _key_lock(path):
        os.rename(path, hidden)
    shutil.rmtree(hidden)


def remove_temp(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def execute_prune(plan: PrunePlan) -> None:
    for removal in plan.removals:
        (remove_temp if removal.temp else remove_entry)(removal.path)


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
            fsync_tree(tmp / "entry")
            os.rename(tmp / "entry", dest)
            fsync_dir(dest.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
