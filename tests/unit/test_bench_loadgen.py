"""loadgen's pure parts: Poisson schedule, prompts, token file, URL and scenario lists."""

from __future__ import annotations

import json
import statistics
from itertools import pairwise

import pytest

from archive_tools import loadgen
from archive_tools.bench_cmd import build_scenarios
from archive_tools.bench_stats import BenchError, Scenario
from archive_tools.loadgen import build_prompts, poisson_schedule, read_token, tokenizer_counter


def test_poisson_schedule_is_seeded_and_increasing():
    a = poisson_schedule(2.0, seed=1, n=50)
    assert a == poisson_schedule(2.0, seed=1, n=50)
    assert a != poisson_schedule(2.0, seed=2, n=50)
    assert len(a) == 50 and a[0] > 0
    assert all(x < y for x, y in pairwise(a))


def test_poisson_gaps_are_exponential_with_mean_one_over_rate():
    times = poisson_schedule(2.0, seed=0, n=20_000)
    gaps = [b - a for a, b in pairwise([0.0] + times)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.5, rel=0.03)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.05)  # CV of exponential
    # P(gap > mean) = e^-1 for an exponential distribution
    assert sum(g > 0.5 for g in gaps) / len(gaps) == pytest.approx(0.3679, abs=0.02)


def test_poisson_duration_bound():
    times = poisson_schedule(20.0, seed=3, duration_s=100.0)
    assert all(t < 100.0 for t in times)
    assert len(times) == pytest.approx(2000, rel=0.1)
    assert poisson_schedule(20.0, seed=3, n=5, duration_s=100.0) == times[:5]


def test_poisson_schedule_is_capped(monkeypatch):
    monkeypatch.setattr(loadgen, "MAX_REQUESTS", 10)
    assert len(poisson_schedule(1000.0, duration_s=1e9)) == 10
    with pytest.raises(BenchError, match="count or a duration"):
        poisson_schedule(1.0)
    with pytest.raises(BenchError, match="> 0"):
        poisson_schedule(0.0, n=1)


def test_build_prompts_size_and_determinism():
    prompts = build_prompts(20, prompt_tokens=30, seed=5)
    assert len(prompts) == 20 and len(set(prompts)) == 20
    assert all(len(p.split()) == 30 for p in prompts)
    assert prompts == build_prompts(20, prompt_tokens=30, seed=5)
    assert all(w.isalpha() for p in prompts for w in p.split())


def test_build_prompts_sized_by_a_tokenizer(tiny_checkpoint):
    count = tokenizer_counter(tiny_checkpoint)
    prompts = build_prompts(8, prompt_tokens=30, seed=1, count_tokens=count)
    # the demo tokenizer splits words: fewer words than tokens, yet 30 tokens (+1 word at most)
    assert all(30 <= count(p) < 30 + max(count(w) for w in p.split()) for p in prompts)
    assert sum(len(p.split()) for p in prompts) < 8 * 30
    assert prompts == build_prompts(8, prompt_tokens=30, seed=1, count_tokens=count)


def test_tokenizer_counter_names_a_missing_tokenizer(tmp_path):
    with pytest.raises(BenchError, match="--tokenizer .* tokenizer.json"):
        tokenizer_counter(tmp_path)


def test_load_prompts_text_and_jsonl(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('hello there\n\n{"prompt": "from json"}\n')
    assert loadgen.load_prompts(path) == ["hello there", "from json"]
    (tmp_path / "bad.txt").write_text('{"text": 1}\n')
    with pytest.raises(BenchError, match=r"bad.txt:1: .*\"prompt\""):
        loadgen.load_prompts(tmp_path / "bad.txt")
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(BenchError, match="no prompts"):
        loadgen.load_prompts(tmp_path / "empty.txt")


def test_read_token_from_torchserve_key_file(tmp_path):
    key_file = tmp_path / "key_file.json"
    key_file.write_text(json.dumps({"management": {"key": "M"}, "inference": {
        "key": "I", "expiration time": "2030-01-01T00:00:00Z"}, "API": {"key": "A"}}))
    assert read_token(token_file=key_file) == "I"
    assert read_token("abc") == "abc"
    assert read_token() is None
    with pytest.raises(BenchError, match="not both"):
        read_token("abc", key_file)
    key_file.write_text(json.dumps({"management": {"key": "M"}}))
    with pytest.raises(BenchError, match="no inference key"):
        read_token(token_file=key_file)
    with pytest.raises(BenchError, match="cannot read token file"):
        read_token(token_file=tmp_path / "missing.json")


def test_check_url_only_http():
    assert loadgen.check_url("http://127.0.0.1:8080/predictions/m")
    for bad in ("127.0.0.1:8080/predictions/m", "file:///etc/passwd", "http://"):
        with pytest.raises(BenchError, match="not http"):
            loadgen.check_url(bad)


def test_build_scenarios_order_and_bound():
    got = build_scenarios("all", [1, 4], [0.5], requests=8, duration_s=None)
    assert [s.name for s in got] == ["sync", "c=1", "c=4", "rate=0.5/s"]
    assert all(s.requests == 8 for s in got)
    assert build_scenarios("rate", [1], [2.0], None, 3.0) == [Scenario("rate", 2.0, duration_s=3.0)]


def test_expected_requests():
    assert loadgen.expected_requests(Scenario("concurrency", 2, requests=7)) == 7
    assert loadgen.expected_requests(Scenario("concurrency", 2, duration_s=1.0)) is None
    rate = Scenario("rate", 10.0, duration_s=2.0)
    assert loadgen.expected_requests(rate, seed=4) == len(poisson_schedule(10.0, 4, None, 2.0))
