"""The engine process under the worker's supervision: a dead model never hangs a request.

Real processes (spawned as in a worker), a pure-Python backend and tokenizer, so each
engine process starts in about a second; tests/e2e/test_worker_death_e2e.py does the
same through TorchServe with the fake Neuron SDK.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from functools import partial
from pathlib import Path

import psutil
import pytest

from handlers.backends.base import SamplingParams
from handlers.config import parse_config
from handlers.engine.client import EngineClient
from handlers.engine.messages import EngineRequest, StepOutputs
from handlers.engine.scheduler import ErrorEvent, FinishEvent, TextEvent
from handlers.engine.start import EngineSpec
from handlers.errors import CapacityError, ConfigError
from handlers.telemetry.catalog import Finished
from tests.unit.fakes import CharTokenizer, CountingBackend

needs_torch_backend = pytest.mark.skipif(
    int(__import__("transformers").__version__.split(".")[0]) < 5,
    reason="the torch backend needs transformers 5 (a Neuron SDK stack has 4.x)")

needs_torch = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("torch") is None,
    reason="its checkpoint is built with torch (the 3.10 runtime venv has none)")

ROOT = Path(__file__).resolve().parents[2]


class SlowBackend(CountingBackend):
    """A CountingBackend whose decode takes `step_s`; refuses to load while `broken` exists,
    takes 3 s to load while `slow` does, and a decode never returns while `stuck` does (a
    device call that hangs, the GIL released)."""

    def __init__(self, step_s: float = 0.02, broken: str | None = None,
                 slow: str | None = None, stuck: str | None = None, **kw) -> None:
        if broken and os.path.exists(broken):
            raise ConfigError(f"handler.checkpoint: {broken} says the model is broken")
        if slow and os.path.exists(slow):
            time.sleep(3)
        super().__init__(**kw)
        self.step_s, self.stuck = step_s, stuck

    def decode(self, slots):
        time.sleep(self.step_s)
        while self.stuck and os.path.exists(self.stuck):
            time.sleep(0.05)
        return super().decode(slots)


class Stream:
    """A request's sink: collects events (from the client's reader thread) for the test."""

    def __init__(self) -> None:
        self.events: list = []
        self._cond = threading.Condition()

    def sink(self, event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait(self, what, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: what(self.events), timeout_s)

    def wait_started(self, timeout_s: float = 30) -> bool:
        return self.wait(lambda ev: any(isinstance(e, TextEvent) for e in ev), timeout_s)

    def wait_done(self, timeout_s: float = 30) -> bool:
        return self.wait(lambda ev: bool(ev) and not isinstance(ev[-1], TextEvent), timeout_s)

    @property
    def last(self):
        return self.events[-1]


def start(tmp_path, batch_size: int = 4, max_queue: int = 8, observer=None,
          broken: str | None = None, slow: str | None = None, stuck: str | None = None,
          **handler) -> EngineClient:
    config = parse_config({"handler": {"batch_size": batch_size, "max_queue": max_queue,
                                       "max_length": 512, "max_new_tokens_limit": 256,
                                       "warmup": False, **handler}})
    spec = EngineSpec(config, tmp_path, make_tokenizer=CharTokenizer,
                      make_backend=partial(SlowBackend, broken=broken, slow=slow, stuck=stuck,
                                           batch_size=batch_size, max_length=512))
    return EngineClient.launch(spec, observer, batch_size + max_queue)


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


def test_a_killed_engine_process_fails_its_requests_at_once_then_serves_again(tmp_path,
                                                                               clients):
    seen = []
    client = start(tmp_path, observer=lambda *a: seen.append(a))
    clients.append(client)
    streams = [submit(client, f"r{i}") for i in range(4)]  # 200 steps of 20 ms: ~4 s each
    assert all(s.wait_started() for s in streams)
    dead = client.pid
    os.kill(dead, signal.SIGKILL)
    assert all(s.wait_done(5) for s in streams)  # the bound
    for s in streams:
        assert isinstance(s.last, ErrorEvent) and s.last.status == 500
        assert "SIGKILL" in s.last.message and "retry" in s.last.message
    ends = [Finished(*v) for name, v, _ in seen if name == "RequestFinished"]
    assert [e.reason for e in ends] == ["error"] * 4  # counted for the metrics, by the worker
    after = submit(client, "after", n=20)  # waits for the new process
    assert after.wait_done(60)
    assert isinstance(after.last, FinishEvent) and after.last.completion_tokens == 20
    assert client.pid != dead and not psutil.pid_exists(dead)


def test_a_stopped_engine_process_is_killed_and_its_requests_fail_within_5s(tmp_path, clients):
    """SIGSTOP: the process neither dies nor answers. Its heartbeat falls silent, the
    watchdog kills it (while it holds requests), and they end as after a death."""
    client = start(tmp_path)
    clients.append(client)
    streams = [submit(client, f"r{i}") for i in range(4)]
    assert all(s.wait_started() for s in streams)
    stopped = client.pid
    began = time.monotonic()
    os.kill(stopped, signal.SIGSTOP)
    assert all(s.wait_done(5) for s in streams)  # the bound
    assert time.monotonic() - began < 5
    for s in streams:
        assert isinstance(s.last, ErrorEvent) and s.last.status == 500
        assert "hung (sent nothing for" in s.last.message and "retry" in s.last.message
    after = submit(client, "after", n=20)
    assert after.wait_done(60) and isinstance(after.last, FinishEvent)
    assert client.pid != stopped and not psutil.pid_exists(stopped)


def test_a_step_that_never_returns_is_caught_by_the_step_timeout(tmp_path, clients):
    """A device call that hangs with the process alive (its heartbeat still beats): past
    handler.step_timeout_s in one step, the process is killed and restarted."""
    stuck = tmp_path / "stuck"
    client = start(tmp_path, stuck=str(stuck), step_timeout_s=2)
    clients.append(client)
    running = submit(client, "running")
    assert running.wait_started()
    stuck.touch()
    assert running.wait_done(8)
    assert running.last.status == 500 and "past handler.step_timeout_s 2" in running.last.message
    stuck.unlink()
    after = submit(client, "after", n=5)
    assert after.wait_done(60) and isinstance(after.last, FinishEvent)


def test_an_idle_process_that_is_slow_to_answer_is_left_alone(tmp_path, clients):
    """No requests, no watchdog: a process only counts as hung while it holds requests."""
    client = start(tmp_path)
    clients.append(client)
    pid = client.pid
    os.kill(pid, signal.SIGSTOP)
    time.sleep(4.5)
    assert client.pid == pid and psutil.pid_exists(pid)
    os.kill(pid, signal.SIGCONT)
    time.sleep(1.5)  # its heartbeat is heard again before the next request
    done = submit(client, "after", n=5)
    assert done.wait_done(30) and isinstance(done.last, FinishEvent) and client.pid == pid


def test_a_model_that_fails_to_load_raises_its_own_error(tmp_path):
    broken = tmp_path / "broken"
    broken.touch()
    with pytest.raises(ConfigError, match="says the model is broken") as caught:
        start(tmp_path, broken=str(broken))
    # the child's traceback is the cause (BaseException.add_note is 3.11+)
    assert "raised in the engine process" in str(caught.value.__cause__)


@needs_torch_backend
def test_a_missing_checkpoint_fails_with_the_loaders_message(tmp_path):
    config = parse_config({"handler": {"checkpoint": "nowhere", "warmup": False}})
    spec = EngineSpec(config, tmp_path, make_tokenizer=CharTokenizer)
    with pytest.raises(Exception, match="nowhere"):
        EngineClient.launch(spec, None, 8)


def test_a_failed_restart_answers_503_until_the_model_loads_again(tmp_path, clients):
    broken = tmp_path / "broken"
    client = start(tmp_path, broken=str(broken))
    clients.append(client)
    running = submit(client, "running")
    assert running.wait_started()
    broken.touch()
    os.kill(client.pid, signal.SIGKILL)
    assert running.wait_done(5) and running.last.status == 500
    meanwhile = submit(client, "meanwhile", n=5)  # waits for the restart, which fails
    assert meanwhile.wait_done(30)
    assert isinstance(meanwhile.last, ErrorEvent) and meanwhile.last.status in (500, 503)
    refused = None
    for _ in range(100):  # while the model is down, a request is refused at once
        try:
            submit(client, f"probe{time.monotonic()}", n=1).wait_done(0.1)
        except CapacityError as exc:
            refused = exc
            break
    assert refused is not None and "broken" in str(refused) and refused.retry_after_s > 0
    assert client.down is not None and "broken" in client.down  # what the health API reads
    broken.unlink()
    for attempt in range(60):  # the next attempt (after 1, 2, 5 s) loads
        try:
            later = submit(client, f"later{attempt}", n=5)
            break
        except CapacityError:
            time.sleep(0.5)
    assert later.wait_done(30) and isinstance(later.last, FinishEvent)
    assert client.down is None


def test_a_request_waiting_for_a_restart_is_cancelled_at_once(tmp_path, clients):
    """It never reached an engine process: the worker answers the cancel itself, and the
    new process never sees it."""
    slow = tmp_path / "slow"
    client = start(tmp_path, slow=str(slow))
    clients.append(client)
    running = submit(client, "running")
    assert running.wait_started()
    slow.touch()
    os.kill(client.pid, signal.SIGKILL)
    assert running.wait_done(5) and running.last.status == 500
    waiting = submit(client, "waiting")  # the new process loads for 3 s
    kept = submit(client, "kept", n=5)
    client.cancel("waiting")
    assert waiting.events == [ErrorEvent(499, "cancelled")]
    assert kept.wait_done(60) and isinstance(kept.last, FinishEvent)  # sent once it loaded
    assert waiting.events == [ErrorEvent(499, "cancelled")]


def test_cancel_frees_the_slot_in_the_engine_process(tmp_path, clients):
    client = start(tmp_path, batch_size=1)
    clients.append(client)
    first = submit(client, "first")
    assert first.wait_started()
    client.cancel("first")
    assert first.wait_done(10) and first.last == ErrorEvent(499, "cancelled")
    second = submit(client, "second", n=5)
    assert second.wait_done(10) and isinstance(second.last, FinishEvent)


def test_one_message_carries_every_sequence_of_a_step(tmp_path, clients):
    client = start(tmp_path)
    clients.append(client)
    messages = []
    deliver = client._deliver
    client._deliver = lambda message: (messages.append(message), deliver(message))
    streams = [submit(client, f"r{i}", n=50) for i in range(4)]
    assert all(s.wait_done() for s in streams)
    assert all(s.last.completion_tokens == 50 for s in streams)
    assert all(isinstance(m, StepOutputs) for m in messages)
    assert sum(len(m.texts) for m in messages) >= 4 * 50
    assert sum(len(m.finals) for m in messages) == 4
    assert len(messages) <= 50 + 4  # one per step (4 prefills may arrive apart), not per token


def test_metrics_reach_the_workers_observer(tmp_path, clients):
    seen = []
    client = start(tmp_path, observer=lambda *a: seen.append(a))
    clients.append(client)
    stream = submit(client, "r", n=5)
    assert stream.wait_done()
    names = {name for name, _, _ in seen}
    assert {"TimeToFirstToken", "EngineQueueTime", "GeneratedTokens", "BusySlots",
            "InterTokenLatency", "RequestFinished"} <= names
    (end,) = [Finished(*value) for name, value, _ in seen if name == "RequestFinished"]
    assert end.reason == "length" and end.generation_tokens == 5  # across the process boundary


def test_a_full_worker_answers_503(tmp_path, clients):
    client = start(tmp_path, batch_size=1, max_queue=1)
    clients.append(client)
    streams = [submit(client, "a"), submit(client, "b")]
    with pytest.raises(CapacityError, match="2 requests are in flight"):
        submit(client, "c")
    client.stop()
    assert all(s.wait_done(10) and s.last.status == 503 for s in streams)  # stop answers them


def test_the_engine_process_exits_when_the_worker_dies(tmp_path):
    script, pid_file = tmp_path / "worker.py", tmp_path / "engine.pid"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from tests.unit.test_engine_client import start

        if __name__ == "__main__":
            client = start(Path({str(tmp_path)!r}))
            # whole or absent: the test may look between the open and the write
            Path({str(pid_file)!r} + ".tmp").write_text(str(client.pid))
            Path({str(pid_file)!r} + ".tmp").rename({str(pid_file)!r})
            time.sleep(600)
    """))
    worker = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL)
    try:
        for _ in range(600):
            if pid_file.exists() or worker.poll() is not None:
                break
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert psutil.Process(child).ppid() == worker.pid
    finally:
        worker.kill()
        worker.wait()
    try:
        psutil.Process(child).wait(10)  # the pipe closed: the engine process exits
    except psutil.NoSuchProcess:
        pass
    assert not psutil.pid_exists(child)


