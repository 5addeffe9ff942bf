"""The messages between the worker and the engine: they pickle, are told apart by type,
and a step's texts reach a request before its last event.

No process here: the engine process's `serve` and `Outbox` run against an in-memory
pipe, the worker's `EngineClient` against hand-made `StepOutputs`
(tests/unit/test_engine_client.py runs real engine processes)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from handlers.backends.base import Capabilities, SamplingParams
from handlers.config import parse_config
from handlers.engine.client import EngineClient
from handlers.engine.core import Engine
from handlers.engine.messages import (
    Cancel,
    EngineRequest,
    LoadFailed,
    ModelLimits,
    Ready,
    StepOutputs,
    Stop,
)
from handlers.engine.process import Outbox, serve
from handlers.engine.scheduler import ErrorEvent, FinishEvent, Scheduler, Sequence, TextEvent
from handlers.engine.start import InlineEngine, build_sequence
from handlers.errors import CapacityError, ConfigError
from tests.unit.fakes import CharTokenizer, CountingBackend

REQUEST = EngineRequest("r1", [97, 98], 5, SamplingParams(temperature=0.5, top_k=3),
                        ("stop",), arrived_at=12.5, deadline=42.0)
FINISH = FinishEvent("length", 2, 2, "xy", (120, 121))


class Drained(Exception):
    """Nothing more to read (a real pipe would block)."""


class Pipe:
    """One end of a pipe: `recv` replays `incoming`, `send` records what went out."""

    def __init__(self, *incoming: object) -> None:
        self.incoming, self.sent = list(incoming), []

    def recv(self) -> object:
        if not self.incoming:
            raise Drained
        return self.incoming.pop(0)

    def poll(self, timeout: float = 0) -> bool:
        return bool(self.incoming)

    def send(self, message: object) -> None:
        self.sent.append(pickle.loads(pickle.dumps(message)))  # as it would cross


@pytest.mark.parametrize("message", [
    REQUEST,
    EngineRequest("r2", [1], 1, SamplingParams()),
    Cancel("r1"),
    Stop(),
    Ready(ModelLimits(4, 512, 511, Capabilities(unsupported={"logprobs": "not here"}))),
    StepOutputs([("r1", "he", 1), ("r2", "llo", 3)], [("r1", FINISH), ("r3", ErrorEvent(
        503, "full", 2))], [("BusySlots", 2, "count")]),
    StepOutputs(),
])
def test_every_message_pickles_round_trip(message) -> None:
    assert pickle.loads(pickle.dumps(message)) == message


def test_a_load_failure_carries_the_exception_and_the_childs_traceback() -> None:
    failed = pickle.loads(pickle.dumps(LoadFailed(ConfigError("handler.checkpoint: none"),
                                                  "Traceback ...")))
    assert type(failed.error) is ConfigError and str(failed.error) == "handler.checkpoint: none"
    assert failed.traceback == "Traceback ..."


# -- the engine process's side --------------------------------------------------------

class FakeEngine:
    def __init__(self, full: bool = False) -> None:
        self.calls: list = []
        self.full = full

    def submit(self, seq: Sequence) -> None:
        if self.full:
            raise CapacityError("3 requests are waiting", retry_after_s=2)
        self.calls.append(("submit", seq))

    def cancel(self, request_id: str) -> None:
        self.calls.append(("cancel", request_id))

    def stop(self) -> None:
        self.calls.append(("stop",))


def test_the_engine_process_dispatches_by_type_and_stops_on_stop() -> None:
    engine = FakeEngine()
    conn = Pipe(REQUEST, Cancel("r1"), Stop(), Cancel("never read"))
    serve(conn, engine, CharTokenizer(), Outbox(conn))
    assert [c[0] for c in engine.calls] == ["submit", "cancel", "stop"]
    seq = engine.calls[0][1]
    assert (seq.request_id, seq.prompt_ids, seq.max_new_tokens, seq.sampling, seq.stop,
            seq.arrived_at, seq.deadline) == ("r1", [97, 98], 5, REQUEST.sampling, ("stop",),
                                              12.5, 42.0)
    assert engine.calls[1] == ("cancel", "r1")
    assert conn.incoming == [Cancel("never read")]


def test_a_message_of_no_known_type_is_ignored() -> None:
    engine = FakeEngine()
    conn = Pipe(("submit", "r1"), Stop())  # the old tuple shape is not a message any more
    serve(conn, engine, CharTokenizer(), Outbox(conn))
    assert engine.calls == [("stop",)]


def test_a_full_engine_answers_503_once_no_command_is_queued() -> None:
    conn = Pipe(REQUEST)
    with pytest.raises(Drained):
        serve(conn, FakeEngine(full=True), CharTokenizer(), Outbox(conn))
    assert conn.sent == [StepOutputs([], [("r1", ErrorEvent(503, "3 requests are waiting", 2))],
                                     [])]


def test_the_outbox_sends_texts_as_fields_and_last_events_apart_once_per_step() -> None:
    conn = Pipe()
    outbox = Outbox(conn)
    outbox.flush()
    assert conn.sent == []  # nothing happened: nothing to send
    a, b = outbox.sink("a"), outbox.sink("b")
    a(TextEvent("x", 1))
    b(TextEvent("y", 1))
    a(FINISH)
    outbox.observe("GeneratedTokens", 1, "count")
    outbox.flush()
    assert conn.sent == [StepOutputs([("a", "x", 1), ("b", "y", 1)], [("a", FINISH)],
                                     [("GeneratedTokens", 1, "count")])]


# -- the worker's side ----------------------------------------------------------------

def client_with(*request_ids: str, observer=None) -> tuple[EngineClient, dict[str, list]]:
    """An EngineClient with no process: the requests wait (no pipe), as during a restart."""
    client = EngineClient(SimpleNamespace(config=parse_config({})), observer, capacity=8)
    events: dict[str, list] = {}
    for request_id in request_ids:
        events[request_id] = []
        client.submit(EngineRequest(request_id, [1], 4, SamplingParams()),
                      events[request_id].append)
    return client, events


def test_a_steps_texts_reach_a_request_before_its_last_event() -> None:
    seen = []
    client, events = client_with("a", "b", observer=lambda *o: seen.append(o))
    client._deliver(StepOutputs(texts=[("a", "x", 1), ("b", "y", 1), ("a", "z", 2)],
                                finals=[("a", FINISH)], observations=[("BusySlots", 1, "count")]))
    assert events["a"] == [TextEvent("x", 1), TextEvent("z", 2), FINISH]
    assert events["b"] == [TextEvent("y", 1)]
    assert seen == [("BusySlots", 1, "count")]
    # "a" ended: a late text for it (or for a request never seen) goes nowhere
    client._deliver(StepOutputs([("a", "late", 3), ("zzz", "?", 1), ("b", "!", 2)],
                                [("b", ErrorEvent(499, "cancelled"))]))
    assert events["a"][-1] == FINISH
    assert events["b"] == [TextEvent("y", 1), TextEvent("!", 2), ErrorEvent(499, "cancelled")]
    assert client._requests == {}


def test_the_worker_ignores_a_message_that_is_not_a_step() -> None:
    client, events = client_with("a")
    client._deliver(Ready(ModelLimits(1, 8, None)))
    client._deliver(("step", [("a", "x", 1)], []))  # the old tuple shape
    assert events["a"] == [] and "a" in client._requests


def test_a_waiting_request_is_cancelled_by_the_worker_and_a_stop_answers_the_rest() -> None:
    client, events = client_with("a", "b")
    client.cancel("a")
    assert events["a"] == [ErrorEvent(499, "cancelled")]
    client.stop()
    assert events["b"] == [ErrorEvent(503, "the worker is stopping; retry the request", 1)]


def test_a_full_worker_refuses_and_a_down_one_says_why() -> None:
    client, _ = client_with(*(f"r{i}" for i in range(8)))
    with pytest.raises(CapacityError, match="8 requests are in flight"):
        client.submit(EngineRequest("one more", [1], 1, SamplingParams()), print)
    client.down = "ConfigError: no weights"
    with pytest.raises(CapacityError, match=r"down \(ConfigError: no weights\)"):
        client.submit(EngineRequest("r0", [1], 1, SamplingParams()), print)


# -- the inline engine ----------------------------------------------------------------

def test_build_sequence_keeps_every_field_of_the_request() -> None:
    sink = [].append
    seq = build_sequence(REQUEST, sink, CharTokenizer())
    assert (seq.request_id, seq.prompt_ids, seq.max_new_tokens, seq.sampling, seq.stop,
            seq.sink, seq.arrived_at, seq.deadline) == (
        "r1", [97, 98], 5, REQUEST.sampling, ("stop",), sink, 12.5, 42.0)


def test_the_inline_engine_is_a_handle_over_the_engine() -> None:
    backend = CountingBackend(batch_size=2, max_length=64)
    inline = InlineEngine(Engine(backend, Scheduler(2)), CharTokenizer())
    assert inline.limits == ModelLimits(2, 64, 63, backend.capabilities)
    assert inline.down is None
    events: list = []
    inline.submit(EngineRequest("r", [ord("a")], 3, SamplingParams()), events.append)
    for _ in range(3):
        inline.engine.step()
    assert "".join(e.text for e in events[:-1]) == "bcd"
    assert events[-1] == FinishEvent("length", 1, 3, "bcd", (98, 99, 100))
    inline.submit(EngineRequest("gone", [ord("a")], 3, SamplingParams()), events.append)
    inline.cancel("gone")
    assert events[-1] == ErrorEvent(499, "cancelled")
