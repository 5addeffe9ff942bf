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

Nor does it leave the frontend to restart the worker, which TorchServe 0.12 does badly
under traffic (docs/design.md): where the worker noted every message it read and every
answer's last write (`GuardedWrites`), the guardian answers exactly the requests left
unanswered and starts a worker that takes the socket over (`take_over`, handlers/
torchserve/takeover.py), after a wait that grows in a crash loop (`backoff_s`). It closes
the socket only where it cannot know the socket's state, where the new worker does not
load, or where handler.worker_takeover is false.

Standard library only (started as `python -I -S`): tens of milliseconds and a few MB.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

from handlers.engine.board import Board, CountedWrites

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

    Exact (`arm(..., exact=...)`, the worker's own WorkerService): the worker also notes
    every request it reads off the socket (`read`) and, before the write that ends a
    request's answer, that write's number on the board (`final`). Then the book is every
    request read whose last write the board does not show as written: each is answered on
    its own (a request read but never booked -- an error, a cancel, an answer made without
    the engine -- with the whole 500 of `exact`), no closing message is needed, and the
    requests the frontend sent since stay unread on the socket for a worker that takes it
    over (`takeover`). Where the worker died inside a message from the frontend (the
    board's `reading`), the socket's next bytes are not a message's start and the
    requests in that message were never noted: the farewell is the closing one, as before.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closing = b""
        self._torn: Callable[[], bool] = lambda: False
        self._words: dict[str, Any] = {}
        self._spoken: set[str] = set()  # requests some of whose text reached the worker
        #: exact: the whole 500 of a request read but never booked, as its message's tails
        self._exact: tuple[bytes, ...] | None = None
        self._board: Any = None
        self._read: dict[str, None] = {}  # exact: requests read, not yet known answered
        self._noted: tuple[bytes, int] = (b"", 0)  # the last message noted whole: head, length
        self._finals: deque[tuple[int, list[str]]] = deque()  # (write number, requests)

    def arm(self, sock: socket.socket, closing: bytes,
            torn: Callable[[], bool] | None = None, exact: tuple[bytes, ...] | None = None,
            board: Any = None) -> None:
        """`torn()`, asked once the worker is gone: did it die inside a write? `exact`, with
        the worker's `board`: see the class."""
        with self._lock:
            old, self._sock, self._closing = self._sock, sock, closing
            self._torn = torn or (lambda: False)
            self._exact = exact if board is not None else None
            self._board = board
        if old is not None:
            old.close()

    @property
    def exact(self) -> bool:
        return self._exact is not None

    def disarm(self) -> None:
        """The worker stops on purpose: nothing to say, the socket closes."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def read(self, request_ids: Iterable[str], head: bytes = b"", length: int = 0) -> None:
        """Exact: the worker read these requests off the socket; or, with the message's
        `head` and `length`, is about to (`settle`)."""
        with self._lock:
            if self._sock is not None and self._exact is not None:
                self._read.update(dict.fromkeys(request_ids))
                self._noted = (head, length)

    def settle(self) -> bool:
        """The worker is gone: where it died after noting a whole message and before the
        board showed it taken off the socket, take it off here if it is still there (its
        requests are answered as read). True where the socket is at a message's start."""
        if self._board is None or not self._board.noted():
            return True
        head, length = self._noted
        sock = self._sock
        if sock is None:
            return False
        if not head:  # noted on the board, not yet here: nothing was taken
            return True
        try:
            if sock.recv(len(head), socket.MSG_PEEK | socket.MSG_DONTWAIT) != head:
                return True  # something else is waiting: the message was taken
            return len(sock.recv(length, socket.MSG_WAITALL)) == length
        except BlockingIOError:  # nothing waiting: the message was taken
            return True
        except OSError:
            return False

    def final(self, request_ids: list[str], write: int) -> None:
        """Exact: the worker's write number `write` ends these requests' answers. Requests
        whose last write the board shows written leave every record here."""
        with self._lock:
            if self._exact is None:
                return
            self._finals.append((write, request_ids))
            self._prune(self._board.written)

    def _prune(self, written: int) -> None:
        finals = self._finals
        while finals and finals[0][0] <= written:
            for request_id in finals.popleft()[1]:
                self._read.pop(request_id, None)
                self._words.pop(request_id, None)
                self._spoken.discard(request_id)

    def expect(self, words: Any) -> None:
        """`words`: request_id, silent, spoken (LastWords or `Words`)."""
        with self._lock:
            if self._sock is not None:
                self._words[words.request_id] = words

    def forget(self, request_id: str) -> None:
        with self._lock:
            if self._exact is not None:  # the worker ends it: whether its text went out
                self._spoken.add(request_id)  # is not known here, and the in-band words
                return  # are an error either way (worker_service.last_words)
            self._words.pop(request_id, None)
            self._spoken.discard(request_id)

    def sent(self, texts: Iterable[tuple[str, str, int]],
             finals: Iterable[tuple[str, Any]]) -> None:
        """Events reached the worker: their text may be on the frontend's wire, and ended
        requests are the worker's to end (exact: until their last write is written, they
        keep their words)."""
        with self._lock:
            words, spoken = self._words, self._spoken
            for request_id, text, _ in texts:
                if text and request_id in words:
                    spoken.add(request_id)
            if self._exact is not None:
                return
            for request_id, _ in finals:
                if words.pop(request_id, None) is not None:
                    spoken.discard(request_id)

    def say(self) -> None:
        """The worker is gone: every request's last words, the closing message, the close."""
        if self.answer():
            self.close(closing=True)

    def answer(self) -> bool:
        """The worker is gone: every request's last words (exact: every unanswered request
        it read). False where nothing more can be said: the worker died inside a write (the
        socket is closed without a word, which leaves no message torn) or the frontend went
        away; True where the socket is still there, for the closing message or a takeover."""
        with self._lock:
            sock = self._sock
            if sock is None:
                return False
            if self._torn():
                logger.error("guardian %d: the TorchServe worker died inside a write to the "
                             "frontend; closing its socket without a word after that torn "
                             "message (the frontend errors what it can)", os.getpid())
                self._sock = None
                _close(sock)
                return False
            spoken = self._spoken
            if self._exact is not None:
                self._prune(self._board.written)
                pending = list(self._read)
            else:
                pending = list(self._words)
            answers = []
            for rid in pending:
                w = self._words.get(rid)
                if w is None:
                    answers.append(one_request_message(rid, self._exact or ()))
                else:
                    answers.append(w.spoken if w.spoken is not None and rid in spoken
                                   else w.silent)
            self._words, self._read, self._spoken = {}, {}, set()
            self._finals.clear()
            try:
                sock.settimeout(SAY_TIMEOUT_S)
                sock.sendall(b"".join(answers))
            except OSError as exc:  # the frontend went away too (a shutdown): nobody to tell
                logger.error("guardian %d: writing to TorchServe failed: %s", os.getpid(), exc)
                self._sock = None
                _close(sock)
                return False
        logger.error("guardian %d: the TorchServe worker died; answered its %d request(s) "
                     "with a 500", os.getpid(), len(answers))
        return True

    def reading(self) -> bool:
        """Exact: the worker died inside a message from the frontend (see the class)."""
        return self._board is not None and self._board.reading()

    def close(self, closing: bool) -> None:
        """The closing message (`closing`: it errors every request still in the
        frontend's map), then the close: the frontend restarts the worker."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            if closing:
                sock.sendall(self._closing)
        except OSError as exc:
            logger.error("guardian %d: writing to TorchServe failed: %s", os.getpid(), exc)
        finally:
            _close(sock)
        logger.error("guardian %d: closed the dead worker's socket%s", os.getpid(),
                     " after its closing message" if closing else "")

    def hand_off(self) -> socket.socket | None:
        """The socket, for a worker that takes it over; this farewell says nothing more."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.settimeout(None)
        return sock


def one_request_message(request_id: str, tails: Iterable[bytes]) -> bytes:
    """A code-200 message of `tails`' predictions for one request: the request id goes in
    front of each (TorchServe's layout, ts/protocol/otf_message_handler.py:56-155; the
    tails from worker_service._prediction_tail)."""
    rid = request_id.encode("utf-8")
    head = struct.pack("!i", len(rid)) + rid
    return b"".join([struct.pack("!ii", 200, 0), *(head + t for t in tails),
                     struct.pack("!i", -1)])


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
    def start(cls, sock: socket.socket, closing: bytes, board: Any,
              exact: tuple[bytes, ...] | None = None,
              takeover: dict[str, Any] | None = None) -> Guardian:
        """A guardian holding a duplicate of `sock` (and of `board`'s fd); `closing`: the
        message that errors every request the frontend still has on this worker. `exact`:
        the worker notes what it reads and what it has answered (see `Farewell`), and
        `takeover`: how to start a worker that takes the socket over (`take_over`)."""
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])
        fds = (theirs.fileno(), sock.fileno(), board.fd)
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOT, root,
                                     *map(str, fds)], pass_fds=fds, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        guardian = cls(proc, Connection(ours.detach()))
        guardian._send(("arm", closing, exact, takeover))
        return guardian

    def expect(self, words: Any) -> None:
        self._send(("words", words.request_id, words.silent, words.spoken))

    def sent(self, texts: list[tuple[str, str, int]], finals: list[tuple[str, None]]) -> None:
        self._send(("sent", texts, finals))

    def forget(self, request_id: str) -> None:
        self._send(("forget", request_id))

    def read(self, request_ids: list[str], head: bytes = b"", length: int = 0) -> None:
        self._send(("read", request_ids, head, length))

    def final(self, request_ids: list[str], write: int) -> None:
        self._send(("final", request_ids, write))

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


