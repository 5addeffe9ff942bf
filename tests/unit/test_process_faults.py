"""Faults between the worker, its engine process and its guardian, with real processes.

- a worker SIGKILLed while the engine holds the GIL: the guardian answers on the
  frontend's socket within a second, and the engine process dies with the worker;
- a step that holds the GIL for 5 s under a 120 s step timeout is not killed, while a
  process stopped (SIGSTOP) in a step still is, within the silence bound;
- a worker whose event loop deadlocks while requests run is killed by its engine process,
  and its guardian answers them;
- a request sent after the engine process died, before the worker noticed, waits for the
  next process instead of failing.

tests/unit/test_engine_client.py has the plain deaths and stalls; tests/e2e/ the same
faults through TorchServe.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import psutil
import pytest

from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from handlers.engine import process
from handlers.engine.client import EngineClient
from handlers.engine.messages import EngineRequest
from handlers.engine.scheduler import FinishEvent
from handlers.engine.start import EngineSpec
from handlers.torchserve.generation_handler import WORKER_DIED
from handlers.torchserve.worker_service import closing_message
from tests.unit.fakes import CharTokenizer
from tests.unit.test_engine_client import SlowBackend, Stream
from tests.unit.test_worker_farewell import read_all, split_closing, started_stream
from tests.unit.ts_frontend import decode, http_view

ROOT = Path(__file__).resolve().parents[2]
CLOSING = closing_message(WORKER_DIED)


class FaultyBackend(SlowBackend):
    """A SlowBackend whose next decode holds the GIL for `hold_s` once `hold` exists (a
    C call that never releases it: ctypes.PyDLL keeps the GIL; `held` is written just
    before), and that forks, at load, a child holding every fd of the engine process --
    its pipe to the worker too -- for 30 s where `sleepers` is given (a compiler's
    grandchild does that: the worker then sees the death only by polling)."""

    def __init__(self, hold: str | None = None, hold_s: float = 5.0,
                 sleepers: str | None = None, **kw) -> None:
        super().__init__(**kw)
        self.hold, self.hold_s = hold, hold_s
        if sleepers:
            pid = os.fork()
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            with open(sleepers, "a") as f:
                f.write(f"{pid}\n")

    def decode(self, slots):
        if self.hold and os.path.exists(self.hold):
            os.unlink(self.hold)
            Path(self.hold + ".held").touch()
            ctypes.PyDLL(None).usleep(int(self.hold_s * 1e6))
        return super().decode(slots)


def start(tmp_path: Path, batch_size: int = 4, **backend) -> EngineClient:
    handler = {"batch_size": batch_size, "max_queue": 8, "max_length": 512,
               "max_new_tokens_limit": 256, "warmup": False, "step_timeout_s": 120}
    spec = EngineSpec(parse_config({"handler": handler}), tmp_path, make_tokenizer=CharTokenizer,
                      make_backend=partial(FaultyBackend, batch_size=batch_size, max_length=512,
                                           **backend))
    return EngineClient.launch(spec, None, batch_size + 8)


def submit(client: EngineClient, request_id: str, n: int = 200) -> Stream:
    stream = Stream()
    client.submit(EngineRequest(request_id, [ord("a")], n, SamplingParams()), stream.sink)
    return stream


@pytest.fixture
def clients():
    started: list[EngineClient] = []
    yield started
    for client in started:
        client.stop()


def dead_at(pid: int, timeout_s: float) -> float:
    """When the process died (a zombie counts: this machine's init reaps it late)."""
    deadline = time.monotonic() + timeout_s
    while process.process_state(pid) not in (None, "Z"):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.01)
    return time.monotonic()


