"""fileops.staged: a stopped `package` leaves no work dir; one left by a killed run is removed
by the next run only once its process is gone."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from archive_tools import fileops

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "model_configs" / "tiny-llama-cpu.yaml"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _left_behind(parent: Path, name: str, owner: dict | None) -> Path:
    work = parent / f".{name}.partial-{len(list(parent.iterdir()))}"
    (work / name).mkdir(parents=True)
    if owner is not None:
        (work / fileops.OWNER_FILE).write_text(json.dumps(owner))
    return work


def test_stale_work_dirs_of_dead_processes_are_removed_and_others_kept(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead = _left_behind(tmp_path, "m.mar", {"host": host, "pid": _dead_pid(), "start": None})
    live = _left_behind(tmp_path, "m.mar", {"host": host, "pid": os.getpid(),
                                             "start": fileops._start_time(os.getpid())})
    elsewhere = _left_behind(tmp_path, "m.mar", {"host": host + "-other", "pid": _dead_pid()})
    unknown = _left_behind(tmp_path, "m.mar", None)  # just created, or not ours
    other_name = _left_behind(tmp_path, "n.mar", {"host": host, "pid": _dead_pid()})
    with fileops.staged(tmp_path / "m.mar") as built:
        built.write_bytes(b"new")
    assert not dead.exists()
    assert live.exists() and elsewhere.exists() and unknown.exists() and other_name.exists()
    assert (tmp_path / "m.mar").read_bytes() == b"new"


def test_a_reused_pid_does_not_keep_a_stale_work_dir(tmp_path: Path) -> None:
    """Our own pid, recorded with another start time: the process that wrote it is gone."""
    if fileops._start_time(os.getpid()) is None:
        return  # no /proc: the start time cannot be read, so a live pid is always kept
    host = socket.gethostname()
    reused = _left_behind(tmp_path, "m", {"host": host, "pid": os.getpid(), "start": "1"})
    assert fileops.remove_stale_work_dirs(tmp_path, "m") == [reused]


SLOW_PACKAGE = """
import sys, time
from archive_tools import cli, package

def slow_copy(*args, **kwargs):
    print("copying", flush=True)
    time.sleep(120)

package.copy_path = slow_copy
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_during_package_leaves_no_work_dir(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_PACKAGE, "package", "--config", str(CONFIG), "--checkpoint",
         str(tiny_checkpoint), "--name", "m", "--format", "no-archive", "--out", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.strip() == "copying":
                break
        assert any(out.glob(".m.partial-*")), "the work dir exists while copying"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and "terminated" in err
    assert list(out.iterdir()) == []