class GuardedWrites(CountedWrites):
    """TorchServe's socket as an exact guardian's worker uses it (worker_service.
    WorkerService): each write counted, each message read and each answer's last write
    noted with the guardian first (`Farewell`)."""

    def __init__(self, sock: Any, board: Board, guardian: Guardian) -> None:
        super().__init__(sock, board)
        self._guardian = guardian

    def reading(self) -> None:
        """A message from the frontend has begun: until `read`, no other worker may read on."""
        self._cells[Board.READING] = Board.INSIDE

    def read(self, request_ids: list[str]) -> None:
        """The message's requests, noted; the socket is at a message's start again."""
        self._guardian.read(request_ids)
        self._cells[Board.READING] = Board.AT_START

    def noting(self, request_ids: list[str], head: bytes, length: int) -> None:
        """A whole message still on the socket (peeked): its requests, its first bytes and
        its length noted before the worker takes it off (`taken`). If the worker dies in
        between, the guardian sees from the socket whether it did (Farewell.settle)."""
        self._cells[Board.READING] = Board.NOTED
        self._guardian.read(request_ids, head, length)

    def taken(self) -> None:
        """The noted message is off the socket: at a message's start again."""
        self._cells[Board.READING] = Board.AT_START

    def sendall_final(self, data: bytes, request_ids: list[str]) -> None:
        """`data` ends these requests' answers: noted with its write's number, then sent."""
        self._guardian.final(request_ids, int(self._cells[Board.WRITES]) + 1)
        self.sendall(data)