def wait_for(path: Path, timeout_s: float = 60, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        assert proc is None or proc.poll() is None, "the worker exited early"
        time.sleep(0.02)


# -- a step that holds the GIL, a stopped process (item 6) --------------------------------

def test_a_step_holding_the_gil_for_5s_is_not_killed_under_a_120s_step_timeout(
        tmp_path, clients) -> None:
    """The heartbeat thread cannot run while the step holds the GIL; the board says the
    engine is in a step, so only handler.step_timeout_s bounds it."""
    hold = tmp_path / "hold"
    client = start(tmp_path, hold=str(hold), hold_s=5.0)
    clients.append(client)
    running = submit(client, "running", n=30)
    assert running.wait_started()
    pid = client.pid
    hold.touch()
    assert running.wait_done(60)
    assert (tmp_path / "hold.held").exists()  # the GIL was held
    assert isinstance(running.last, FinishEvent), running.last
    assert running.last.completion_tokens == 30 and client.pid == pid


def test_a_process_stopped_inside_a_step_is_still_caught_within_the_silence_bound(
        tmp_path, clients) -> None:
    """Each step sleeps 1 s (GIL released): SIGSTOP lands inside one. Stopped (/proc state
    T), its silence counts: killed after SILENT_S, not after the 120 s step timeout."""
    client = start(tmp_path, step_s=1.0)
    clients.append(client)
    running = submit(client, "running", n=100)
    assert running.wait_started()
    stopped = client.pid
    began = time.monotonic()
    os.kill(stopped, signal.SIGSTOP)
    try:
        assert running.wait_done(10)
    finally:
        if psutil.pid_exists(stopped):
            os.kill(stopped, signal.SIGKILL)
    took = time.monotonic() - began
    assert took < 5, took  # SILENT_S 3 s, plus a poll and a heartbeat's interval
    assert running.last.status == 500 and "hung (sent nothing for" in running.last.message


# -- the gap after a death (item 8) -------------------------------------------------------

def test_a_request_sent_before_the_worker_notices_a_death_waits_for_the_next_process(
        tmp_path, clients) -> None:
    """A grandchild keeps the dead process's pipe open, so the worker learns of the death
    only by its poll (POLL_S); a request sent meanwhile goes into a pipe nobody reads. The
    board says the process never read it: it is sent to the next process, not failed."""
    sleepers = tmp_path / "sleepers"
    client = start(tmp_path, sleepers=str(sleepers))
    clients.append(client)
    try:
        first = submit(client, "first", n=3)
        assert first.wait_done(30) and isinstance(first.last, FinishEvent)
        dead = client.pid
        os.kill(dead, signal.SIGKILL)
        dead_at(dead, 5)  # dead (not reaped: that is the worker's poll), its pipe still open
        gap = submit(client, "gap", n=5)
        assert gap.wait_done(60)
        assert isinstance(gap.last, FinishEvent), gap.last
        assert gap.last.completion_tokens == 5 and client.pid != dead
    finally:
        for pid in sleepers.read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- the worker dies or deadlocks (items 5, 7): a worker process of its own ----------------

WORKER = """
import asyncio, socket, sys, threading, time
from pathlib import Path
sys.path.insert(0, {root!r})
from handlers.api.framing import native_framer
from handlers.backends.base import SamplingParams
from handlers.engine.client import LAST_WORDS
from handlers.engine.core import QueueSink
from handlers.engine.messages import EngineRequest
from handlers.torchserve.generation_handler import WORKER_DIED, _last_words
from handlers.torchserve.worker_service import closing_message
from tests.unit.test_process_faults import start

if __name__ == "__main__":
    tmp = Path({tmp!r})
    client = start(tmp, **{backend!r})
    client.hand_over(socket.socket(fileno={fd}), closing_message(WORKER_DIED))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    started = set()
    for rid, stream in (("ndjson", True), ("whole", False)):
        LAST_WORDS.set(_last_words(rid, native_framer(stream, "ndjson")))
        sink = QueueSink(loop, asyncio.Queue(), on_text=lambda text, rid=rid: started.add(rid))
        client.submit(EngineRequest(rid, [97], 256, SamplingParams()), sink)
    LAST_WORDS.set(None)
    while len(started) < 2:
        time.sleep(0.01)
    {then}
    (tmp / "ready.part").write_text(str(client.pid))
    (tmp / "ready.part").rename(tmp / "ready")  # whole when seen
    time.sleep(600)
"""


def run_worker(tmp_path: Path, then: str = "pass", **backend
               ) -> tuple[subprocess.Popen, socket.socket, int, Path]:
    """A worker process serving two requests (a stream that started, a non-streamed one)
    with the test's socket handed over; after `then` (a line of code), its engine
    process's pid. Its output (the engine process's too) goes to a log file."""
    frontend, worker_end = socket.socketpair()
    script, log = tmp_path / "worker.py", tmp_path / "worker.log"
    script.write_text(textwrap.dedent(WORKER).format(
        root=str(ROOT), tmp=str(tmp_path), backend=backend, fd=worker_end.fileno(), then=then))
    with open(log, "w") as out:
        worker = subprocess.Popen([sys.executable, str(script)], pass_fds=[worker_end.fileno()],
                                  stdout=out, stderr=subprocess.STDOUT)
    worker_end.close()  # the worker and its guardian hold it now
    try:
        wait_for(tmp_path / "ready", 120, worker)
    except AssertionError:
        worker.kill()
        print(log.read_text())
        raise
    return worker, frontend, int((tmp_path / "ready").read_text()), log


def assert_answered(data: bytes) -> None:
    """The guardian's farewell: the stream's in-band error, the other's 500, the close."""
    predictions = decode(split_closing(data))
    assert [p.request_id for p in predictions] == ["ndjson", "ndjson", "whole", "whole"]
    assert http_view(started_stream("ndjson") + predictions[:2]).complete
    whole = http_view(predictions[2:])
    assert whole.status == 500 and json.loads(whole.body)["error"]["message"] == WORKER_DIED


def test_a_worker_killed_while_the_engine_holds_the_gil_is_answered_within_a_second(
        tmp_path) -> None:
    """The engine process is inside an 8 s call that holds its GIL when the worker gets
    SIGKILL: the guardian, which shares no GIL with it, answers at once, and the engine
    process dies with the worker (PR_SET_PDEATHSIG) instead of finishing its call."""
    hold = tmp_path / "hold"
    worker, frontend, engine, log = run_worker(
        tmp_path, then=f"Path({str(hold)!r}).touch()", hold=str(hold), hold_s=8.0)
    try:
        wait_for(tmp_path / "hold.held", 30, worker)
        time.sleep(0.3)  # inside the call
        killed_at = time.monotonic()
        os.kill(worker.pid, signal.SIGKILL)
        data, eof_at = read_all(frontend, 10)
        gone_at = dead_at(engine, 5)
    finally:
        worker.kill()
        worker.wait()
    print(f"farewell {eof_at - killed_at:.3f} s, engine process gone "
          f"{gone_at - killed_at:.3f} s after the kill")
    assert eof_at - killed_at < 1.0, (eof_at - killed_at, log.read_text()[-3000:])
    assert gone_at - killed_at < 2.0
    assert_answered(data)


def test_a_worker_whose_event_loop_deadlocks_is_killed_and_its_requests_answered(
        tmp_path) -> None:
    """The worker lives but its event loop blocks for good with two requests running: the
    engine process sees its step messages left unread for WORKER_UNREAD_S and kills the
    worker; the guardian answers both requests."""
    worker, frontend, engine, log = run_worker(
        tmp_path, then="loop.call_soon_threadsafe(threading.Event().wait)", step_s=0.05)
    blocked_at = time.monotonic()
    try:
        data, eof_at = read_all(frontend, 15)
        assert worker.wait(5) == -signal.SIGKILL
    finally:
        worker.kill()
        worker.wait()
    waited = eof_at - blocked_at
    print(f"the deadlocked worker was answered for {waited:.2f} s after its loop blocked")
    assert waited < process.WORKER_UNREAD_S + 3, waited
    assert "results unread for" in log.read_text(), log.read_text()[-3000:]
    assert_answered(data)
    dead_at(engine, 5)  # it died with the worker
