import pytest

from handlers.backends.base import Capabilities, SamplingParams
from handlers.engine.core import Engine
from handlers.engine.scheduler import ErrorEvent, FinishEvent, Scheduler, Sequence, TextEvent
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
    assert "DeviceTokens" not in names  # counted only where a step yields several tokens


def test_with_several_tokens_a_step_the_device_tokens_count_what_an_end_dropped():
    engine, _, seen = make(tokens_per_step=3)
    submit(engine, "a", 100, 5, {})  # prefill 1, then decodes of 3: 1 + 3 + 3 = 7 produced
    run(engine)
    assert ("GeneratedTokens", 5, "count") in seen
    assert sum(v for name, v, _ in seen if name == "DeviceTokens") == 7


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


# -- the output side, one step behind the device ---------------------------------------

def stop_seq(engine, rid, start, n, stop, events):
    s = Sequence(request_id=rid, prompt_ids=[start], max_new_tokens=n, sampling=SamplingParams(),
                 stop=stop, tokenizer=CharTokenizer(), sink=events.setdefault(rid, []).append)
    engine.submit(s)
    return s


def overlapped(engine, steps=100):
    """The loop's order, without threads: step N+1 runs before step N's output is emitted."""
    pending = None
    for _ in range(steps):
        if not engine.scheduler.has_work() and pending is None:
            return
        items = engine.collect() if engine.scheduler.has_work() else None
        if pending is not None:
            engine.emit(pending)
        pending = items


def test_a_stop_string_hit_answers_the_same_and_frees_the_slot_at_the_next_step():
    serial, _, _ = make()
    ev_serial = {}
    stop_seq(serial, "a", ord("a"), 20, ("e",), ev_serial)  # "bcd" then "e" stops it
    stop_seq(serial, "b", ord("A"), 8, (), ev_serial)
    run(serial)

    engine, backend, seen = make()
    ev = {}
    stop_seq(engine, "a", ord("a"), 20, ("e",), ev)
    stop_seq(engine, "b", ord("A"), 8, (), ev)
    overlapped(engine)
    for rid in "ab":
        assert ev[rid] == ev_serial[rid]  # same text, reason, counts and token ids
    done = ev["a"][-1]
    assert (done.reason, done.text, done.completion_tokens) == ("stop", "bcd", 4)
    assert done.token_ids == tuple(map(ord, "bcde"))
    decodes = [c[1] for c in backend.calls if c[0] == "decode"]
    # prefill + decode give "bc"; decodes 2 and 3 give "d" and "e" (the stop); decode 4
    # ran before the output side saw the stop (one wasted row); then the slot was freed
    assert decodes[:4] == [(0, 1)] * 4 and decodes[4] == (1,)
    assert backend.calls[backend.calls.index(("decode", (0, 1)), 0) + 1:].count(
        ("release", (0,))) == 1
    assert ("GeneratedTokens", 4, "count") in seen


def test_a_cancel_after_a_stop_string_hit_sends_no_second_end():
    engine, backend, _ = make()
    ev = {}
    stop_seq(engine, "a", ord("a"), 20, ("c",), ev)
    first = engine.collect()  # prefill "b" + decode "c": the stop string
    second = engine.collect()  # one more row before the output side has seen it
    engine.emit(first)
    engine.cancel("a")
    engine.emit(second)
    engine.emit(engine.collect())  # leaves here; the cancel is moot
    assert [type(e) for e in ev["a"]] == [TextEvent, FinishEvent]
    assert ev["a"][-1].reason == "stop" and engine.scheduler.running == {}
    assert backend.last == {}


