import pytest

from handlers.api.request import check_length, decode_body, fit_to_context, parse_request
from handlers.config import parse_config
from handlers.errors import RequestError

CFG = parse_config({"handler": {"max_length": 128, "max_new_tokens_limit": 64,
                                "defaults": {"max_new_tokens": 16}}}).handler


def test_defaults_and_plain_text_body():
    r = parse_request(decode_body(b"Hello there", "text/plain"), CFG)
    assert (r.prompt, r.max_new_tokens, r.stream, r.stream_format) == ("Hello there", 16, True,
                                                                       "text")
    assert r.sampling.greedy


def test_json_body_as_bytes_without_content_type():
    r = parse_request(decode_body(b'{"prompt": "Hi", "max_new_tokens": 3, "top_p": 0.5}'), CFG)
    assert r.max_new_tokens == 3 and r.sampling.top_p == 0.5


@pytest.mark.parametrize("body,field", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "x", "max_new_tokens": -(2**31)}, "max_new_tokens"),  # 2**31: capped (item 11)
    ({"prompt": "x", "max_new_tokens": "5"}, "max_new_tokens"),
    ({"prompt": "x", "max_new_tokens": True}, "max_new_tokens"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "top_p": float("inf")}, "top_p"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -1}, "top_k"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_format": "sse"}, "stream_format"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # the alias, out of range
    ({"prompt": "x", "min_new_tokens": 17}, "min_new_tokens"),
])
def test_bad_fields_name_the_field_and_range(body, field):
    with pytest.raises(RequestError) as err:
        parse_request(body, CFG)
    assert err.value.field == field and err.value.status == 400


def test_unknown_field_suggests_closest():
    with pytest.raises(RequestError, match="did you mean 'max_new_tokens'"):
        parse_request({"prompt": "x", "max_new_token": 3}, CFG)


def test_body_errors():
    with pytest.raises(RequestError, match="malformed JSON"):
        decode_body(b'{"prompt": ', "application/json")
    with pytest.raises(RequestError, match="UTF-8"):
        decode_body(b"\xff\xfe", "")
    with pytest.raises(RequestError, match="JSON object"):
        decode_body(b"[1, 2]", "application/json")


def test_length_checks_name_prompt_or_max_new_tokens():
    check_length(100, 28, 128)
    with pytest.raises(RequestError) as err:
        check_length(128, 1, 128)
    assert err.value.field == "prompt" and "127" in err.value.message
    with pytest.raises(RequestError) as err:
        check_length(100, 29, 128)
    assert err.value.field == "max_new_tokens" and "[1, 28]" in err.value.message


def test_a_capped_budget_also_fits_the_room_the_prompt_leaves():
    """Asked over the limit (64): capped, then shrunk to what fits max_length 128; asked
    within the limit and not fitting: a 400 naming it, as vLLM answers."""
    capped = parse_request({"prompt": "x", "max_new_tokens": 1000, "min_new_tokens": 50}, CFG)
    fitted = fit_to_context(capped, 100, 128)
    assert (fitted.max_new_tokens, fitted.min_new_tokens) == (28, 28)
    assert fitted.sampling.min_new_tokens == 28
    assert fit_to_context(capped, 10, 128).max_new_tokens == 64
    asked = parse_request({"prompt": "x", "max_new_tokens": 64}, CFG)
    with pytest.raises(RequestError) as err:
        fit_to_context(asked, 100, 128)
    assert err.value.field == "max_new_tokens" and "[1, 28]" in err.value.message
    with pytest.raises(RequestError) as err:  # no room at all: the prompt is what is wrong
        fit_to_context(capped, 128, 128)
    assert err.value.field == "prompt"


def test_near_zero_temperature_is_greedy():
    assert parse_request({"prompt": "x", "temperature": 1e-40}, CFG).sampling.greedy
    assert not parse_request({"prompt": "x", "temperature": 0.5}, CFG).sampling.greedy


def test_backend_prompt_limit_is_checked_at_submit():
    with pytest.raises(RequestError) as err:
        check_length(65, 1, 128, max_prompt_length=64)
    assert err.value.field == "prompt" and "64" in err.value.message
