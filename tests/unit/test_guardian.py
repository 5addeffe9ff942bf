"""The guardian's book and its word (handlers/engine/guardian.py): a torn message is never
added to, a request's end is booked before the worker can write it, and a worker that
stops on purpose gets no farewell. tests/unit/test_worker_farewell.py has what the
farewell says; tests/unit/test_process_faults.py kills real workers."""

from __future__ import annotations

import socket
import time

from handlers.api.framing import native_framer
from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from handlers.engine.board import Board, CountedWrites
from handlers.engine.client import EngineClient, _Request
from handlers.engine.guardian import Farewell, Guardian
from handlers.engine.messages import EngineRequest, StepOutputs
from handlers.engine.scheduler import FinishEvent
from handlers.engine.start import EngineSpec
from handlers.torchserve.generation_handler import WORKER_DIED, _last_words
from handlers.torchserve.worker_service import closing_message
from tests.unit.test_worker_farewell import read_all

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
