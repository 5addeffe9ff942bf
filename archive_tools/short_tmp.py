"""A short path for TorchServe's temp directory, whatever the run directory's length.

TorchServe's frontend puts each worker's Unix socket in its java.io.tmpdir
(`.ts.sock.PORT`, which ts/model_service_worker.py binds), and a socket path holds at most
SOCKET_PATH_MAX bytes: under a long --run-dir (or the tests' long $TMPDIR) every worker died
with "OSError: AF_UNIX path too long". `serve` hands TorchServe BASE/inf2s-XXXXXXXX/t, a
symlink to RUN_DIR/tmp in a directory of its own (0700, mkdtemp), so the files stay in the
run directory and only the name is short. The link's path is recorded in the run directory
(ts_logs.TMP_LINK_FILE), where the next start or `stop` removes it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from archive_tools import ts_logs
from handlers.errors import Inf2ServeError

#: bytes of a Unix socket path (sun_path is 108 on Linux, with its NUL)
SOCKET_PATH_MAX = 107
#: where the link goes: /tmp whatever $TMPDIR says, as the socket's length must not depend
#: on a path the user chose; $TMPDIR's directory only where /tmp is not writable
SHORT_TMP_BASES = ("/tmp",)
MAX_PORT = 65535  # the longest port number a worker socket's name can end in


def short_tmp(run_dir: Path) -> Path:
    """BASE/inf2s-XXXXXXXX/t, linked to RUN_DIR/tmp, the earlier link of this run directory
    replaced; a one-line error where even that would make too long a socket path."""
    drop_short_tmp(run_dir)
    tmp = run_dir / "tmp"
    tmp.mkdir(exist_ok=True)
    base = next((b for b in SHORT_TMP_BASES if os.path.isdir(b) and os.access(b, os.W_OK)),
                tempfile.gettempdir())
    link = Path(tempfile.mkdtemp(prefix="inf2s-", dir=base)) / "t"
    link.symlink_to(tmp, target_is_directory=True)
    (run_dir / ts_logs.TMP_LINK_FILE).write_text(str(link))
    socket = f"{link}/.ts.sock.{MAX_PORT}"
    if len(socket.encode()) > SOCKET_PATH_MAX:
        drop_short_tmp(run_dir)
        raise Inf2ServeError(f"TorchServe's worker sockets would be {socket} "
                             f"({len(socket.encode())} bytes), past the {SOCKET_PATH_MAX}-byte "
                             "limit of a Unix socket path; set TMPDIR to a short directory")
    return link


def drop_short_tmp(run_dir: Path) -> None:
    """Remove the short link `short_tmp` made for `run_dir` (its directory holds only it)."""
    record = run_dir / ts_logs.TMP_LINK_FILE
    try:
        link = Path(record.read_text().strip())
    except OSError:
        return
    if link.name == "t" and link.parent.name.startswith("inf2s-") and link.is_symlink():
        link.unlink()
        with contextlib.suppress(OSError):
            link.parent.rmdir()
    record.unlink(missing_ok=True)
