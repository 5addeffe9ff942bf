import pytest

from handlers.backends.base import SamplingParams
from handlers.engine import Engine
from handlers.scheduler import ErrorEvent, FinishEvent, Scheduler, Sequence, TextEvent
from tests.unit.fakes import CharTokenizer, CountingBackend, PackingBackend


def make(policy="continuous", micro=0, backend_class=CountingBackend, **kw):
    backend = backend_class(**kw)
    seen = []
    engine = Engine(backend, Scheduler(backend.batch_size, policy, micro),
                    observer=lambda *a: seen.append(a))
    return engine, backend, seen


def submit(engine, rid, start, n, events):
    s = Sequence(request_id=rid, prompt_ids=[start], max_new_tokens=n, sampling=SamplingParams(),
                 stop=(), tokenizer=CharTokenizer(), sink=events.setdefault(rid, []).append)
    engine.submit(s)
    return s


def text(events):
    return "".join(e.text for e in events if isinstance(e, TextEvent))


def run(engine, steps=100):
    for _ in range(steps):
        if not engine.scheduler.has_work():
            return
        engine.step()


def test_request_joining_mid_decode_gets_the_same_tokens_as_alone():
    alone, _, _ = make()
    ev_alone = {}
    submit(alone, "b", ord("a"), 5, ev_alone)
    run(alone)

    engine, backend, _ = make()
    ev = {}
    submit(engine, "a", ord("A"), 8, ev)
    engine.step()
    engine.step()
    submit(engine, "b", ord("a"), 5, ev)  # joins while "a" is decoding
    run(engine)
    assert text(ev["b"]) == text(ev_alone["b"]) == "bcdef"
    assert text(ev["a"]) == "BCDEFGHI"
    assert ("prefill", (1,)) in backend.calls  # admitted into the free slot at the next step
    assert isinstance(ev["b"][-1], FinishEvent) and ev["b"][-1].completion_tokens == 5


def test_finished_sequence_is_released_and_its_stream_ends_first():
    engine, backend, _ = make()
    ev = {}
    submit(engine, "long", 100, 6, ev)
    submit(engine, "short", 200, 2, ev)
    engine.step()  # prefill both + one decode: short is done
    assert isinstance(ev["short"][-1], FinishEvent)
    assert not isinstance(ev["long"][-1], FinishEvent)
    assert ("release", (1,)) in backend.calls


def test_micro_policy_runs_static_micro_batches():
    engine, backend, _ = make(policy="micro", micro=2)
    ev = {}
    for i in range(4):
        submit(engine, str(i), 100 * (i + 1), 3 + i, ev)
    run(engine)
    prefills = [sorted(c[1]) for c in backend.calls if c[0] == "prefill"]
    assert prefills == [[0, 1], [0, 1]]  # two micro-batches of two, one after the other
    second = backend.calls.index(next(c for c in backend.calls[1:] if c[0] == "prefill"))
    assert {s for c in backend.calls[:second] if c[0] == "release" for s in c[1]} == {0, 1}
    assert all(isinstance(ev[str(i)][-1], FinishEvent) for i in range(4))


def test_prefill_failure_fails_only_its_newcomers():
    engine, backend, _ = make(fail_prefill_on=666)
    ev = {}
    submit(engine, "ok", 100, 4, ev)
    engine.step()
    submit(engine, "bad", 666, 4, ev)
    run(engine)
    assert isinstance(ev["bad"][-1], ErrorEvent) and ev["bad"][-1].status == 500
    assert isinstance(ev["ok"][-1], FinishEvent) and ev["ok"][-1].completion_tokens == 4
    submit(engine, "later", 300, 2, ev)  # the engine keeps serving
    run(engine)
    assert isinstance(ev["later"][-1], FinishEvent)
    assert backend.last == {}


