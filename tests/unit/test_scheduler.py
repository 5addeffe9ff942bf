import pytest

from handlers.backends.base import SamplingParams
from handlers.engine.scheduler import Scheduler, Sequence
from handlers.errors import CapacityError
from tests.unit.fakes import CharTokenizer


def seq(rid: str, n: int = 4) -> Sequence:
    return Sequence(request_id=rid, prompt_ids=[65], max_new_tokens=n,
                    sampling=SamplingParams(), stop=(), sink=lambda e: None,
                    tokenizer=CharTokenizer())


def test_continuous_fills_free_slots_in_arrival_order():
    s = Scheduler(slots=2, policy="continuous")
    a, b, c = seq("a"), seq("b"), seq("c")
    for x in (a, b, c):
        s.submit(x)
    assert s.admit() == [a, b]
    assert (a.slot, b.slot) == (0, 1)
    assert s.admit() == []  # full
    s.finish(a)
    assert s.admit() == [c]
    assert c.slot == 0  # the freed slot is reused at the next step


def test_micro_waits_for_the_whole_micro_batch():
    s = Scheduler(slots=4, policy="micro", micro_batch_size=2)
    xs = [seq(str(i)) for i in range(5)]
    for x in xs:
        s.submit(x)
    first = s.admit()
    assert first == xs[:2]
    s.finish(first[0])
    assert s.admit() == []  # one of the micro-batch still runs: nobody joins
    s.finish(first[1])
    assert s.admit() == xs[2:4]


def test_queue_bound_raises_capacity_error_with_numbers():
    s = Scheduler(slots=1, max_queue=2)
    s.submit(seq("a"))
    s.admit()
    s.submit(seq("b"))
    s.submit(seq("c"))
    with pytest.raises(CapacityError, match="2 requests are waiting .*max_queue=2"):
        s.submit(seq("d"))


def test_queue_bound_does_not_count_requests_a_free_slot_will_take():
    """The worker lets batch_size + max_queue be in flight; the engine must accept as many
    even when they arrive before it admitted any (CI caught the worker's limit and this
    one disagreeing when the engine thread was slow)."""
    s = Scheduler(slots=2, max_queue=1)
    for x in "abc":
        s.submit(seq(x))  # a and b take the free slots at the next step
    with pytest.raises(CapacityError, match="1 requests are waiting"):
        s.submit(seq("d"))
    assert [x.request_id for x in s.admit()] == ["a", "b"]
    with pytest.raises(CapacityError):
        s.submit(seq("e"))  # c waits for a slot: the queue is full


def test_cancel_waiting_and_running():
    s = Scheduler(slots=1)
    a, b = seq("a"), seq("b")
    s.submit(a)
    s.submit(b)
    s.admit()
    assert s.cancel("b") is b and b not in s.waiting
    assert s.cancel("a") is a
    assert s.take_cancelled() == [(0, a)]
    assert not s.has_work()
    assert s.cancel("nope") is None


def test_sequence_finishes_on_eos_length_and_context():
    x = seq("a", n=3)
    assert x.append(66, frozenset([0]), 100) == ("B", None)
    assert x.append(0, frozenset([0]), 100) == ("", "stop")
    y = seq("b", n=2)
    y.append(66, frozenset(), 100)
    assert y.append(67, frozenset(), 100) == ("C", "length")
    z = seq("c", n=10)
    assert z.append(66, frozenset(), 2) == ("B", "length")  # prompt 1 + 1 = max_length
    assert z.finish_event("length").completion_tokens == 1


def test_sequence_cuts_at_stop_string_and_holds_partial_match():
    x = Sequence(request_id="a", prompt_ids=[65], max_new_tokens=20, sampling=SamplingParams(),
                 stop=("END",), sink=lambda e: None, tokenizer=CharTokenizer())
    out = [x.append(ord(c), frozenset(), 100) for c in "hi EN"]
    assert "".join(t for t, _ in out) == "hi "  # "EN" may start "END": held back
    assert x.append(ord("D"), frozenset(), 100) == ("", "stop")
    assert x.finish_event("stop").text == "hi "


def test_expired_sequences_leave_the_queue_and_their_slots():
    s = Scheduler(slots=2)
    a, b, c, d = seq("a"), seq("b"), seq("c"), seq("d")
    a.deadline, c.deadline, d.deadline = 10.0, 10.0, 30.0
    for x in (a, b, c, d):
        s.submit(x)
    s.admit(now=0.0)  # a and b run; c and d wait
    assert s.take_expired(now=9.9) == ([], [])
    waited, ran = s.take_expired(now=10.0)
    assert waited == [c] and ran == [(0, a)]
    assert list(s.waiting) == [d] and list(s.running.values()) == [b]
    assert s.admit(now=10.0) == [d] and d.slot == 0  # the freed slot, at once


def test_a_cancelled_sequence_is_not_also_expired():
    s = Scheduler(slots=1)
    a = seq("a")
    a.deadline = 1.0
    s.submit(a)
    s.admit(now=0.0)
    s.cancel("a")
    assert s.take_expired(now=2.0) == ([], [])
    assert s.take_cancelled() == [(0, a)]


