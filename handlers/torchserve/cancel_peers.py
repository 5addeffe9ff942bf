"""The workers of one model find the one that runs a request, to cancel it there.

The OpenAI router names each request it forwards and, when its client leaves, POSTs that
name to the model's inf2serve/cancel (docs/design.md, "Abandoned requests"). TorchServe
puts that POST in the model's one job queue, so with several workers it lands on any of
them, and only the worker running the request knows its name. So the workers of a model
answer one another: each listens on a Unix socket in a directory of the model's own, and a
worker that gets a cancel for a name it does not know asks the others, which cancel it if
it is theirs. Nothing is sent per request -- only a cancel that missed costs a message to
each other worker -- and the router stays unaware of workers (TorchServe picks them, and
tells nobody which).

The directory is /tmp/inf2serve-<uid>/<key>/, mode 0700, one socket per worker named by
its pid; `key` is a digest of the model's directory, which TorchServe shares among the
workers of one model (one archive, extracted once) and nobody else. Short on purpose: a
socket's path must fit 107 bytes (sun_path), so no part comes from a user's paths. A
socket left by a worker that died refuses connections and is removed by the next asker.
Each worker answers from a thread of its own, so a busy event loop does not delay it
(the engine's `cancel` is thread-safe); a peer that does not answer within PEER_TIMEOUT_S
counts as not having it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import hashlib
import logging
import os
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

#: how long a peer may take to answer before it counts as not running the request: a
#: stopped or wedged peer delays only this cancel's answer, while on 2 shared cores at
#: load 20+ a live peer once took over 1 s (it cancelled, then found the asker gone)
PEER_TIMEOUT_S = 5.0
#: the longest client id read (the router's are 32 hex digits)
MAX_ID = 256
#: sun_path's size on Linux, less its terminating NUL
MAX_SOCKET_PATH = 107


class CancelPeers:
    """This worker's socket among its model's workers, and its questions to the others."""

    def __init__(self, path: Path, sock: socket.socket, cancel: Callable[[str], bool]) -> None:
        self.path = path
        self._sock = sock
        self._cancel = cancel
        threading.Thread(target=self._answer, name="inf2serve-cancel-peers",
                         daemon=True).start()
        atexit.register(self.close)

    @classmethod
    def open(cls, model_dir: Path, cancel: Callable[[str], bool], base: Path = Path("/tmp"),
             name: str | None = None) -> CancelPeers | None:
        """Listen beside the model's other workers (as `name`, default this process's id);
        `cancel(client_id)` answers them, from a thread of its own. None (cancels then
        reach only the worker TorchServe gives them to) where that cannot be done safely."""
        key = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16]
        directory = base / f"inf2serve-{os.getuid()}" / key
        path = directory / f"{name or os.getpid()}.sock"
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            logger.warning("cancels reach only the worker that receives them: the socket "
                           "path %s is longer than %d bytes", path, MAX_SOCKET_PATH)
            return None
        try:
            for d in (directory.parent, directory):
                _private_directory(d)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a worker before this one had this pid
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(path))
            sock.listen(64)
        except OSError as exc:
            logger.warning("cancels reach only the worker that receives them: %s", exc)
            return None
        return cls(path, sock, cancel)

    async def ask(self, client_id: str) -> bool:
        """Whether another worker of the model ran the request named `client_id` and has
        cancelled it."""
        try:
            peers = [p for p in self.path.parent.iterdir()
                     if p.suffix == ".sock" and p != self.path]
        except OSError:
            return False
        pending = {asyncio.ensure_future(self._ask_one(p, client_id)) for p in peers}
        try:
            for done in asyncio.as_completed(pending):
                if await done:
                    return True
            return False
        finally:
            for task in pending:
                task.cancel()

    async def _ask_one(self, path: Path, client_id: str) -> bool:
        writer = None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(path)), PEER_TIMEOUT_S)
            writer.write(client_id.encode()[:MAX_ID] + b"\n")
            answer = await asyncio.wait_for(reader.readline(), PEER_TIMEOUT_S)
            return answer == b"1\n"
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(OSError):
                path.unlink()  # nobody listens there: a worker that died
            return False
        except (OSError, asyncio.TimeoutError) as exc:
            logger.warning("the worker at %s did not answer a cancel: %s", path, exc)
            return False
        finally:
            if writer is not None:
                writer.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()
        self._sock.close()

    def _answer(self) -> None:
        """This worker's answers, one connection at a time (each takes microseconds)."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with conn:
                try:
                    conn.settimeout(PEER_TIMEOUT_S)
                    client_id = _read_line(conn)
                    found = client_id is not None and self._cancel(client_id)
                    conn.sendall(b"1\n" if found else b"0\n")
                    if found:
                        logger.info("cancelled the request of client %s, which another "
                                    "worker was asked to cancel", client_id)
                except OSError as exc:
                    logger.warning("answering another worker's cancel failed: %s", exc)
                except Exception:  # this thread must outlive anything a cancel can do
                    logger.exception("cancelling for another worker failed")


def _read_line(conn: socket.socket) -> str | None:
    data = b""
    while not data.endswith(b"\n") and len(data) <= MAX_ID:
        chunk = conn.recv(MAX_ID + 1)
        if not chunk:
            return None
        data += chunk
    return data[:-1].decode("utf-8", "replace") if data.endswith(b"\n") else None


def _private_directory(path: Path) -> None:
    """`path` exists as a directory of this user's that nobody else may enter: another
    user's, or a link, could take the sockets over."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = path.lstat()
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
            or info.st_mode & 0o077):
        raise OSError(errno.EPERM, f"{path} is not a private directory of this user")
