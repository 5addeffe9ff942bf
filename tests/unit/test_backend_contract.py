"""The slot contract, enforced once by `Backend` around every backend's own methods."""

import pytest

from handlers.backends.base import SamplingParams, SlotError
from tests.unit.fakes import CountingBackend, PackingBackend

P = SamplingParams()


def test_prefill_takes_free_distinct_in_range_slots_and_a_failure_takes_none():
    b = CountingBackend(batch_size=2)
    for slots, message in (([0, 0], "distinct"), ([2], r"\[0, 2\)"), ([-1], "distinct")):
        with pytest.raises(SlotError, match=message):
            b.prefill(slots, [[1]] * len(slots), [P] * len(slots))
    with pytest.raises(SlotError, match="1 slots, 2 prompts"):
        b.prefill([0], [[1], [2]], [P])
    failing = CountingBackend(batch_size=2, fail_prefill_on=7)
    with pytest.raises(RuntimeError):
        failing.prefill([0], [[7]], [P])
    assert failing.prefill([0], [[1]], [P]) == [2]  # the failed prefill took no slot
    with pytest.raises(SlotError, match=r"busy slots \[0\]"):
        failing.prefill([0, 1], [[1], [1]], [P, P])
    assert [c[0] for c in failing.calls] == ["prefill", "prefill"]  # refused before the model


def test_decode_covers_every_running_slot_once_and_release_frees():
    b = CountingBackend(batch_size=4)
    b.prefill([0, 2], [[1], [5]], [P, P])
    for wrong in ([0], [0, 1, 2], [0, 0, 2], []):
        with pytest.raises(SlotError, match=r"running \[0, 2\]"):
            b.decode(wrong)
    assert b.decode([2, 0]) == [[7], [3]]
    b.release([0, 3])  # a free slot is ignored
    assert b.decode([2]) == [[8]]
    assert b.prefill([0], [[1]], [P]) == [2]


def test_a_packed_step_checks_both_halves_and_only_where_the_backend_mixes():
    b = PackingBackend(batch_size=4)
    b.prefill([0], [[1]], [P])
    with pytest.raises(SlotError, match="busy"):
        b.step([0], [[1]], [P], [0])
    with pytest.raises(SlotError, match="running"):
        b.step([1], [[1]], [P], [])
    first, following = b.step([1], [[10]], [P], [0])
    assert (first, following) == ([11], [[3]])
    assert b.decode([0, 1]) == [[4], [12]]
    with pytest.raises(NotImplementedError):
        CountingBackend().step([0], [[1]], [P], [])