def test_the_loop_sends_first_tokens_before_the_decode_and_a_steps_text_during_the_next():
    import threading

    prefill_text, second_decode = threading.Event(), threading.Event()
    during_first_decode = []

    class Recording(CountingBackend):
        def decode(self, slots):
            if self.decodes == 0:  # the prefill's token is out while decode 1 runs
                during_first_decode.append(prefill_text.wait(5))
            if self.decodes == 1:
                second_decode.set()
            return super().decode(slots)

    backend = Recording()
    engine = Engine(backend, Scheduler(backend.batch_size))
    texts, overlapped, done = [], [], threading.Event()

    def sink(event):
        if isinstance(event, TextEvent):
            texts.append(event.text)
            if len(texts) == 1:
                prefill_text.set()
            elif len(texts) == 2:  # decode 1's text: decode 2 has been called by now
                overlapped.append(second_decode.wait(5))
        if isinstance(event, FinishEvent):
            done.set()

    engine.start()
    try:
        engine.submit(Sequence(request_id="t", prompt_ids=[100], max_new_tokens=6,
                               sampling=SamplingParams(), stop=(), tokenizer=CharTokenizer(),
                               sink=sink))
        assert done.wait(10)
    finally:
        engine.stop()
    assert during_first_decode == [True] and overlapped == [True]
    assert "".join(texts) == "efghij"


def test_the_loop_answers_as_the_serial_step_does():
    import threading

    def scenario(engine, ev):
        stop_seq(engine, "stop", ord("a"), 20, ("ef",), ev)
        stop_seq(engine, "len", ord("A"), 7, ("zz",), ev)
        stop_seq(engine, "eos", 9995, 20, (), ev)  # 9996..9999, then EOS (10000)
        stop_seq(engine, "late", ord("0"), 5, (), ev)  # waits for a slot (4 slots)
        stop_seq(engine, "one", ord("k"), 1, (), ev)

    serial, _, _ = make()
    ev_serial = {}
    scenario(serial, ev_serial)
    run(serial)

    engine, _, seen = make()
    ev, done = {}, threading.Event()
    engine.start()
    try:
        scenario(engine, ev)
        for _ in range(200):
            if all(ev.get(k) and not isinstance(ev[k][-1], TextEvent) for k in ev_serial):
                break
            done.wait(0.02)
    finally:
        engine.stop()
    assert ev == ev_serial
    assert ev["eos"][-1].reason == "stop" and ev["stop"][-1].text == "bcd"
    assert sorted(v for n, v, _ in seen if n == "GeneratedTokens") == sorted(
        e[-1].completion_tokens for e in ev.values()) == [1, 5, 5, 5, 7]


def test_a_steps_events_reach_an_event_loop_in_one_wake_up():
    import asyncio

    from handlers.engine.core import QueueSink

    class Loop:
        """Counts cross-thread wake-ups; runs their callbacks at once."""

        wakeups = 0

        def call_soon_threadsafe(self, fn, *args):
            self.wakeups += 1
            fn(*args)

    loop = Loop()
    engine, _, _ = make()
    queues = {}
    for i in range(4):
        queues[i] = asyncio.Queue()
        engine.submit(Sequence(request_id=str(i), prompt_ids=[100 * (i + 1)], max_new_tokens=3,
                               sampling=SamplingParams(), stop=(), tokenizer=CharTokenizer(),
                               sink=QueueSink(loop, queues[i])))
    steps = 0
    while engine.scheduler.has_work():
        engine.step()
        steps += 1
    assert steps == 2 and loop.wakeups == 2  # not one per event (4 x 4 of them)
    for i, q in queues.items():
        got = [q.get_nowait() for _ in range(q.qsize())]
        assert "".join(e.text for e in got if isinstance(e, TextEvent)) == "".join(
            chr(100 * (i + 1) + k) for k in (1, 2, 3))
        assert isinstance(got[-1], FinishEvent)


def test_with_on_text_a_sinks_queue_gets_only_the_end():
    import asyncio

    from handlers.engine.core import QueueSink

    class Loop:
        def call_soon_threadsafe(self, fn, *args):
            fn(*args)

    engine, _, _ = make()
    texts, queue = [], asyncio.Queue()
    engine.submit(Sequence(request_id="a", prompt_ids=[100], max_new_tokens=3,
                           sampling=SamplingParams(), stop=(), tokenizer=CharTokenizer(),
                           sink=QueueSink(Loop(), queue, texts.append)))
    run(engine)
    assert "".join(texts) == "efg" and queue.qsize() == 1
    assert queue.get_nowait().text == "efg"  # the FinishEvent


