"""The guardian's book and its word (handlers/engine/guardian.py): a torn message is never
added to, a request's end is booked before the worker can write it, and a worker that
stops on purpose gets no farewell. tests/unit/test_worker_farewell.py has what the
farewell says; tests/unit/test_process_faults.py kills real workers."""

from __future__ import annotations

import json
import os
import socket
import time

from handlers.api.framing import native_framer
from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from handlers.engine import guardian as guardian_module
from handlers.engine.board import Board, CountedWrites
from handlers.engine.client import EngineClient, _Request
from handlers.engine.guardian import Farewell, GuardedWrites, Guardian
from handlers.engine.messages import EngineRequest, StepOutputs
from handlers.engine.scheduler import FinishEvent
from handlers.engine.start import EngineSpec
from handlers.torchserve import worker_service
from handlers.torchserve.generation_handler import WORKER_DIED, _last_words
from handlers.torchserve.worker_service import closing_message
from tests.unit.test_worker_farewell import read_all, started_stream
from tests.unit.ts_frontend import decode, http_view

CLOSING = closing_message(WORKER_DIED)


def test_a_worker_that_died_inside_a_write_gets_no_words_after_its_torn_message() -> None:
    frontend, worker_end = socket.socketpair()
    board = Board()
    writes = CountedWrites(worker_end, board)
    writes.sendall(b"whole")
    assert not board.writing()
    board.cells[Board.WRITES] += 1  # a write begun and never ended: the worker died in it
    farewell = Farewell()
    farewell.arm(worker_end, CLOSING, board.writing)
    farewell.expect(_last_words("r1", native_framer(False, "")))
    farewell.say()
    data, _ = read_all(frontend)
    assert data == b"whole"  # nothing after the torn message; the socket closed


def test_a_requests_end_is_booked_with_the_guardian_before_its_sink_gets_it(tmp_path) -> None:
    """The worker notes a request's first text and its end before handing them on: if it
    dies after writing the end, the guardian does not answer that request again."""
    log: list[tuple] = []

    class Recorder:
        def sent(self, texts, finals) -> None:
            log.append(("guardian", [t[0] for t in texts], [f[0] for f in finals]))

    client = EngineClient(EngineSpec(parse_config({"handler": {}}), tmp_path), None, 8)
    client._guardian = Recorder()
    for rid in ("a", "b"):
        request = EngineRequest(rid, [97], 5, SamplingParams())
        client._requests[rid] = _Request(
            request, lambda event, rid=rid: log.append(("sink", rid, type(event).__name__)),
            sent_to=0, last_words=_last_words(rid, native_framer(True, "ndjson")))
    done = FinishEvent("length", 1, 5, "Hello")
    client._deliver_step(StepOutputs([("a", "Hel", 1), ("b", "Hi", 1)], [("a", done)]))
    assert log[0] == ("guardian", ["a", "b"], ["a"])
    assert log[1:] == [("sink", "a", "TextEvent"), ("sink", "b", "TextEvent"),
                       ("sink", "a", "FinishEvent")]
    client._deliver_step(StepOutputs([("b", "!", 2)], []))  # "b" spoke already: no note
    assert [x for x in log if x[0] == "guardian"] == [("guardian", ["a", "b"], ["a"])]
    assert client._board.taken == 2  # both step messages taken in (plain sinks: at once)


def test_a_guardian_told_to_stand_down_closes_the_socket_without_a_word() -> None:
    frontend, worker_end = socket.socketpair()
    board = Board()
    guardian = Guardian.start(worker_end, CLOSING, board)
    worker_end.close()  # the guardian's duplicate is the only one left
    guardian.expect(_last_words("r1", native_framer(False, "")))
    began = time.monotonic()
    guardian.stand_down()
    data, eof_at = read_all(frontend)
    assert data == b"" and guardian.proc.returncode == 0 and eof_at - began < 5


