"""Entries on disk: find by key, verify checksums, publish atomically.

An entry directory appears only through os.rename of a complete temporary
directory, so a reader sees either nothing or a whole entry; its metadata.json
lists the sha256 and size of every artifact so a truncated or altered file is
caught before the runtime ever loads it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from neuron_cache.errors import CacheError
from neuron_cache.key import KeyInputs, differences
from neuron_cache.lock import FileLock

METADATA = "metadata.json"
ARTIFACTS = "artifacts"
FORMAT = 1
LOCKS = ".locks"
TMP_PREFIX = ".tmp-"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_table(root: Path) -> dict[str, dict[str, Any]]:
    """Relative path -> {sha256, size} for every file under root (sorted, POSIX paths)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[p.relative_to(root).as_posix()] = {"sha256": sha256_file(p),
                                                   "size": p.stat().st_size}
    return out


def write_json_atomic(path: Path, data: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fsync(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems cannot fsync a directory; nothing more to do
        if not directory or exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it, new names) durable across power loss."""
    _fsync(path, directory=True)


def fsync_tree(root: Path) -> None:
    """fsync every regular file and directory under `root` (or `root` itself if a file).

    Call before renaming a finished tree into place: a rename is atomic on a crash, but
    after a power loss it may survive while the file data it points at did not.
    """
    if not root.is_dir():
        _fsync(root)
        return
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath, name)
            if path.is_file() and not path.is_symlink():  # a link is covered by its directory
                _fsync(path)
        fsync_dir(Path(dirpath))


@dataclass(frozen=True)
class Entry:
    """One compiled model: its directory and the parsed metadata.json."""

    path: Path
    metadata: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def inputs(self) -> KeyInputs:
        return KeyInputs.from_dict(self.metadata["inputs"])

    @property
    def digest(self) -> str:
        return str(self.metadata.get("key", ""))

    @property
    def artifacts(self) -> Path:
        return self.path / ARTIFACTS

    @property
    def size(self) -> int:
        return sum(int(f.get("size", 0)) for f in self.metadata.get("files", {}).values())

    @property
    def created(self) -> float:
        return float(self.metadata.get("created_unix", 0.0))


def read_entry(path: Path) -> Entry:
    meta_path = path / METADATA
    try:
        data = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CacheError(f"{meta_path}: missing; {path} is not a complete cache entry. Remove "
                         "it (`inf2serve cache prune --corrupt`)") from exc
    except json.JSONDecodeError as exc:
        raise CacheError(f"{meta_path}: not valid JSON ({exc}); remove the entry "
                         "(`inf2serve cache prune --corrupt`)") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT or "inputs" not in data:
        raise CacheError(f"{meta_path}: not an inf2serve cache entry of format {FORMAT}; "
                         "remove the entry (`inf2serve cache prune --corrupt`)")
    return Entry(path, data)


def verify(entry: Entry) -> list[str]:
    """Problems with an entry (empty when sound): missing, truncated, altered or extra files."""
    problems = []
    files = entry.metadata.get("files", {})
    if not files:
        problems.append("metadata lists no files")
    for rel, want in files.items():
        p = entry.path / rel
        if not p.is_file():
            problems.append(f"{rel}: missing")
        elif (size := p.stat().st_size) != want.get("size"):
            problems.append(f"{rel}: {size} bytes, expected {want.get('size')} (truncated?)")
        elif sha256_file(p) != want.get("sha256"):
            problems.append(f"{rel}: sha256 differs from metadata.json (altered or corrupt)")
    if entry.artifacts.is_dir():
        for p in sorted(entry.artifacts.rglob("*")):
            rel = p.relative_to(entry.path).as_posix()
            if p.is_file() and rel not in files:
                problems.append(f"{rel}: not listed in metadata.json")
    return problems


class CacheStore:
    """A cache directory: entries by key, an inter-process lock per key, atomic publish."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def entry_paths(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith(".") and (p / METADATA).exists())

    def entries(self) -> list[Entry]:
        """Readable entries (an unreadable metadata.json is reported by `verify`, not here)."""
        out = []
        for p in self.entry_paths():
            try:
                out.append(read_entry(p))
            except CacheError:
                continue
        return out

    def find(self, inputs: KeyInputs) -> Entry | None:
        path = self.root / inputs.entry_name
        if not (path / METADATA).exists():
            return None
        entry = read_entry(path)
        if entry.digest != inputs.digest:
            raise CacheError(f"{path}: metadata key {entry.digest[:12]} does not match its "
                             f"directory name (expected {inputs.digest[:12]}); remove the entry")
        return entry

    def checked(self, entry: Entry) -> Entry:
        """The entry if every checksum matches; otherwise CacheError naming each problem."""
        problems = verify(entry)
        if problems:
            raise CacheError(
                f"compile-cache entry {entry.path} is corrupt: {'; '.join(problems)}. It will "
                f"not be loaded; remove it (`inf2serve cache prune --corrupt {self.root}`) and "
                "restart to compile again")
        return entry

    def lock(self, inputs: KeyInputs) -> FileLock:
        return self.lock_for(inputs.digest)

    def lock_for(self, digest: str) -> FileLock:
        """The lock of the key with this digest (an entry's metadata `key`)."""
        return FileLock(self.root / LOCKS / f"{digest[:32]}.lock")

    def publish(self, inputs: KeyInputs, write: Callable[[Path], None]) -> Entry:
        """Build an entry in a temp dir (`write(artifacts_dir)`), checksum it, rename into place.

        Call with the key's lock held. If the entry appeared meanwhile (another host on a
        shared file system), the existing one wins and the temp dir is dropped.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{inputs.entry_name}.", dir=self.root))
        try:
            write(tmp / ARTIFACTS)
            if not (tmp / ARTIFACTS).is_dir() or not any((tmp / ARTIFACTS).iterdir()):
                raise CacheError(f"saving the compiled model wrote nothing to {tmp / ARTIFACTS}; "
                                 "expected the NEFF files of model.save()")
            now = time.time()
            files = {f"{ARTIFACTS}/{k}": v for k, v in file_table(tmp / ARTIFACTS).items()}
            write_json_atomic(tmp / METADATA, {
                "format": FORMAT, "key": inputs.digest, "name": inputs.entry_name,
                "created": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
                "created_unix": now, "inputs": inputs.to_dict(), "files": files,
            })
            tmp.chmod(0o755)
            fsync_tree(tmp)  # data on disk before the name that vouches for it
            final = self.root / inputs.entry_name
            try:
                os.rename(tmp, final)
            except OSError:
                if (final / METADATA).exists():
                    return read_entry(final)
                raise
            fsync_dir(self.root)
            return read_entry(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def closest(self, inputs: KeyInputs) -> tuple[Entry, dict] | None:
        """The entry of the same model whose key differs in the fewest inputs, with the diff."""
        best = None
        for e in self.entries():
            try:
                theirs = e.inputs
            except CacheError:
                continue
            if theirs.model_digest != inputs.model_digest:
                continue
            diff = differences(inputs, theirs)
            if diff and (best is None or len(diff) < len(best[1])):
                best = (e, diff)
        return best
