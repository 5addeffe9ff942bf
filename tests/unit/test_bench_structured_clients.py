"""bench/structured_clients_run.py's verdict: a case passes on a valid parsed object that
ended as its way of asking ends, or on the refusal it expects, and on nothing else."""

from __future__ import annotations

from bench.structured_clients_run import verdict


def case(name: str = "JSON_SCHEMA, create_with_completion", **over) -> dict:
    return {"case": name, "error": None, "is_order": True, "validates": True,
            "finish_reason": "stop", **over}


def test_a_parsed_order_that_stopped_passes_and_one_cut_by_length_fails() -> None:
    assert verdict(case()) == (True, "")
    assert verdict(case(finish_reason=None)) == (True, "")  # the case does not expose it
    assert verdict(case(finish_reason="length"))[0] is False
    assert verdict(case(is_order=False))[0] is False
    assert verdict(case(error="ValidationError: 1 error\nmore")) == (
        False, "ValidationError: 1 error")


def test_a_forced_call_must_end_with_tool_calls() -> None:
    assert verdict(case("TOOLS, create_with_completion", finish_reason="tool_calls"))[0]
    assert not verdict(case("TOOLS, create_with_completion", finish_reason="stop"))[0]


def test_an_expected_refusal_passes_only_as_a_400_naming_tool_choice() -> None:
    name = "TOOLS, no tool format (expected: 400 naming tool_choice)"
    assert verdict(case(name, status=400, server_error={"param": "tool_choice"}))[0]
    assert not verdict(case(name, status=400, server_error={"param": "messages"}))[0]
    assert not verdict(case(name, status=200))[0]
