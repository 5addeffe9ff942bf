"""How long the synthetic device takes: presets from published Inf2 figures, and overrides.

Pure Python (no torch), so `handlers.config` validates a `handler.synthetic:` section
at packaging time with the same rules the backend runs by.

Model (kept deliberately simple):
- a decode call costs `decode_step_ms + decode_ms_per_row * (batch_size - 1)`, where
  batch_size is the compiled batch (`handler.batch_size`), not the rows running: on
  Neuron a decode runs the whole compiled batch, padding idle rows (see the note on
  `prefill_inputs` in handlers/backends/neuron_runners.py), so its time does not shrink
  with fewer live sequences. A preset's per-row increment is the slope between its
  published batch-1 and batch-8 figures; beyond 8 it is a linear extrapolation, not a
  measurement.
- a prompt's prefill costs the time of its bucket (buckets as transformers-neuronx's
  `context_length_estimate`: the smallest bucket that holds it). Under continuous batching
  the engine hands newcomers to one prefill call, but both SDKs encode one sequence's
  context per device call there (`prefill_s`), so their times add up; a micro-batch's
  prompts are one call, at the bucket of its longest prompt.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from handlers.errors import ConfigError

#: where the presets' figures come from (Neuron 2.18.0, Llama-2 FP16 / BF16 matmuls,
#: 128-token prompts, sequence length 4096): TPOT and TTFT p50 at batch 1
#: aws-neuron/aws-neuron-sdk@81ce03ae:about-neuron/benchmarks/inf2/
#: latency_data_decoder.csv:L12,L14, at batch 8 throughput_data_decoder.csv:L12,L14
SOURCE = ("transformers-neuronx on inf2.48xlarge, tp_degree 24, Neuron 2.18.0: the Neuron SDK's "
          "published Inf2 decoder benchmarks (about-neuron/benchmarks/inf2/"
          "latency_data_decoder.csv and throughput_data_decoder.csv in aws-neuron/aws-neuron-sdk)")


@dataclass(frozen=True)
class Preset:
    decode_b1_ms: float  # published, batch 1
    decode_b8_ms: float  # published, batch 8
    buckets: tuple[int, ...]
    prefill_ms: tuple[float, ...]  # the 128 bucket published, the rest estimates (below)

    @property
    def per_row_ms(self) -> float:
        return (self.decode_b8_ms - self.decode_b1_ms) / 7


#: Prefill: the 128-token bucket is the published batch-1 time to first token for a
#: 128-token prompt (7B 27.6 ms, 13B 25.9 ms; same rows as SOURCE). Larger buckets are
#: ESTIMATES: 13B interpolated linearly to its published 333.8 ms TTFT for a 4096-token
#: prompt (latency_data_decoder.csv:L15); 7B, with no longer-prompt row, on a similar
#: slope. Override `prefill_ms` with measured numbers.
PREFILL_NOTE = ("preset prefill times: the 128 bucket is published, larger buckets are "
                "estimates")
_BUCKETS = (128, 512, 1024, 2048)
#: Llama-3-8B with int8 weights (transformers-neuronx, Neuron 2.18.1, tp_degree 24, f16 amp,
#: sequence length 4096): TPOT 6.42 ms at batch 1 and TTFT 25 ms / 101.81 ms for 128- / 2048-
#: token prompts (latency_data_decoder.csv:L4-L5), TPOT 10.45 ms at batch 8
#: (throughput_data_decoder.csv:L4); the 512 and 1024 buckets interpolated between the two
#: published prefills. The only published int8 Inf2 rows; no bf16 Llama-3-8B row exists to
#: pair them with, so the bf16 presets are Llama-2's.
PRESETS: dict[str, Preset] = {
    "llama-2-7b-tp24": Preset(6.5, 12.1, _BUCKETS, (27.6, 60.0, 100.0, 180.0)),
    "llama-2-13b-tp24": Preset(9.2, 14.9, _BUCKETS, (25.9, 55.7, 95.4, 174.9)),
    "llama-3-8b-int8-tp24": Preset(6.42, 10.45, _BUCKETS, (25.0, 40.4, 60.8, 101.8)),
}


@dataclass(frozen=True)
class DeviceTiming:
    """Resolved timing of one synthetic device; every value in milliseconds.

    With speculation (`speculation_length` k > 0) a decode call is k draft steps and one
    target step that verifies them: on Inf2 a step costs about the same whether it yields
    one token or checks several. Each row keeps its accepted draft tokens, each accepted
    with `acceptance_rate` given the ones before it, plus the target's own token."""

    decode_step_ms: float
    decode_ms_per_row: float
    buckets: tuple[int, ...]  # ascending prompt lengths
    prefill_ms: tuple[float, ...]  # one per bucket
    speculation_length: int = 0
    draft_step_ms: float = 0.0
    acceptance_rate: float = 0.0

    def decode_s(self, batch_size: int) -> float:
        target = self.decode_step_ms + self.decode_ms_per_row * (batch_size - 1)
        return (target + self.speculation_length * self.draft_step_ms) / 1000

    def tokens_per_call(self) -> float:
        """Expected tokens a row keeps per decode call: sum of a^i for i in 0..k."""
        a, k = self.acceptance_rate, self.speculation_length
        return float(k + 1) if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)

    def bucket_index(self, prompt_length: int) -> int:
        """The smallest bucket that holds the prompt; ValueError past the largest."""
        i = bisect.bisect_left(self.buckets, prompt_length)
        if i == len(self.buckets):
            raise ValueError(f"prompt of {prompt_length} tokens exceeds the largest prefill "
                             f"bucket {self.buckets[-1]}")
        return i

    def prefill_s(self, prompt_lengths: Sequence[int], one_call: bool) -> float:
        """Device time of one prefill of these prompts. `one_call` (micro batching): the
        batch is one context call, at its longest prompt's bucket. Otherwise (continuous
        batching) one call per prompt: NxD Inference asserts a single seq_id per context
        call (neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/
        modules/kvcache/kv_cache_manager.py:L488-L489) and transformers-neuronx compiles
        context batch 1 (transformers-neuronx@1ade6d7:src/transformers_neuronx/llama/
        model.py:L83-L84), looping over the sequences one call each (base.py:L649-L669)."""
        if one_call:
            return self.prefill_ms[self.bucket_index(max(prompt_lengths))] / 1000
        return sum(self.prefill_ms[self.bucket_index(n)] for n in prompt_lengths) / 1000


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
    k = getattr(s, "speculation_length", 0)
    draft = getattr(s, "draft_step_ms", None)
    draft = step / 10 if draft is None else draft
    return DeviceTiming(step, per_row, buckets, prefill, k, draft if k else 0.0,
                        getattr(s, "acceptance_rate", 0.0) if k else 0.0)


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
