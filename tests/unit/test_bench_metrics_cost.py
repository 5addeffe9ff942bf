"""The device bench's metrics cells (bench/metrics_cost.py): each round's on/off ratio is
what the report gives, as the median of the rounds, with every round shown."""

from __future__ import annotations

from bench.metrics_cost import STREAMS, MetricsCost, table


def test_the_figure_is_the_median_of_each_rounds_ratio():
    cost = MetricsCost(rounds=3, scrapes=40, scrape_bytes=52_000)
    for c in STREAMS:
        cost.efficiency[True, c] = [0.95, 0.90, 0.97]
        cost.efficiency[False, c] = [0.96, 0.96, 0.96]
    assert [round(r, 4) for r in cost.ratios(STREAMS[0])] == [0.9896, 0.9375, 1.0104]
    meta = cost.meta()
    assert meta["on_over_off_median"] == {str(c): 0.9896 for c in STREAMS}
    assert meta["efficiency_rounds"][f"on x {STREAMS[0]}"] == [0.95, 0.9, 0.97]
    lines = table(cost)
    row = next(line for line in lines if line.startswith(f"| {STREAMS[0]} |"))
    # medians of each side, the median ratio in bold, every round's ratio
    assert row == f"| {STREAMS[0]} | 0.950 | 0.960 | **0.990** (0.990, 0.938, 1.010) |"
    assert "40 reads of 52,000 bytes" in lines[0]
