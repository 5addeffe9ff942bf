"""`validate`'s K/V replication warning: every number in it agrees with the others.

At tp 24 a model of 8 heads and 2 K/V heads was reported as "replicates them 4x to 8 (1 per
NeuronCore in the KV cache, which is 12x ...)": 8 heads are not 1 per core on 24 cores, and 4x
is not 12x. transformers-neuronx replicates (4x to 8) and then pads with zero heads like Q (to
24): aws-neuron/transformers-neuronx decoder.py, to_neuron(): `repeat(...)`, then
`qkv_maybe_pad` once n_head == n_kv_head.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from archive_tools.neuron_sizing import head_layout
from archive_tools.validate_cmd import ARCHITECTURES, layout_warnings

WARNING = re.compile(
    r"tp_degree (?P<tp>\d+): (?P<kv>\d+) K/V heads do not divide over \d+ cores; "
    r"transformers-neuronx (?:replicates them (?P<ratio>\d+)x to (?P<used>\d+))?(?: and )?"
    r"(?:pads them with (?P<zero>\d+) zero heads? to (?P<cache>\d+))? "
    r"\((?P<per_core>\d+) per NeuronCore in the KV cache, which is (?P<factor>[\d.]+)x the "
    r"unreplicated size\)$")


def _replication_warning(heads: int, kv: int, tp: int) -> str | None:
    arch = dataclasses.replace(ARCHITECTURES["llama-3-8b"], heads=heads, kv_heads=kv,
                               hidden=heads * 128)
    found = [w for w in layout_warnings(head_layout(arch, tp, "", 4), []) if "K/V heads" in w]
    return found[0] if found else None


def _check_consistent(text: str) -> dict[str, int]:
    m = WARNING.match(text)
    assert m, text
    n = {k: int(v) if v and k != "factor" else v for k, v in m.groupdict().items()}
    assert n["ratio"] or n["zero"], text  # it says what the library does
    used = n["used"] or n["kv"]  # only padded: no copies
    cache = n["cache"] or used
    assert n["kv"] * (n["ratio"] or 1) == used, text
    assert used + (n["zero"] or 0) == cache, text
    assert cache % n["tp"] == 0 and cache // n["tp"] == n["per_core"], text
    assert float(n["factor"]) == pytest.approx(cache / n["kv"], rel=0.01), text
    return n


def test_the_tp24_case_of_the_issue_names_the_padding() -> None:
    text = _replication_warning(8, 2, 24)
    assert text == ("tp_degree 24: 2 K/V heads do not divide over 24 cores; transformers-neuronx "
                    "replicates them 4x to 8 and pads them with 16 zero heads to 24 (1 per "
                    "NeuronCore in the KV cache, which is 12x the unreplicated size)")
    _check_consistent(text)


def test_shipped_70b_at_tp12_and_tp24() -> None:
    arch = ARCHITECTURES["llama-2-70b"]  # 64 heads, 8 K/V heads
    twelve = [w for w in layout_warnings(head_layout(arch, 12, "", 1), []) if "K/V" in w][-1]
    assert "replicates them 8x to 64 and pads them with 8 zero heads to 72 (6 per " in twelve
    _check_consistent(twelve)
    t24 = [w for w in layout_warnings(head_layout(arch, 24, "", 1), []) if "K/V heads do" in w]
    assert "replicates them 3x to 24 (1 per NeuronCore" in t24[0]  # no padding: said as before
    _check_consistent(t24[0])


@pytest.mark.parametrize("tp", [2, 4, 8, 12, 16, 24, 32])
def test_every_replication_warning_is_self_consistent(tp: int) -> None:
    checked = 0
    for heads in range(2, 129):
        for kv in range(1, heads):
            if heads % kv == 0 and (text := _replication_warning(heads, kv, tp)):
                _check_consistent(text)
                checked += 1
    assert checked


def test_heads_only_padded_are_not_called_replicated() -> None:
    text = _replication_warning(6, 3, 4)  # the library pads 3 K/V heads to 4, copies none
    assert text is not None and "replicates" not in text
    assert "pads them with 1 zero head to 4 (1 per NeuronCore" in text
    _check_consistent(text)