def test_cut_returns_the_text_held_back():
    x = Sequence(request_id="a", prompt_ids=[65], max_new_tokens=20, sampling=SamplingParams(),
                 stop=("END",), sink=lambda e: None, tokenizer=CharTokenizer())
    out = [x.append(ord(c), frozenset(), 100)[0] for c in "hi EN"]
    assert "".join(out) == "hi "
    assert x.cut() == "EN"  # the partial stop match can no longer complete
    assert x.finish_event("timeout").text == "hi EN"


def test_ignore_eos_runs_to_max_new_tokens():
    x = Sequence(request_id="a", prompt_ids=[65], max_new_tokens=3,
                 sampling=SamplingParams(ignore_eos=True), stop=(), sink=lambda e: None,
                 tokenizer=CharTokenizer())
    assert x.add(0, frozenset([0]), 100) is None  # EOS, generated but not an end
    assert x.add(0, frozenset([0]), 100) is None
    assert x.add(66, frozenset([0]), 100) == "length"


def _sampled(rid: str, **params) -> Sequence:
    x = seq(rid)
    x.sampling = SamplingParams(**params)
    return x


def _grouped(**kw) -> Scheduler:
    from handlers.backends.capabilities import sampling_group

    return Scheduler(slots=4, policy="micro", micro_batch_size=4,
                     group=lambda s: sampling_group(s.sampling), **kw)


def test_shared_sampling_micro_batches_hold_one_group_oldest_first():
    """transformers-neuronx's sample() takes one parameter set per call: a greedy request
    must never share it with a temperature-1 one (it would be sampled)."""
    s = _grouped(batch_delay_s=0.0)
    g1, hot, g2, warm, g3 = (_sampled("g1"), _sampled("hot", temperature=1.0),
                             _sampled("g2", top_k=5), _sampled("warm", temperature=0.7),
                             _sampled("g3"))
    for x in (g1, hot, g2, warm, g3):
        s.submit(x)
    assert s.admit() == [g1, g2, g3]  # every greedy request, whatever its top_k
    for x in (g1, g2, g3):
        s.finish(x)
    assert s.admit() == [hot]  # the oldest waiting goes next; warm samples differently
    s.finish(hot)
    assert s.admit() == [warm]


def test_a_seeded_request_runs_alone_at_once_and_the_queue_keeps_its_order():
    s = _grouped(batch_delay_s=60.0)
    seeded, same = _sampled("s", temperature=1.0, seed=7), _sampled("t", temperature=1.0, seed=7)
    s.submit(seeded)
    s.submit(same)
    assert s.wait_time() == 0.0  # nothing can join a seeded request: no delay to wait out
    assert s.admit() == [seeded]
    s.finish(seeded)
    assert s.admit() == [same]


def test_a_group_waits_for_its_delay_unless_full():
    s = _grouped(batch_delay_s=60.0)
    a, b = _sampled("a"), _sampled("b", temperature=1.0)
    s.submit(a)
    s.submit(b)
    now = a.arrived_at
    assert s.admit(now) == []
    assert 59 < s.wait_time(now) <= 60
    for i in range(3):  # the head's group fills up: it starts without waiting
        s.submit(_sampled(f"g{i}"))
    assert [x.request_id for x in s.admit(now)] == ["a", "g0", "g1", "g2"]
    assert list(s.waiting) == [b]


def _text_seq(n: int = 20, stop: tuple[str, ...] = (), **params) -> Sequence:
    return Sequence(request_id="a", prompt_ids=[65, 66], max_new_tokens=n,
                    sampling=SamplingParams(**params), stop=stop, sink=lambda e: None,
                    tokenizer=CharTokenizer())


@pytest.mark.parametrize(("n", "max_length", "row", "kept", "reason"), [
    (20, 100, [67, 68, 69], [67, 68, 69], None),
    (20, 100, [67, 0, 69], [67, 0], "stop"),  # EOS inside the row: cut after it
    (2, 100, [67, 68, 69], [67, 68], "length"),  # max_new_tokens
    (20, 4, [67, 68, 69], [67, 68], "length"),  # max_length: prompt 2 + 2
    (2, 100, [67, 0, 69], [67, 0], "stop"),  # EOS on the last allowed token: stop wins
    (2, 100, [67, 68, 0], [67, 68], "length"),  # EOS past the limit never counts
])
def test_extend_keeps_a_steps_tokens_up_to_the_first_end(n, max_length, row, kept, reason):
    x = _text_seq(n)
    assert x.extend(row, frozenset([0]), max_length) == (kept, reason)
    assert x.generated == kept


def test_extend_with_ignore_eos_runs_past_eos_to_the_length():
    x = _text_seq(4, ignore_eos=True)
    assert x.extend([0, 0, 67], frozenset([0]), 100) == ([0, 0, 67], None)
    assert x.extend([0, 68, 69], frozenset([0]), 100) == ([0], "length")


def test_render_of_several_tokens_stops_at_the_token_that_completes_a_stop_string():
    x = _text_seq(stop=("cd",))
    kept, reason = x.extend([ord(c) for c in "abcdef"], frozenset(), 100)
    assert x.render(kept, reason) == ("ab", "stop")
    assert x.shown == 4  # a, b, c, d: the tokens after the stop string are not counted
    assert x.finish_event("stop").token_ids == tuple(map(ord, "abcd"))
    y = _text_seq(n=3)  # a length end inside a step's tokens flushes the text held back
    assert y.render(*y.extend([ord(c) for c in "xyzw"], frozenset(), 100)) == ("xyz", "length")