#: how a worker that takes a dead one's socket over starts (handlers/torchserve/takeover.py)
_TAKEOVER_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
                  "from handlers.torchserve.takeover import main; main(sys.argv[2:])")
#: the environment variable naming the pipe on which it says it serves
READY_FD_ENV = "INF2SERVE_TAKEOVER_READY_FD"
#: ... and the one counting the workers in a row that died soon after taking over
SHORT_LIVED_ENV = "INF2SERVE_TAKEOVER_SHORT_LIVED"
#: a worker that took over and died within SHORT_LIVED_S counts as short-lived; from the
#: MAX_SHORT_LIVED-th of them in a row on, the next one starts after a wait that doubles
#: from 1 s up to BACKOFF_CAP_S (`backoff_s`). TorchServe backs off its own restarts too
#: (pytorch/serve@v0.12.0:frontend/server/src/main/java/org/pytorch/serve/wlm/
#: WorkerThread.java:51-53, 540-555), but a socket handed back to it under traffic never
#: served again (docs/design.md), so a crash loop stays with the guardian
SHORT_LIVED_S, MAX_SHORT_LIVED, BACKOFF_CAP_S = 60.0, 3, 30.0


def short_lived(takeover: dict[str, Any]) -> int:
    """How many workers in a row, this dead one included, died within SHORT_LIVED_S of
    taking a socket over (0: this one lived longer, or was TorchServe's own)."""
    if time.time() - float(takeover.get("serving_since", 0.0)) >= SHORT_LIVED_S:
        return 0
    return int(takeover.get("short_lived", -1)) + 1


