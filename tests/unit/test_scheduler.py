import pytest

from handlers.backends.base import SamplingParams
from handlers.errors import CapacityError
from handlers.scheduler import Scheduler, Sequence
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
    s.submit(seq("b"))
    with pytest.raises(CapacityError, match="max_queue=2"):
        s.submit(seq("c"))


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
