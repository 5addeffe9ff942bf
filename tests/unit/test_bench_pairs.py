"""bench/run_bench.py: continuous and micro alternate, and drift over a run cancels."""

from __future__ import annotations

import pytest

from bench import run_bench


def test_a_drift_linear_over_three_runs_cancels():
    # continuous 5% faster than micro on a machine that slows by 2% a run
    sequence = [(mode, (1.05 if mode == "continuous" else 1.0) * (1 - 0.02 * i))
                for i, mode in enumerate(["continuous", "micro"] * 4)]
    ratios = run_bench.bracketed_ratios(sequence)
    assert len(ratios) == 6
    assert ratios == pytest.approx([1.05] * 6, rel=1e-3)
    # adjacent pairs, as rounds of (continuous, micro) were before, read the drift too
    assert sequence[0][1] / sequence[1][1] == pytest.approx(1.05 / 0.98, rel=1e-3)


def test_runs_without_a_neighbour_of_the_other_mode_give_no_ratio():
    assert run_bench.bracketed_ratios([("continuous", 1.0), ("micro", 1.0)]) == []
    assert run_bench.bracketed_ratios(
        [("continuous", 2.0), ("continuous", 1.0), ("micro", 1.0)]) == []


def test_continuous_vs_micro_alternates_the_same_work(monkeypatch):
    calls = []

    class Summary:
        def __init__(self, rate: float) -> None:
            self.output_tokens_per_s = rate

    class Result:
        def __init__(self, rate: float) -> None:
            self.summary = Summary(rate)

    def fake_run(url, token, scenario, prompts, params):
        calls.append((url, scenario.level, tuple(prompts)))
        return Result(110.0 if url == "c" else 100.0)

    monkeypatch.setattr(run_bench, "run_scenario", fake_run)
    out = run_bench.continuous_vs_micro({"continuous": "c", "micro": "m"}, "t",
                                        [f"p{i}" for i in range(64)], ratios={8: 3, 32: 3})
    for streams in (8, 32):
        per = out[str(streams)]
        runs = [c for c in calls if c[1] == streams]
        assert [url for url, _, _ in runs] == ["c", "m", "c", "m", "c"]
        assert len({work for _, _, work in runs}) == 1 and len(runs[0][2]) == 3 * streams
        assert per["ratios"] == pytest.approx([1.1] * 3)
        assert per["median_ratio"] == pytest.approx(1.1)
