"""The engine process's watch on its TorchServe worker: a worker stopped (SIGSTOP) while
requests are in flight is killed, so that the engine process answers them; a running one,
or a stopped one with nothing in flight, is left alone."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest

from handlers.engine import process


class Book:
    def __init__(self, holds: bool) -> None:
        self.holds = holds

    def holds_requests(self) -> bool:
        return self.holds


@pytest.fixture
def worker():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture(autouse=True)
def quick(monkeypatch) -> None:
    monkeypatch.setattr(process, "WORKER_STOPPED_S", 0.3)
    monkeypatch.setattr(process, "WORKER_CHECK_S", 0.05)


def watch(book: Book, pid: int) -> threading.Thread:
    thread = threading.Thread(target=process.watch_worker, args=(book, pid), daemon=True)
    thread.start()
    return thread


def test_the_state_letter_is_read_from_proc(worker) -> None:
    assert process.process_state(worker.pid) in ("S", "R")
    worker.send_signal(signal.SIGSTOP)
    time.sleep(0.1)
    assert process.process_state(worker.pid) == "T"
    assert process.process_state(2**22 + 7) is None


def test_a_worker_stopped_with_requests_in_flight_is_killed(worker) -> None:
    thread = watch(Book(holds=True), worker.pid)
    worker.send_signal(signal.SIGSTOP)
    assert worker.wait(5) == -signal.SIGKILL
    thread.join(2)
    assert not thread.is_alive()


def test_a_running_or_idle_worker_is_left_alone(worker) -> None:
    book = Book(holds=False)
    thread = watch(book, worker.pid)
    worker.send_signal(signal.SIGSTOP)  # stopped, but nothing in flight: someone debugging
    time.sleep(0.8)
    assert worker.poll() is None
    worker.send_signal(signal.SIGCONT)
    book.holds = True  # requests in flight, and running: busy, not stuck
    time.sleep(0.8)
    assert worker.poll() is None and thread.is_alive()
    worker.kill()
    worker.wait()
    thread.join(2)
    assert not thread.is_alive()  # the worker is gone: the pipe's end takes over


def test_requests_ended_in_step_messages_the_worker_has_not_taken_in_are_held() -> None:
    """The engine finished a request but the worker (stopped) never read its end: it still
    holds that request, so a stopped worker is killed and its guardian answers it."""
    from multiprocessing import Pipe

    from handlers.engine.board import Board
    from handlers.engine.scheduler import FinishEvent

    board = Board()
    ours, theirs = Pipe()
    outbox = process.Outbox(ours, board)
    put = outbox.sink("r1")
    assert not outbox.holds_requests()  # no guardian: killing the worker helps nobody
    board.cells[Board.GUARDED] = 1.0
    assert outbox.holds_requests()  # in flight
    put(FinishEvent("length", 1, 1, "x"))
    outbox.flush()
    assert outbox.holds_requests()  # its end is in a step message the worker has not read
    board.cells[Board.TAKEN] = outbox.sent
    assert not outbox.holds_requests()
    theirs.close()