class LogprobBackend(CountingBackend):
    """CountingBackend that reports a logprob per token (-token/1000) and the prompt's."""

    def token_logprobs(self, slot):
        return (-self.last[slot] / 1000, ((self.last[slot], -0.001),))

    def prompt_logprobs(self, slot):
        return [None, (-0.5, ())]


def test_logprobs_reach_the_finish_event_only_for_a_request_that_asked():
    engine, _, _ = make(backend_class=LogprobBackend)
    events = {}
    for rid, params in (("ask", SamplingParams(logprobs=1, prompt_logprobs=1)),
                        ("plain", SamplingParams())):
        engine.submit(Sequence(request_id=rid, prompt_ids=[64, ord("A")], max_new_tokens=3,
                               sampling=params, stop=(), tokenizer=CharTokenizer(),
                               sink=events.setdefault(rid, []).append))
    run(engine)
    ask, plain = events["ask"][-1], events["plain"][-1]
    assert ask.logprobs == tuple((-t / 1000, ((t, -0.001),)) for t in (66, 67, 68))
    assert ask.prompt_logprobs == (None, (-0.5, ()))
    assert plain.logprobs is None and plain.prompt_logprobs is None
    # text events count the tokens rendered so far (OpenAI continuous usage stats)
    assert [e.tokens for e in events["plain"] if isinstance(e, TextEvent)] == [1, 2, 3]


def test_a_steady_batch_still_sees_a_cancel_a_deadline_and_a_newcomer_at_the_next_step():
    """Steps that only decode the last batch again skip the scheduler; anything that
    changes the batch must still take effect one step later, as in a full step."""
    import threading
    import time

    class Slow(CountingBackend):  # steps long enough for the loop to be in steady state
        def decode(self, slots):
            time.sleep(0.002)
            return super().decode(slots)

    backend = Slow(batch_size=4, max_length=200)
    engine = Engine(backend, Scheduler(backend.batch_size))
    admits = []
    admit = engine.scheduler.admit
    engine.scheduler.admit = lambda *a: admits.append(1) or admit(*a)
    ev: dict[str, list] = {}
    ended = {rid: threading.Event() for rid in ("long", "gone", "due", "new")}

    def seq(rid, start, n, deadline=None):
        def sink(event):
            ev.setdefault(rid, []).append(event)
            if not isinstance(event, TextEvent):
                ended[rid].set()
        return Sequence(request_id=rid, prompt_ids=[start], max_new_tokens=n,
                        sampling=SamplingParams(), stop=(), tokenizer=CharTokenizer(),
                        sink=sink, deadline=deadline)

    engine.start()
    try:
        engine.submit(seq("long", ord("A"), 40))
        engine.submit(seq("gone", ord("a"), 100))
        engine.submit(seq("due", ord("0"), 100, deadline=time.monotonic() + 0.06))
        time.sleep(0.03)
        engine.cancel("gone")
        engine.submit(seq("new", ord("A"), 40))
        assert all(e.wait(10) for e in ended.values())
    finally:
        engine.stop()
    assert ev["gone"][-1] == ErrorEvent(499, "cancelled")
    assert ev["due"][-1].reason == "timeout" and 0 < ev["due"][-1].completion_tokens < 100
    assert text(ev["new"]) == text(ev["long"]) == "".join(map(chr, range(66, 106)))
    released = {slot for kind, slots in backend.calls if kind == "release" for slot in slots}
    assert len(released) >= 3 and backend.last == {}
    decodes = sum(kind == "decode" for kind, _ in backend.calls)
    assert len(admits) < decodes / 2  # most steps only decoded the batch again


def test_the_output_side_takes_a_step_only_when_the_last_is_done_and_stops_after_it():
    import threading

    from handlers.engine.core import OutputThread

    release, emitted = threading.Event(), []

    def emit(items):
        release.wait(5)
        emitted.append(items)

    out = OutputThread(emit)
    out.put([1])  # taken at once; its emit waits
    second = threading.Thread(target=out.put, args=([2],))
    second.start()
    second.join(0.2)
    assert second.is_alive() and emitted == []  # step 2 waits for step 1's output
    release.set()
    second.join(5)
    out.stop()  # after what was handed over
    assert emitted == [[1], [2]]