def backoff_s(short: int) -> float:
    """How long to wait before a worker takes over from the `short`-th short-lived worker
    in a row (`short_lived`): requests sent meanwhile wait on the socket, as they do while
    a worker loads, so the wait is capped at BACKOFF_CAP_S."""
    if short < MAX_SHORT_LIVED:
        return 0.0
    return min(BACKOFF_CAP_S, 2.0 ** (short - MAX_SHORT_LIVED))


def redirect_logs(sock: socket.socket) -> str | None:
    """Point this process's stdout and stderr (and so its children's) at the frontend's
    model log, where TorchServe writes what a worker prints: the frontend closes the dead
    worker's pipes once it sees that process exit (the JDK drains and closes a child's
    streams then), so a worker taking over would print into a closed pipe. The log is
    ${LOG_LOCATION:-logs}/model_log.log of the frontend (its log4j2.xml), `logs` relative
    to the frontend's working directory, found through the socket's peer (SO_PEERCRED).
    The file's path, or None (left as it was) where it cannot be found or opened."""
    location = os.environ.get("LOG_LOCATION") or "logs"
    if not os.path.isabs(location):
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
            pid = struct.unpack("3i", creds)[0]
            location = os.path.join(os.readlink(f"/proc/{pid}/cwd"), location)
        except (AttributeError, OSError):
            return None
    path = os.path.join(location, "model_log.log")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # the frontend's: never made here
    except OSError:
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


def peer_closed(sock: socket.socket, timeout_s: float | None = 0.0) -> bool:
    """Whether the frontend has closed its end (waiting up to `timeout_s`, None: for as
    long as that takes): a worker that TorchServe stops is killed around the time its
    socket closes, and no worker should take over, or keep loading, for a frontend that
    is gone. POLLRDHUP fires on the peer's close only, not on data waiting to be read."""
    rdhup = getattr(select, "POLLRDHUP", 0)
    if not rdhup:  # not Linux: no way to tell without reading
        return False
    poller = select.poll()
    poller.register(sock.fileno(), rdhup)
    events = poller.poll(None if timeout_s is None else int(timeout_s * 1000))
    return any(mask & (rdhup | select.POLLHUP | select.POLLERR) for _, mask in events)


