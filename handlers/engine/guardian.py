"""The guardian: a small process that answers for a TorchServe worker that died.

A TorchServe 0.12 frontend notices a worker's death only when the worker's socket closes,
and then answers none of the requests it had sent there: they stay in its in-flight map
(pytorch/serve@v0.12.0:frontend/server/src/main/java/org/pytorch/serve/wlm/
AsyncWorkerThread.java:129-153, :187-200). So someone else must hold a duplicate of that
socket and answer on it. The engine process did, from its main thread; but a step that
holds the GIL (a wedged Neuron runtime, a long C call) blocked it there, and the frontend
saw the worker go seconds later, or never. The guardian runs no model code and shares no
GIL with anything that does: a child of the worker started with the standard library
alone, it holds the duplicate socket and each request's last words, and reads the
worker's notes until its pipe closes -- which only the worker's death does -- then says
the farewell at once.

The worker's notes (handlers/engine/client.py, `Guardian`): each request's `LastWords`
before anything of it can reach the frontend; a request's first text, and its end, as
they reach the worker (before the worker can write them: a request is out of the book
before its last message can go out, and marked spoken before its first chunk can); a
request the worker cancels; and, when the worker stops, to stand down.

A worker killed inside a write to the frontend leaves a torn message on the socket; bytes
written after it would be read as the rest of it. The board says so (`writes` !=
`written`, handlers/engine/board.py), and the guardian then closes the socket without a
word: the frontend errors what it can, and nothing it reads is corrupt.

Standard library only (started as `python -I -S`): tens of milliseconds and a few MB.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

#: how long the last words may take to write: a frontend that reads nothing gets no more
SAY_TIMEOUT_S = 2.0

#: the guardian's entry point, run with -I -S (no site, no environment): only the
#: standard library and this package's board and guardian modules are imported
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from handlers.engine.guardian import main; main(sys.argv[2:])")


class Words(NamedTuple):
    """A request's last words as the guardian keeps them (handlers/engine/messages.LastWords
    without the import)."""

    request_id: str
    silent: bytes
    spoken: bytes | None


class Farewell:
    """What is said on TorchServe's socket when the worker dies.

    Once the worker is gone (nobody else writes), each request still in the book gets its
    last words -- the in-band error if some of its text reached the worker, else the whole
    500 -- then the worker's closing message errors every other request in the frontend's
    map (one the worker was still preparing, or whose end it had not yet written), and the
    socket closes: the frontend restarts the worker. A request leaves the book when its
    last event reaches the worker or the worker cancels it, before the worker can write
    its end: the frontend fails on an answer for a request it no longer has
    (AsyncBatchAggregator.java:92-97), and the closing message covers those.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closing = b""
        self._torn: Callable[[], bool] = lambda: False
        self._words: dict[str, Any] = {}
        self._spoken: set[str] = set()  # requests some of whose text reached the worker

    def arm(self, sock: socket.socket, closing: bytes,
            torn: Callable[[], bool] | None = None) -> None:
        """`torn()`, asked once the worker is gone: did it die inside a write?"""
        with self._lock:
            old, self._sock, self._closing = self._sock, sock, closing
            self._torn = torn or (lambda: False)
        if old is not None:
            old.close()

    def disarm(self) -> None:
        """The worker stops on purpose: nothing to say, the socket closes."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def expect(self, words: Any) -> None:
        """`words`: request_id, silent, spoken (LastWords or `Words`)."""
        with self._lock:
            if self._sock is not None:
                self._words[words.request_id] = words

    def holds_requests(self) -> bool:
        return self._sock is not None and bool(self._words)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._words.pop(request_id, None)
            self._spoken.discard(request_id)

    def sent(self, texts: Iterable[tuple[str, str, int]],
             finals: Iterable[tuple[str, Any]]) -> None:
        """Events reached the worker: their text may be on the frontend's wire, and ended
        requests are the worker's to end."""
        with self._lock:
            words, spoken = self._words, self._spoken
            for request_id, text, _ in texts:
                if text and request_id in words:
                    spoken.add(request_id)
            for request_id, _ in finals:
                if words.pop(request_id, None) is not None:
                    spoken.discard(request_id)

    def say(self) -> None:
        """The worker is gone: every request's last words, the closing message, the close."""
        with self._lock:
            sock, self._sock = self._sock, None
            if sock is None:
                return
            if self._torn():
                logger.error("guardian %d: the TorchServe worker died inside a write to the "
                             "frontend; closing its socket without a word after that torn "
                             "message (the frontend errors what it can)", os.getpid())
                _close(sock)
                return
            spoken = self._spoken
            answers = [w.spoken if w.spoken is not None and rid in spoken else w.silent
                       for rid, w in self._words.items()]
            try:
                sock.settimeout(SAY_TIMEOUT_S)
                sock.sendall(b"".join([*answers, self._closing]))
            except OSError as exc:  # the frontend went away too (a shutdown): nobody to tell
                logger.error("guardian %d: writing to TorchServe failed: %s", os.getpid(), exc)
                return
            finally:
                _close(sock)
        logger.error("guardian %d: the TorchServe worker died; answered its %d request(s) "
                     "with a 500 and the frontend's others with its closing message, then "
                     "closed its socket", os.getpid(), len(answers))


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)  # the frontend sees the worker go now
    except OSError:
        pass
    sock.close()