def test_engine_process_is_child_or_inline():
    assert parse_config({"handler": {}}).handler.engine_process == "child"
    with pytest.raises(ConfigError, match="handler.engine_process: 'thread' is not allowed; "
                                          "choose one of 'child', 'inline'"):
        parse_config({"handler": {"engine_process": "thread"}})


@needs_torch_backend
def test_inline_mode_runs_the_model_in_the_worker(tiny_checkpoint):
    import asyncio

    from handlers.api.request import parse_request
    from handlers.engine.start import InlineEngine
    from handlers.torchserve.service import GenerationService

    config = parse_config({"handler": {"checkpoint": tiny_checkpoint.name, "threads": 1,
                                       "max_length": 512, "max_new_tokens_limit": 256,
                                       "engine_process": "inline"}})
    service = GenerationService.create(config, tiny_checkpoint.parent)
    try:
        assert isinstance(service.engine, InlineEngine) and service.engine.down is None
        assert service.limits == service.engine.limits and service.limits.max_length == 512

        async def generate():
            request = parse_request({"prompt": "Hello", "max_new_tokens": 6,
                                     "min_new_tokens": 6}, config.handler)
            events = service.submit("r", request, service.encode(request.prompt),
                                    asyncio.get_running_loop())
            while isinstance(event := await events.get(), TextEvent):
                pass
            return event

        done = asyncio.run(generate())
        assert isinstance(done, FinishEvent) and done.completion_tokens == 6
    finally:
        service.engine.stop()