def test_decode_failure_fails_that_batch_and_frees_slots():
    engine, backend, _ = make(fail_decode_at=2)
    ev = {}
    submit(engine, "a", 100, 10, ev)
    submit(engine, "b", 200, 10, ev)
    run(engine)
    assert [type(ev[k][-1]) for k in "ab"] == [ErrorEvent, ErrorEvent]
    assert engine.scheduler.running == {} and backend.last == {}


def test_metrics_observed():
    engine, _, seen = make()
    submit(engine, "a", 100, 3, {})
    run(engine)
    names = [s[0] for s in seen]
    assert names.count("TimeToFirstToken") == 1 and "EngineQueueTime" in names
    assert ("GeneratedTokens", 3, "count") in seen


def test_thread_loop_serves_and_stops():
    import threading

    engine, _, _ = make()
    done = threading.Event()
    events = []

    def sink(e):
        events.append(e)
        if isinstance(e, FinishEvent):
            done.set()

    engine.start()
    try:
        engine.submit(Sequence(request_id="t", prompt_ids=[100], max_new_tokens=3,
                               sampling=SamplingParams(), stop=(), tokenizer=CharTokenizer(),
                               sink=sink))
        assert done.wait(5)
    finally:
        engine.stop()
    assert text(events) == "efg"


def test_launch_loads_warms_and_steps_the_backend_on_one_thread():
    """torch's OpenMP pool is per thread: a second thread stepping the model is slower."""
    import threading

    def build():
        backend = CountingBackend()
        backend.warmup()
        return backend, Scheduler(backend.batch_size, "continuous", 0)

    done = threading.Event()
    engine = Engine.launch(build)
    try:
        engine.submit(Sequence(request_id="t", prompt_ids=[100], max_new_tokens=3,
                               sampling=SamplingParams(), stop=(), tokenizer=CharTokenizer(),
                               sink=lambda e: isinstance(e, FinishEvent) and done.set()))
        assert done.wait(5)
    finally:
        engine.stop()
    assert engine.backend.decodes == 2
    assert engine.backend.threads == {engine._thread.ident} != {threading.get_ident()}


def test_launch_raises_the_build_error_in_the_caller():
    from handlers.errors import ConfigError

    def build():
        raise ConfigError("handler.device: 'cuda' but no CUDA device is visible")

    with pytest.raises(ConfigError, match="no CUDA device"):
        Engine.launch(build)


def test_continuous_prefill_failure_spares_the_newcomers_admitted_with_it():
    engine, backend, _ = make(fail_prefill_on=666)
    ev = {}
    submit(engine, "good", 100, 3, ev)
    submit(engine, "bad", 666, 3, ev)  # both admitted in the same step
    run(engine)
    assert isinstance(ev["bad"][-1], ErrorEvent) and ev["bad"][-1].status == 500
    assert isinstance(ev["good"][-1], FinishEvent) and text(ev["good"]) == "efg"
    assert "injected" not in ev["bad"][-1].message  # details stay in the log


def test_cancelling_a_running_request_ends_its_stream_and_frees_the_slot():
    engine, backend, _ = make()
    ev = {}
    submit(engine, "a", 100, 50, ev)
    engine.step()
    engine.cancel("a")
    engine.step()
    assert isinstance(ev["a"][-1], ErrorEvent) and ev["a"][-1].status == 499
    assert engine.scheduler.running == {} and backend.last == {}


def test_newcomers_join_a_running_batch_in_one_packed_call():
    engine, backend, _ = make(backend_class=PackingBackend)
    ev = {}
    submit(engine, "a", ord("A"), 8, ev)
    engine.step()  # nothing runs yet: a plain prefill (+ decode)
    submit(engine, "b", ord("a"), 5, ev)
    submit(engine, "c", ord("0"), 3, ev)
    run(engine)
    steps = [c for c in backend.calls if c[0] == "step"]
    assert steps == [("step", (1, 2), (0,))]
    assert [c[0] for c in backend.calls].count("prefill") == 1
    assert (text(ev["a"]), text(ev["b"]), text(ev["c"])) == ("BCDEFGHI", "bcdef", "123")
    assert all(isinstance(ev[k][-1], FinishEvent) for k in "abc")