def test_an_exact_farewell_answers_every_request_read_and_not_yet_answered() -> None:
    """Exact (the worker notes what it reads and each answer's last write): the requests
    left are those read whose last write the board does not show written -- in the book or
    not (an error answered without the engine: the whole 500) -- each answered on its own,
    with no closing message; the socket stays open for a worker that takes it over."""
    frontend, worker_end = socket.socketpair()
    board = Board()
    writes = CountedWrites(worker_end, board)
    farewell = Farewell()
    tails = worker_service.silent_tails(native_framer(False, "").error(500, WORKER_DIED))
    farewell.arm(worker_end, CLOSING, board.writing, tails, board)
    streamed = native_framer(True, "ndjson")
    farewell.read(["spoke", "quiet", "unbooked", "done", "ending", "cancelled"])
    for rid in ("spoke", "quiet", "done", "ending", "cancelled"):
        farewell.expect(_last_words(rid, streamed))
    farewell.sent([("spoke", "Once", 1), ("done", "Hi", 1), ("ending", "Yo", 1)],
                  [("done", None), ("ending", None)])
    farewell.forget("cancelled")  # its text may go out unnoted: the in-band words
    farewell.final(["done"], 1)
    writes.sendall(b"")  # write 1, whole: "done" is answered
    farewell.final(["ending"], 2)  # write 2 never happened: the worker died before it
    assert farewell.answer()
    sock = farewell.hand_off()
    assert sock is worker_end
    sock.close()
    data, _ = read_all(frontend)
    predictions = decode(data)
    assert not data.endswith(CLOSING)
    assert [p.request_id for p in predictions] == [
        "spoke", "spoke", "quiet", "quiet", "unbooked", "unbooked", "ending", "ending",
        "cancelled", "cancelled"]
    for rid in ("spoke", "ending"):
        view = http_view(started_stream(rid) + [p for p in predictions if p.request_id == rid])
        assert view.complete and view.forgotten and b"error" in view.body
    for rid in ("quiet", "unbooked"):
        view = http_view([p for p in predictions if p.request_id == rid])
        assert view.status == 500 and view.framing == "content-length" and view.forgotten
        assert json.loads(view.body)["error"]["message"] == WORKER_DIED
    cancelled = http_view([p for p in predictions if p.request_id == "cancelled"])
    assert cancelled.forgotten and cancelled.status == 500  # not started: a 500 head


def test_an_exact_farewell_prunes_what_the_board_shows_written() -> None:
    board = Board()
    farewell = Farewell()
    farewell.arm(socket.socketpair()[1], CLOSING, board.writing, (b"",), board)
    for n in range(1, 101):
        rid = f"r{n}"
        farewell.read([rid])
        farewell.expect(_last_words(rid, native_framer(True, "ndjson")))
        farewell.final([rid], n)
        board.cells[Board.WRITES] += 1
        board.cells[Board.WRITTEN] += 1
    assert len(farewell._read) <= 1 and len(farewell._words) <= 1  # nothing piles up


def test_a_worker_that_died_inside_a_message_from_the_frontend_gets_the_closing_message(
        ) -> None:
    """The board's `reading`: the socket's next bytes are not a message's start, so the
    guardian answers what it knows, then errors the rest and closes (no takeover)."""
    frontend, worker_end = socket.socketpair()
    board = Board()
    writes = GuardedWrites(worker_end, board, Recording())
    farewell = Farewell()
    farewell.arm(worker_end, CLOSING, board.writing, (b"",), board)
    writes.reading()
    assert farewell.reading()
    farewell.say()
    data, _ = read_all(frontend)
    assert data == CLOSING
    writes.read(["a"])
    assert not board.reading()


class Recording:
    """A Guardian's notes, kept (GuardedWrites' tests)."""

    def __init__(self) -> None:
        self.notes: list[tuple] = []

    def read(self, request_ids: list[str], head: bytes = b"", length: int = 0) -> None:
        self.notes.append(("read", request_ids, head, length) if head else ("read", request_ids))

    def final(self, request_ids: list[str], write: int) -> None:
        self.notes.append(("final", request_ids, write))


def test_guarded_writes_note_each_answers_last_write_by_its_number() -> None:
    frontend, worker_end = socket.socketpair()
    board = Board()
    guardian = Recording()
    writes = GuardedWrites(worker_end, board, guardian)
    writes.sendall(b"a")
    writes.sendall_final(b"b", ["r1", "r2"])
    assert guardian.notes == [("final", ["r1", "r2"], 2)]
    assert board.written == 2 and not board.writing()


def test_workers_that_die_soon_after_taking_over_back_the_takeovers_off() -> None:
    """Each worker that took a socket over and died within SHORT_LIVED_S counts; from the
    MAX_SHORT_LIVED-th in a row on, the next takeover waits, doubling up to BACKOFF_CAP_S
    (the socket never goes back to TorchServe for it)."""
    now = time.time()
    first = {"serving_since": now - 5, "short_lived": -1}  # TorchServe's own worker
    assert guardian_module.short_lived(first) == 0
    chain = [guardian_module.short_lived({"serving_since": now - 5, "short_lived": n})
             for n in range(8)]
    assert chain == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [guardian_module.backoff_s(n) for n in [0, *chain]] == [
        0, 0, 0, 1, 2, 4, 8, 16, guardian_module.BACKOFF_CAP_S]
    lived = {"serving_since": now - guardian_module.SHORT_LIVED_S - 1, "short_lived": 7}
    assert guardian_module.short_lived(lived) == 0  # it served a while: the count restarts
    assert guardian_module.backoff_s(guardian_module.short_lived(lived)) == 0


