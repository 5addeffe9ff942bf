"""File operations shared by package, prepare and export.

All three write large trees (checkpoints of 100+ GB) into a model store that a
running TorchServe may be reading, so they share one way of doing it: stream
bytes in chunks with a progress bar, hard-link instead of copying when asked,
and build in a work dir next to the target that is renamed into place only when
complete (an interrupted run leaves the store as it was). A run killed outright
(SIGKILL, power loss) leaves its work dir behind; it records its owner (host, pid,
process start time), so a later run next to the same target removes it once that
process is gone, and never the work dir of a run still going.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from archive_tools import pids
from neuron_cache.store import fsync_dir, fsync_tree

log = logging.getLogger(__name__)
CHUNK = 8 << 20
PROGRESS_MIN_BYTES = 64 << 20  # below this a bar is noise

Advance = Callable[[int], None]


def human(n: float) -> str:
    """Byte counts for people, in powers of 1000 like `ls --si` and `df -H`."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


@contextmanager
def progress_bar(total: int, label: str, enabled: bool = True) -> Iterator[Advance]:
    """A rich bar on stderr for large copies; yields `advance(nbytes)`."""
    if not enabled or total < PROGRESS_MIN_BYTES:
        yield lambda n: None
        return
    from rich import progress as rp
    from rich.console import Console

    console = Console(stderr=True)
    with rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(), rp.DownloadColumn(),
                     rp.TransferSpeedColumn(), rp.TimeRemainingColumn(), console=console,
                     disable=not console.is_terminal) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def copy_stream(fsrc, fdst, advance: Advance) -> None:
    """Chunked copy that reports progress (and is the one place bytes are written)."""
    while chunk := fsrc.read(CHUNK):
        fdst.write(chunk)
        advance(len(chunk))


class CountingReader:
    """File wrapper that reports bytes read, for writers that pull (tarfile.addfile)."""

    def __init__(self, f, advance: Advance) -> None:
        self._f, self._advance = f, advance

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._advance(len(data))
        return data


def copy_path(src: Path, dst: Path, advance: Advance, link: bool = False) -> None:
    """Copy src to dst (or hard-link it when asked and the filesystem allows)."""
    if link:
        try:
            os.link(src, dst)
            advance(src.stat().st_size)
            return
        except OSError:  # other filesystem, or links not allowed: copy instead
            pass
    with open(src, "rb") as fsrc, open(dst, "wb") as fdst:
        copy_stream(fsrc, fdst, advance)
    dst.chmod(0o644)  # readable by the serving user whatever the source's mode


def remove_path(path: Path) -> None:
    """Remove a file, link or folder; a missing path is not an error (cleanup after failure)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def publish(built: Path, target: Path, trash: Path) -> None:
    """Move a complete build onto `target`; the old target is moved into `trash` only now.

    A file replaces a file atomically (os.replace). A folder needs two renames; if
    the second fails the old folder is put back. `trash` lives on the same filesystem
    (the caller's work dir) and is deleted by the caller. Every file and folder of the
    build is fsynced before the rename and the parent after it, so a power loss leaves
    either the old target or the complete new one.
    """
    fsync_tree(built)  # once, here: it covers every writer (copies, zip, tar, safetensors)
    if built.is_file() and not target.is_dir():
        os.replace(built, target)
        fsync_dir(target.parent)
        return
    old = None
    if target.exists() or target.is_symlink():
        old = trash / f"old-{target.name}"
        os.rename(target, old)
    try:
        os.rename(built, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    fsync_dir(target.parent)


OWNER_FILE = ".owner.json"  # inside a work dir: who is building there


def _start_time(pid: int) -> str | None:
    """A process's start time (Linux: clock ticks after boot), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of proc(5), after "pid (comm)"


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def _owner_gone(owner: dict) -> bool:
    """True only when the owner ran on this host and that process no longer exists."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False  # another host (shared filesystem) or unreadable: leave it alone
    pid = owner["pid"]
    if not pids.running(pid):
        return True
    start = _start_time(pid)
    return start is not None and owner.get("start") not in (None, start)  # pid reused


def remove_stale_work_dirs(parent: Path, label: str) -> list[Path]:
    """Remove `.LABEL.partial-*` work dirs in `parent` whose owner process is gone."""
    removed = []
    for work in sorted(parent.glob(f".{label}.partial-*")):
        try:
            owner = json.loads((work / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # just created (owner not yet written) or not ours: keep
        if isinstance(owner, dict) and _owner_gone(owner):
            remove_path(work)
            removed.append(work)
            log.info("removed %s, left by an interrupted run (process %s is gone)",
                     work, owner["pid"])
    return removed


@contextmanager
def staged(target: Path, label: str | None = None) -> Iterator[Path]:
    """Yield the path to build `target` at; publish it onto `target` when the block succeeds.

    The work dir is created next to `target` (same filesystem, so the rename is
    cheap and atomic, and $TMPDIR is never used) and always removed. `label`
    names the work dir (default: target's name). Work dirs of the same label left
    by runs whose process is gone are removed first.
    """
    label = label or target.name
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_work_dirs(target.parent, label)
    work = Path(tempfile.mkdtemp(prefix=f".{label}.partial-", dir=target.parent))
    try:
        (work / OWNER_FILE).write_text(json.dumps(_owner()))
        built = work / target.name
        yield built
        publish(built, target, trash=work)
    finally:
        remove_path(work)
