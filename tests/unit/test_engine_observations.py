"""What the engine observes for the server's vLLM-named metrics (handlers/engine/core.py):
one RequestFinished per request with its reason, tokens and intervals; a step's
inter-token latencies in one observation; a speculative decode's draft and acceptance
counts. The engine runs step by step on this thread (`Engine.step`)."""

from __future__ import annotations

from handlers.engine.core import Engine
from handlers.engine.scheduler import ErrorEvent, FinishEvent, Scheduler
from handlers.telemetry.catalog import Finished, SpecDecode
from tests.unit.fakes import CountingBackend
from tests.unit.test_engine import run, submit


def observing(backend: CountingBackend, slots: int = 2):
    seen: list[tuple] = []
    return Engine(backend, Scheduler(slots), observer=lambda *a: seen.append(a)), seen


def named(seen: list[tuple], name: str) -> list:
    return [value for n, value, _ in seen if n == name]


def test_each_request_ends_once_with_its_reason_tokens_and_intervals():
    engine, seen = observing(CountingBackend(batch_size=2, eos=105))
    events: dict = {}
    submit(engine, "eos", 100, 20, events)  # 101..105: EOS on the fifth token
    submit(engine, "len", 200, 3, events)
    submit(engine, "late", 300, 4, events)  # waits for a slot
    run(engine)
    ends = [Finished(*v) for v in named(seen, "RequestFinished")]
    assert sorted(e.reason for e in ends) == ["length", "length", "stop"]
    by_tokens = {e.generation_tokens: e for e in ends}
    finals = {rid: ev[-1] for rid, ev in events.items()}
    assert all(isinstance(f, FinishEvent) for f in finals.values())
    assert sorted(by_tokens) == sorted(f.completion_tokens for f in finals.values())
    for end in ends:
        assert end.prompt_tokens == 1
        assert end.queue_s >= 0 and end.prefill_s >= 0 and end.decode_s >= 0
        assert end.e2e_s >= end.queue_s + end.prefill_s + end.decode_s - 1e-6
    late = by_tokens[4]
    assert late.queue_s > min(e.queue_s for e in ends)  # it waited for a slot


def test_inter_token_latency_is_one_per_token_after_the_first_one_step_at_a_time():
    engine, seen = observing(CountingBackend(batch_size=2))
    events: dict = {}
    submit(engine, "a", 100, 5, events)
    submit(engine, "b", 200, 3, events)
    run(engine)
    steps = named(seen, "InterTokenLatency")  # each step's (gap, how many) pairs
    assert sum(n for step in steps for _, n in step) == (5 - 1) + (3 - 1)
    assert all(gap >= 0 for step in steps for gap, _ in step)
    # rows decoded together share their gap: one pair for both, not one each
    assert any(n == 2 for step in steps for _, n in step)
    assert len(named(seen, "TimeToFirstToken")) == 2


def test_a_cancelled_request_is_an_abort_and_a_failed_one_an_error():
    engine, seen = observing(CountingBackend(batch_size=1, fail_decode_at=2))
    events: dict = {}
    submit(engine, "fails", 100, 10, events)
    submit(engine, "waits", 200, 10, events)
    engine.cancel("waits")  # cancelled while it waited: no step saw it
    run(engine)
    assert isinstance(events["fails"][-1], ErrorEvent) and events["fails"][-1].status == 500
    assert events["waits"][-1].status == 499
    ends = {Finished(*v).reason: Finished(*v) for v in named(seen, "RequestFinished")}
    assert set(ends) == {"error", "abort"}
    assert ends["abort"].queue_s is None and ends["abort"].prompt_tokens is None
    assert ends["error"].prefill_s is not None  # it failed while decoding


def test_a_speculative_decode_counts_drafts_accepted_and_emitted():
    k = 3  # tokens a step: drafts of 2, every one accepted by CountingBackend
    engine, seen = observing(CountingBackend(batch_size=2, tokens_per_step=k))
    events: dict = {}
    submit(engine, "a", 100, 7, events)
    submit(engine, "b", 200, 7, events)
    run(engine)
    spec = [SpecDecode(*v) for v in named(seen, "SpecDecode")]
    assert spec and all(s.draft_tokens == (k - 1) * s.drafts for s in spec)
    assert all(s.accepted == s.emitted - s.drafts for s in spec)
    emitted = sum(s.emitted for s in spec)
    assert emitted == sum(named(seen, "DeviceTokens")) - 2  # the prefills' first tokens
    assert emitted >= 2 * (7 - 1)  # what the requests kept, and what their ends dropped