@pytest.mark.parametrize("backend", ["neuron", "nxdi"])
def test_the_worker_holds_the_core_claim_of_both_neuron_backends(backend, monkeypatch, tmp_path):
    """The claim outlives engine processes (a restart gets the same cores); a failed start
    gives it back."""
    from handlers.engine import client as engine_client

    config = parse_config({"handler": {"backend": backend, "max_length": 64,
                                       "max_new_tokens_limit": 32,
                                       "defaults": {"max_new_tokens": 16}, "neuron": {
        "tp_degree": 2, "cores_per_instance": 4, "core_lock_dir": str(tmp_path)}}})
    claims, released = [], []

    class Claim:
        cores = (2, 3)

        def release(self) -> None:
            released.append(self)

    def claim(settings, available):
        claims.append(list(available))
        return Claim()

    def launch(cls, spec, *args):
        assert spec.cores == (2, 3)  # the engine process is told which cores to use
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine_client, "claim_cores", claim)
    monkeypatch.setattr(engine_client.EngineClient, "launch", classmethod(launch))
    with pytest.raises(RuntimeError, match="stop here"):
        engine_client.EngineClient.start(config, tmp_path)
    assert claims == [[0, 1, 2, 3]] and len(released) == 1


@needs_torch
def test_the_worker_tokenizes_with_the_engine_processs_tokenizer(tiny_checkpoint, monkeypatch):
    """A child-mode worker takes the tokenizer the engine process loaded (pickled in its
    `Ready`) instead of loading the checkpoint's again, which costs a worker seconds of CPU
    (AutoTokenizer imports the model's modules): it tokenizes, decodes and renders chats as
    the checkpoint's tokenizer does."""
    from handlers.engine.start import load_tokenizer
    from handlers.torchserve import service as worker_service

    def reload(*args):
        raise AssertionError("the worker loaded the tokenizer again")

    monkeypatch.setattr(worker_service, "load_tokenizer", reload)
    config = parse_config({"handler": {"checkpoint": tiny_checkpoint.name, "backend": "synthetic",
                                       "synthetic": {"decode_step_ms": 1}}})
    service = worker_service.GenerationService.create(config, tiny_checkpoint.parent)
    try:
        assert isinstance(service.engine, EngineClient) and service.engine.down is None
        assert service.engine.take_tokenizer() is None  # taken once, not kept
        worker, loaded = service.tokenizer, load_tokenizer(tiny_checkpoint)
        assert type(worker) is type(loaded)
        text = "Hello there, general Kenobi!"
        ids = loaded(text).input_ids
        assert worker(text).input_ids == ids and service.encode(text) == loaded.encode(text)
        assert worker.decode(ids) == loaded.decode(ids)
        chat = [{"role": "user", "content": text}]
        assert worker.apply_chat_template(chat, tokenize=False) == loaded.apply_chat_template(
            chat, tokenize=False)
        assert (worker.eos_token_id, worker.bos_token_id) == (loaded.eos_token_id,
                                                              loaded.bos_token_id)
    finally:
        service.engine.stop()


def test_a_tokenizer_that_does_not_pickle_is_loaded_by_the_worker(caplog):
    import logging

    from handlers.engine.messages import Ready
    from handlers.engine.start import pickled_tokenizer

    class Unpicklable(CharTokenizer):
        def __reduce__(self):
            raise TypeError("holds a lock")

    with caplog.at_level(logging.INFO, logger="handlers.engine.start"):
        assert pickled_tokenizer(Unpicklable()) is None
    assert "does not pickle (holds a lock): the worker loads its own" in caplog.text
    assert Ready(None).tokenizer is None  # what the worker's fallback reads
    assert isinstance(__import__("pickle").loads(pickled_tokenizer(CharTokenizer())),
                      CharTokenizer)