def test_the_socket_goes_back_to_torchserve_where_no_worker_may_take_it_over() -> None:
    """Why the guardian closes the socket for TorchServe's restart instead of a takeover."""
    takeover = {"serving_since": time.time() - 100, "short_lived": -1}
    farewell = Farewell()
    assert "did not note" in guardian_module._no_takeover(farewell, takeover)  # not exact
    board = Board()
    farewell.arm(socket.socketpair()[1], CLOSING, board.writing, (b"",), board)
    assert guardian_module._no_takeover(farewell, takeover) == ""
    assert "worker_takeover" in guardian_module._no_takeover(farewell, None)  # turned off
    board.cells[Board.READING] = 1.0
    assert "inside a message" in guardian_module._no_takeover(farewell, takeover)


def _noted(message: bytes) -> tuple[socket.socket, Farewell, Board, GuardedWrites]:
    """A worker's socket with `message` waiting and, noted as a GuardedWrites notes a whole
    message before taking it off, on an exact farewell (a Recording guardian in between)."""
    frontend, worker_end = socket.socketpair()
    board = Board()
    farewell = Farewell()
    farewell.arm(worker_end, CLOSING, board.writing, (b"",), board)
    recording = Recording()
    writes = GuardedWrites(worker_end, board, recording)
    frontend.sendall(message)
    return frontend, farewell, board, writes


def test_a_message_noted_whole_is_taken_off_by_the_guardian_if_the_worker_did_not() -> None:
    """Died after noting a message and before reading it: the guardian reads it off (its
    requests are answered as read) and the socket is at the next message's start, so a
    worker may take over; died after reading it: nothing more is read."""
    message = b"I" + bytes(range(200)) + b"end"
    after = b"Inext message"
    for taken in (False, True):
        frontend, farewell, board, writes = _noted(message)
        frontend.sendall(after)
        writes.noting(["r1"], message[:128], len(message))
        farewell.read(["r1"], message[:128], len(message))  # the guardian's copy of the note
        if taken:
            writes.recv(len(message))  # the worker read it, and died before `taken`
        assert board.noted() and not farewell.reading()
        assert guardian_module._no_takeover(farewell, {"serving_since": 0}) == ""
        rest = farewell.hand_off().recv(100, socket.MSG_DONTWAIT)
        assert rest == after


def test_a_message_noted_on_the_board_only_is_left_where_it_is() -> None:
    """Died between marking the board and the note reaching the guardian: nothing was read,
    so the message stays for the worker that takes over."""
    message = b"I" + bytes(range(50))
    frontend, farewell, board, writes = _noted(message)
    board.cells[Board.READING] = Board.NOTED
    assert farewell.settle()
    assert farewell.hand_off().recv(100, socket.MSG_DONTWAIT) == message


def test_the_frontends_close_is_told_apart_from_data_waiting() -> None:
    """A worker that TorchServe stops may die before its socket closes: no worker takes a
    socket over for a frontend that is gone, or keeps loading for one."""
    ours, frontend = socket.socketpair()
    frontend.sendall(b"a request")  # data waiting is not a close
    assert not guardian_module.peer_closed(ours, 0.05)
    frontend.close()
    assert guardian_module.peer_closed(ours, 1.0)
    ours.close()


def test_a_worker_that_took_over_keeps_the_dead_workers_id(monkeypatch) -> None:
    """Its metric files and series are the dead worker's (handlers/torchserve/metrics.py)."""
    from handlers.torchserve import metrics

    monkeypatch.setattr("sys.argv", ["-c", "/root", "7", "{}"])  # takeover.py's argv
    monkeypatch.delenv(metrics.WORKER_ID_ENV, raising=False)
    assert metrics.worker_id() == str(os.getpid())
    monkeypatch.setenv(metrics.WORKER_ID_ENV, "9000")
    assert metrics.worker_id() == "9000"
    assert metrics.worker_id(["--sock-name", "/tmp/.ts.sock.9001"]) == "9001"