def test_first_tokens_handed_over_while_the_output_side_is_busy_go_right_after_its_step():
    """`put_nowait` never waits: items given while a step's output runs are emitted right
    after it and before the next step's, which does not wait for them; `wait_idle` does."""
    import threading

    from handlers.engine.core import OutputThread

    release, emitted = threading.Event(), []
    busy = {"first": release, "late": threading.Event()}

    def emit(items):
        if items[0] in busy:
            busy[items[0]].wait(5)
        emitted.append(items[0])

    out = OutputThread(emit)
    out.put(["first"])  # its emit waits for `release`
    out.put_nowait(["prefill"])  # returns at once, queued behind "first"
    assert emitted == []
    release.set()
    out.put(["second"])  # waits for "first" only
    out.put_nowait(["late"])  # behind "second"; its emit waits for busy["late"]
    idle = threading.Thread(target=out.wait_idle)
    idle.start()
    idle.join(0.2)
    assert idle.is_alive()  # wait_idle waits for the queued first tokens too
    busy["late"].set()
    idle.join(5)
    assert not idle.is_alive()
    out.stop()
    assert emitted == ["first", "prefill", "second", "late"]


def test_decodes_that_finish_nobody_are_recorded_on_the_output_side_with_the_same_answers(
        monkeypatch):
    """Tokens of a steady batch's decode that can end no sequence are added to their
    sequences by the output thread; the answers equal the serial step's through an EOS, a
    max_new_tokens and a max_length end, and a batch with a request that asked for
    logprobs keeps recording on the engine thread (they are read after each decode)."""
    import threading
    import time

    class Slow(LogprobBackend):  # steps long enough for the loop to reach steady state
        def decode(self, slots):
            time.sleep(0.001)
            return super().decode(slots)

    def scenario(engine, ev, logprobs=None):
        for rid, start, n in (("len", ord("A"), 30), ("eos", 9980, 40), ("max_length", 48, 500),
                              ("stop", ord("a"), 40)):
            sampling = SamplingParams(logprobs=logprobs if rid == "len" else None)
            engine.submit(Sequence(request_id=rid, prompt_ids=[64, start], max_new_tokens=n,
                                   sampling=sampling, stop=("v",) if rid == "stop" else (),
                                   tokenizer=CharTokenizer(),
                                   sink=ev.setdefault(rid, []).append))

    def serve(logprobs=None):
        serial, ev_serial = Engine(Slow(max_length=40), Scheduler(4)), {}
        scenario(serial, ev_serial, logprobs)
        run(serial)
        recorded_by = []
        extend = Sequence.extend
        monkeypatch.setattr(Sequence, "extend", lambda self, *a: recorded_by.append(
            (self.request_id, threading.current_thread().name)) or extend(self, *a))
        engine, ev = Engine(Slow(max_length=40), Scheduler(4)), {}
        engine.start()
        try:
            scenario(engine, ev, logprobs)
            for _ in range(500):
                if all(e and not isinstance(e[-1], TextEvent) for e in ev.values()):
                    break
                time.sleep(0.01)
        finally:
            engine.stop()
            monkeypatch.undo()
        assert ev == ev_serial
        return ev, recorded_by

    ev, recorded_by = serve()
    assert [ev[r][-1].reason for r in ("len", "eos", "max_length", "stop")] == [
        "length", "stop", "length", "stop"]
    assert ev["max_length"][-1].completion_tokens == 38  # prompt of 2, max_length 40
    by_output = [r for r, thread in recorded_by if thread == "inf2serve-output"]
    assert len(by_output) > len(recorded_by) / 2 and by_output.count("len") > 15
    ev, recorded_by = serve(logprobs=1)
    assert len(ev["len"][-1].logprobs) == 30
    assert {thread for r, thread in recorded_by if r == "len"} == {"inf2serve-engine"}