def take_over(sock: socket.socket, takeover: dict[str, Any]) -> bool:
    """Start a worker on the dead one's socket (its requests answered, the next message's
    start unread) and wait until its own guardian runs: True. False, the worker killed,
    where it exits or has not said so within `takeover["timeout_s"]` (TorchServe's own
    bound on a model's load, startupTimeout)."""
    ready_r, ready_w = os.pipe()
    env = {**os.environ, READY_FD_ENV: str(ready_w),
           SHORT_LIVED_ENV: str(short_lived(takeover))}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _TAKEOVER_BOOT, takeover["root"], str(sock.fileno()),
             json.dumps(takeover)], pass_fds=(sock.fileno(), ready_w),
            stdin=subprocess.DEVNULL, env=env)
    except OSError:
        logger.exception("guardian %d: starting a worker to take the socket over failed",
                         os.getpid())
        os.close(ready_r)
        return False
    finally:
        os.close(ready_w)
    logger.error("guardian %d: worker %d takes the dead worker's socket over", os.getpid(),
                 proc.pid)
    try:
        ready, _, _ = select.select([ready_r], [], [], float(takeover.get("timeout_s", 120)))
        said = os.read(ready_r, 1) if ready else b""
    finally:
        os.close(ready_r)
    if said == b"1":
        return True
    logger.error("guardian %d: worker %d did not take the socket over (%s)", os.getpid(),
                 proc.pid, "it exited" if ready else "timed out")
    proc.kill()
    proc.wait()
    return False


def signal_ready() -> None:
    """In a worker that takes a socket over: its guardian runs, the old one may go."""
    fd = os.environ.pop(READY_FD_ENV, None)
    if fd is None:
        return
    try:
        os.write(int(fd), b"1")
        os.close(int(fd))
    except OSError:
        logger.exception("telling the old guardian that this worker serves failed")


def _no_takeover(farewell: Farewell, takeover: dict[str, Any] | None) -> str:
    """Why the socket must go back to TorchServe, or "" (a worker may take it over)."""
    if not farewell.exact:
        return "this worker did not note what it read"
    if takeover is None:
        return "handler.worker_takeover is false, or this is not a TorchServe worker"
    if farewell.reading():
        return "it died inside a message from the frontend"
    if not farewell.settle():
        return "it died taking a message off the socket, which went wrong"
    return ""


def main(argv: list[str]) -> None:
    """The guardian process: notes until the worker's pipe closes, then the farewell."""
    logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.INFO)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the worker's to handle
    notes_fd, frontend_fd, board_fd = map(int, argv)
    notes = Connection(notes_fd)
    board = Board(board_fd)
    farewell = Farewell()
    frontend = socket.socket(fileno=frontend_fd)
    takeover: dict[str, Any] | None = None
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
        elif kind == "read":
            farewell.read(*note[1:])
        elif kind == "final":
            farewell.final(note[1], note[2])
        elif kind == "forget":
            farewell.forget(note[1])
        elif kind == "arm":
            _, closing, exact, takeover = note
            farewell.arm(frontend, closing, board.writing, exact, board)
        elif kind == "stop":
            farewell.disarm()
            return
    redirect_logs(frontend)  # the dead worker's pipes close any moment now
    why = _no_takeover(farewell, takeover)
    if why:
        if farewell.exact:
            logger.error("guardian %d: no worker takes the socket over (%s): closing it, for "
                         "TorchServe to restart the worker", os.getpid(), why)
        farewell.say()
        return
    if not farewell.answer():  # torn, or the frontend is gone
        return
    sock = farewell.hand_off()
    if sock is None:
        return
    wait = backoff_s(short := short_lived(takeover))
    if wait:
        logger.error("guardian %d: %d workers in a row died within %.0f s of taking over: the "
                     "next one starts in %.0f s", os.getpid(), short, SHORT_LIVED_S, wait)
    if peer_closed(sock, max(wait, 0.2)):  # TorchServe stopping this worker: nobody to serve
        logger.error("guardian %d: the frontend closed the dead worker's socket", os.getpid())
        sock.close()
        return
    if take_over(sock, takeover):
        sock.close()  # the new worker and its guardian hold their own
        return
    farewell.arm(sock, closing)  # no worker took it: the closing message and the close
    farewell.close(closing=True)
