"""The device bench's prefill cells (bench/prefill_device.py): both archives are valid
synthetic configs whose decode step is the bound's, and the report gives medians over
rounds with each round's preset/free throughput ratio."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from archive_tools.bench_stats import Dist
from bench.prefill_device import BATCH, KINDS, PrefillCost, archive, step_ms, table
from handlers.config import parse_config
from handlers.presets.synthetic_timing import resolve_timing


@pytest.mark.parametrize("kind", KINDS)
def test_each_archive_parses_and_its_decode_step_is_the_bound(kind):
    h = parse_config({"handler": archive(kind, threads=1).handler}).handler
    timing = resolve_timing(h.synthetic, h.max_length)
    assert timing.decode_s(BATCH) * 1000 == pytest.approx(step_ms())
    free = timing.prefill_s([100, 100], one_call=False)
    assert free == 0 if kind == "free" else free == pytest.approx(2 * 0.0276)


def _run(tok_s: float, ttft_p99: float) -> SimpleNamespace:
    ttft, itl = Dist(0.05, 0.1, ttft_p99, 0.06, 96), Dist(0.03, 0.04, 0.09, 0.03, 12000)
    return SimpleNamespace(summary=SimpleNamespace(output_tokens_per_s=tok_s, ttft=ttft,
                                                   itl=itl, ok=96, requests=96))


def test_the_report_gives_medians_and_each_rounds_ratio():
    cost = PrefillCost(rounds=3, prompts=96)
    cost.runs["preset"] = [_run(800, 0.4), _run(900, 0.3), _run(850, 0.5)]
    cost.runs["free"] = [_run(1000, 0.1), _run(1000, 0.1), _run(1000, 0.1)]
    assert [round(r, 2) for r in cost.ratios()] == [0.8, 0.9, 0.85]
    lines = table(cost)
    preset = next(line for line in lines if line.startswith("| preset |"))
    assert preset.startswith("| preset | 850 |") and "50.0 / 400.0" in preset
    assert "**0.850** (0.800, 0.900, 0.850)" in lines[-2]
    assert cost.meta()["preset_over_free_throughput"] == [0.8, 0.9, 0.85]