def _answers(engine, requests):
    """Serve `requests` (rid, prompt start, max_new_tokens, stop strings) to the end."""
    ev = {}
    for rid, start, n, stop in requests:
        engine.submit(Sequence(request_id=rid, prompt_ids=[64, start], max_new_tokens=n,
                               sampling=SamplingParams(), stop=stop, tokenizer=CharTokenizer(),
                               sink=ev.setdefault(rid, []).append))
    run(engine, 500)
    return {rid: (text(e), e[-1]) for rid, e in ev.items()}


MIXED_ENDS = [("len", ord("A"), 7, ()), ("eos", 9990, 40, ()), ("max_length", 40, 500, ()),
              ("stop", ord("a"), 40, ("fg",)), ("stop-at-end", ord("a"), 9, ("ij",))]


@pytest.mark.parametrize("k", [2, 3, 5])
def test_several_tokens_a_step_end_every_request_where_one_a_step_would(k):
    """A backend that yields k tokens per row per step (speculation accepting everything)
    runs past every end -- EOS, max_new_tokens, max_length, a stop string inside a step's
    tokens or at the last of them: the answers are those of one token a step."""
    one = _answers(make(max_length=48)[0], MIXED_ENDS)
    engine, backend, _ = make(max_length=48, eos=10_000, tokens_per_step=k)
    several = _answers(engine, MIXED_ENDS)
    assert several == one
    assert [one[r][1].reason for r in ("len", "eos", "max_length", "stop", "stop-at-end")] == [
        "length", "stop", "length", "stop", "stop"]
    assert one["len"][1].completion_tokens == 7 and one["max_length"][1].completion_tokens == 46
    assert one["eos"][1].token_ids[-1] == 10_000 and one["stop"][0].endswith("de")
    assert backend.decodes < 46 // k + 3  # several tokens really arrived per step
    assert backend.last == {}  # every slot released


@pytest.mark.parametrize("k", [1, 3])
def test_the_loop_with_several_tokens_a_step_answers_as_the_serial_step_does(k):
    """The threaded loop -- a steady batch's decodes recorded on the output side while they
    can end nobody, (left - 1) // k of them -- answers as the serial step does."""
    import time

    class Slow(CountingBackend):
        def decode(self, slots):
            time.sleep(0.001)
            return super().decode(slots)

    serial = _answers(Engine(b := Slow(max_length=48, tokens_per_step=k), Scheduler(4)),
                      MIXED_ENDS[:4])
    engine = Engine(Slow(max_length=48, tokens_per_step=k), Scheduler(4))
    ev = {}
    engine.start()
    try:
        for rid, start, n, stop in MIXED_ENDS[:4]:
            engine.submit(Sequence(request_id=rid, prompt_ids=[64, start], max_new_tokens=n,
                                   sampling=SamplingParams(), stop=stop,
                                   tokenizer=CharTokenizer(), sink=ev.setdefault(rid, []).append))
        for _ in range(500):
            if len(ev) == 4 and all(e and not isinstance(e[-1], TextEvent) for e in ev.values()):
                break
            time.sleep(0.01)
    finally:
        engine.stop()
    assert {rid: (text(e), e[-1]) for rid, e in ev.items()} == serial
    assert b.last == {}


def test_a_backend_of_several_tokens_a_step_must_refuse_logprobs():
    backend = CountingBackend(tokens_per_step=2)
    backend.capabilities = Capabilities()
    with pytest.raises(ValueError, match="must refuse logprobs"):
        Engine(backend, Scheduler(4))


def test_a_decode_with_an_empty_row_fails_that_batch_only():
    class Empty(CountingBackend):
        def _decode(self, slots):
            rows = super()._decode(slots)
            return [[] if i == 0 else r for i, r in enumerate(rows)] if self.decodes == 2 else rows

    engine, backend, _ = make(backend_class=Empty)
    ev = {}
    submit(engine, "a", ord("A"), 8, ev)
    run(engine)
    assert isinstance(ev["a"][-1], ErrorEvent) and ev["a"][-1].status == 500
    assert backend.last == {}
    submit(engine, "b", ord("a"), 3, ev)
    run(engine)
    assert text(ev["b"]) == "bcd"
