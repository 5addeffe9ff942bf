"""How long the synthetic device takes: presets from published Inf2 figures, and overrides.

Pure Python (no torch), so `handlers.config` validates a `handler.synthetic:` section
at packaging time with the same rules the backend runs by.

Model (kept deliberately simple):
- a decode call costs `decode_step_ms + decode_ms_per_row * (batch_size - 1)`, where
  batch_size is the compiled batch (`handler.batch_size`), not the rows running: on
  Neuron a decode runs the whole compiled batch, padding idle rows (see the note on
  `prefill_inputs` in handlers/backends/neuron_backend.py), so its time does not shrink
  with fewer live sequences. A preset's per-row increment is the slope between its
  published batch-1 and batch-8 figures; beyond 8 it is a linear extrapolation, not a
  measurement.
- a prefill call costs the time of the bucket of its longest prompt (buckets as
  transformers-neuronx's `context_length_estimate`: the smallest bucket that holds it).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from handlers.errors import ConfigError

#: where the presets' decode figures come from
SOURCE = ("transformers-neuronx on inf2.48xlarge, tp_degree 24, per-token latency at batch 1 "
          "and 8, as published in https://pytorch.org/blog/high-performance-llama/ (Llama 2 on "
          "Inferentia2 with TorchServe) and quoted in issue 13")


@dataclass(frozen=True)
class Preset:
    decode_b1_ms: float  # published, batch 1
    decode_b8_ms: float  # published, batch 8
    buckets: tuple[int, ...]
    prefill_ms: tuple[float, ...]  # ESTIMATES, see PREFILL_NOTE

    @property
    def per_row_ms(self) -> float:
        return (self.decode_b8_ms - self.decode_b1_ms) / 7


#: No per-bucket prefill time is published in a form we could read (the optimum-neuron
#: Inf2 benchmark pages plot time-to-first-token, with no table). The preset prefill
#: times are ESTIMATES: a context-encoding call at bucket L taken as ~3 decode steps plus
#: L x 0.08 ms (7B) / 0.12 ms (13B) -- the order of magnitude of those plots' sub-second
#: TTFTs for 256-768 token prompts. Override `prefill_ms` with measured numbers.
PREFILL_NOTE = "preset prefill times are estimates (no published per-bucket figures)"
_BUCKETS = (128, 512, 1024, 2048)
PRESETS: dict[str, Preset] = {
    "llama-2-7b-tp24": Preset(6.5, 12.1, _BUCKETS, (30.0, 60.0, 100.0, 180.0)),
    "llama-2-13b-tp24": Preset(9.2, 14.9, _BUCKETS, (45.0, 90.0, 150.0, 270.0)),
}


@dataclass(frozen=True)
class DeviceTiming:
    """Resolved timing of one synthetic device; every value in milliseconds."""

    decode_step_ms: float
    decode_ms_per_row: float
    buckets: tuple[int, ...]  # ascending prompt lengths
    prefill_ms: tuple[float, ...]  # one per bucket

    def decode_s(self, batch_size: int) -> float:
        return (self.decode_step_ms + self.decode_ms_per_row * (batch_size - 1)) / 1000

    def bucket_index(self, prompt_length: int) -> int:
        """The smallest bucket that holds the prompt; ValueError past the largest."""
        i = bisect.bisect_left(self.buckets, prompt_length)
        if i == len(self.buckets):
            raise ValueError(f"prompt of {prompt_length} tokens exceeds the largest prefill "
                             f"bucket {self.buckets[-1]}")
        return i

    def prefill_s(self, longest_prompt: int) -> float:
        return self.prefill_ms[self.bucket_index(longest_prompt)] / 1000


def resolve_timing(s, max_length: int) -> DeviceTiming:
    """`handler.synthetic` (SyntheticSettings) -> DeviceTiming: explicit keys over the preset.

    Without a preset, `decode_step_ms` is required; buckets default to one of max_length
    and each bucket's prefill to one decode step."""
    key = "handler.synthetic"
    preset = PRESETS.get(s.preset) if s.preset else None
    if s.preset and preset is None:  # config choices catch this; kept for direct callers
        raise ConfigError(f"{key}.preset: {s.preset!r} is not one of {', '.join(PRESETS)}")
    step = s.decode_step_ms if s.decode_step_ms is not None else (
        preset.decode_b1_ms if preset else None)
    if step is None:
        raise ConfigError(f"{key}.decode_step_ms: required when {key}.preset is empty; set the "
                          f"device's decode step in ms (e.g. 10) or a preset "
                          f"({', '.join(PRESETS)})")
    per_row = s.decode_ms_per_row if s.decode_ms_per_row is not None else (
        preset.per_row_ms if preset else 0.0)
    if s.context_length_estimate is not None:
        buckets = _check_buckets(s.context_length_estimate, max_length)
    elif preset:
        buckets = tuple(b for b in preset.buckets if b <= max_length) or (max_length,)
    else:
        buckets = (max_length,)
    if s.prefill_ms is not None:
        prefill = _check_prefill(s.prefill_ms, len(buckets))
    elif preset:  # each bucket costs the preset's smallest bucket that holds it
        prefill = tuple(preset.prefill_ms[min(bisect.bisect_left(preset.buckets, b),
                                              len(preset.buckets) - 1)] for b in buckets)
    else:
        prefill = (step,) * len(buckets)
    return DeviceTiming(step, per_row, buckets, prefill)


def _check_buckets(values: list, max_length: int) -> tuple[int, ...]:
    ok = all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= max_length
             for v in values)
    if not values or not ok or sorted(set(values)) != list(values):
        raise ConfigError(f"handler.synthetic.context_length_estimate: {values!r}; expected "
                          f"ascending, distinct integers in [1, handler.max_length {max_length}]")
    return tuple(values)


def _check_prefill(values: list, buckets: int) -> tuple[float, ...]:
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in values)
    if not ok or len(values) != buckets:
        raise ConfigError(f"handler.synthetic.prefill_ms: {values!r}; expected {buckets} "
                          "number(s) >= 0, one per prefill bucket "
                          "(handler.synthetic.context_length_estimate)")
    return tuple(float(v) for v in values)