class Guardian:
    """The worker's handle on its guardian process: `start` it with TorchServe's socket,
    then note each request's words and what reaches the worker. Safe from any thread;
    a guardian that died is logged once and ignored (the worker serves on, unguarded)."""

    def __init__(self, proc: subprocess.Popen, conn: Connection) -> None:
        self.proc = proc
        self._conn = conn
        self._lock = threading.Lock()
        self._lost = False

    @classmethod
    def start(cls, sock: socket.socket, closing: bytes, board: Any) -> Guardian:
        """A guardian holding a duplicate of `sock` (and of `board`'s fd); `closing`: the
        message that errors every request the frontend still has on this worker."""
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])
        fds = (theirs.fileno(), sock.fileno(), board.fd)
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOT, root,
                                     *map(str, fds)], pass_fds=fds, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        guardian = cls(proc, Connection(ours.detach()))
        guardian._send(("arm", closing))
        return guardian

    def expect(self, words: Any) -> None:
        self._send(("words", words.request_id, words.silent, words.spoken))

    def sent(self, texts: list[tuple[str, str, int]], finals: list[tuple[str, None]]) -> None:
        self._send(("sent", texts, finals))

    def forget(self, request_id: str) -> None:
        self._send(("forget", request_id))

    def stand_down(self, timeout_s: float = 2) -> None:
        """The worker stops: the guardian closes its socket quietly and exits."""
        self._send(("stop",))
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _send(self, note: tuple) -> None:
        with self._lock:
            if self._lost:
                return
            try:
                self._conn.send(note)
            except OSError as exc:
                self._lost = True
                logger.error("the guardian %d is gone (%s): if this worker dies, nobody "
                             "answers its requests", self.proc.pid, exc)


def main(argv: list[str]) -> None:
    """The guardian process: notes until the worker's pipe closes, then the farewell."""
    logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.INFO)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the worker's to handle
    from handlers.engine.board import Board

    notes_fd, frontend_fd, board_fd = map(int, argv)
    notes = Connection(notes_fd)
    board = Board(board_fd)
    farewell = Farewell()
    frontend = socket.socket(fileno=frontend_fd)
    while True:
        try:
            note = notes.recv()
        except (EOFError, OSError):  # the worker died: nobody else writes now
            break
        kind = note[0]
        if kind == "words":
            farewell.expect(Words(*note[1:]))
        elif kind == "sent":
            farewell.sent(note[1], note[2])
        elif kind == "forget":
            farewell.forget(note[1])
        elif kind == "arm":
            farewell.arm(frontend, note[1], board.writing)
        elif kind == "stop":
            farewell.disarm()
            return
    farewell.say()