def test_failed_packed_step_runs_apart_and_fails_only_the_culprit():
    engine, backend, _ = make(backend_class=PackingBackend, fail_prefill_on=666)
    ev = {}
    submit(engine, "ok", 100, 5, ev)
    engine.step()
    submit(engine, "bad", 666, 4, ev)
    submit(engine, "good", ord("a"), 3, ev)
    run(engine)
    assert [c[0] for c in backend.calls].count("step") == 1  # tried once, then apart
    assert isinstance(ev["bad"][-1], ErrorEvent) and ev["bad"][-1].status == 500
    assert isinstance(ev["ok"][-1], FinishEvent) and ev["ok"][-1].completion_tokens == 5
    assert isinstance(ev["good"][-1], FinishEvent) and text(ev["good"]) == "bcd"
    assert backend.last == {}


def test_micro_policy_never_packs():
    engine, backend, _ = make(policy="micro", micro=2, backend_class=PackingBackend)
    ev = {}
    for i in range(4):
        submit(engine, str(i), 100 * (i + 1), 3, ev)
    run(engine)
    assert "step" not in [c[0] for c in backend.calls]
    assert all(isinstance(ev[str(i)][-1], FinishEvent) for i in range(4))


def test_a_cancel_that_lands_mid_step_spares_the_rest_of_the_batch(monkeypatch):
    engine, backend, _ = make()
    ev = {}
    submit(engine, "a", 100, 6, ev)
    submit(engine, "b", 200, 6, ev)
    engine.step()
    take = engine.scheduler.take_cancelled

    def cancel_right_after(*args):  # the client of "a" goes away just after this check
        out = take(*args)
        engine.scheduler.cancel("a")
        return out

    monkeypatch.setattr(engine.scheduler, "take_cancelled", cancel_right_after)
    engine.step()
    monkeypatch.setattr(engine.scheduler, "take_cancelled", take)
    run(engine)
    assert isinstance(ev["a"][-1], ErrorEvent) and ev["a"][-1].status == 499
    assert isinstance(ev["b"][-1], FinishEvent) and ev["b"][-1].completion_tokens == 6
    assert backend.last == {}


def test_an_overdue_request_ends_with_timeout_and_its_slot_goes_to_a_newcomer_that_step():
    engine, backend, _ = make(batch_size=1)
    ev = {}
    a = submit(engine, "a", 100, 50, ev)
    engine.step()
    b = submit(engine, "b", 200, 3, ev)
    engine.step()
    assert b.slot is None  # one slot, held by a
    a.deadline = 0.0  # overdue now
    engine.step()
    assert isinstance(ev["a"][-1], FinishEvent) and ev["a"][-1].reason == "timeout"
    assert ev["a"][-1].completion_tokens == 3 and text(ev["a"]) == ev["a"][-1].text
    assert b.slot == 0 and backend.calls[-3:] == [("release", (0,)), ("prefill", (0,)),
                                                  ("decode", (0,))]
    run(engine)
    assert text(ev["b"]) == chr(201) + chr(202) + chr(203)


def test_a_request_overdue_while_waiting_gets_504_and_generates_nothing():
    engine, backend, seen = make(batch_size=1)
    ev = {}
    submit(engine, "a", 100, 5, ev)
    b = submit(engine, "b", 200, 5, ev)
    b.deadline = b.arrived_at + 0.25
    b.arrived_at -= 1  # arrived a second ago: overdue
    b.deadline -= 1
    engine.step()
    assert len(ev["b"]) == 1 and isinstance(ev["b"][0], ErrorEvent)
    assert ev["b"][0].status == 504 and "0.25 s" in ev["b"][0].message
    run(engine)
    assert [c for c in backend.calls if c[0] == "prefill"] == [("prefill", (0,))]  # a only
    assert isinstance(ev["a"][-1], FinishEvent) and ev["a"][-1].reason == "length"
