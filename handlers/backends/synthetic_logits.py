"""The synthetic device's logits for host sampling, shaped as an SDK returns them (`HostSampling`).

With handler.synthetic.host_sampling_vocab, every synthetic call also "returns" logits and
the host picks each row's token from them with the Neuron backends' batched sampler,
after the device's deadline, so host efficiency pays what host sampling costs on Neuron.
What that costs depends on how the SDK hands the logits over (dtype, layout, the SDK's own
host work), so both SDKs' forms are modelled (handler.synthetic.host_sampling_logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from handlers.backends.base import SamplingParams


class HostSampling:
    """The logits a device that leaves sampling to the host returns, and the host's pick.

    Laid out as the SDK (`layout`, handler.synthetic.host_sampling_logits) hands them to
    the host (handlers/backends/sampling/scan.py has the citations):
    - "nxdi": one float32 buffer [rows, vocab], contiguous: NxD Inference casts the LM
      head's output on the device and returns [rows, 1, vocab];
    - "neuron": transformers-neuronx's: the device's buffer [vocab, 1, rows] in the
      model's dtype (bf16) for every compiled row, which the SDK's forward() leaves in
      bf16 (the neuron backend asks for cast_logits_dtype bf16; float32 would write 33 MB
      at 64 x 128,256 every step) and returns as the transposed view [rows, vocab]
      (its first m rows: the neuron backend names seq ids 0..m-1, m the highest running
      slot + 1, so forward() copies no rows out of it). Rows are the slots.

    Random logits (std 2, about a real model's spread), made once and reused: the point
    is to pay the host's sampling cost, not to generate numbers. A reused buffer may stay
    partly in the CPU's cache where a device's fresh output would not, so this is a lower
    bound of that cost. Each call raises its synthetic tokens' logits to SPIKE (`emit`,
    inside the device's time: on Neuron the device writes its logits, the host none of
    them; done after the deadline it added 0.25 / 0.13 ms to a step's host time at 32 rows,
    float32 / bf16 logits, medians of 150 alternating steps) and
    the next call's `emit` restores them: SPIKE stays the best logit under any penalty a
    request may ask (repetition <= 10, frequency and presence >= -2 over <= 512 tokens) by
    >= 9e4, so even at temperature 100 every other token's probability is exactly 0 in
    float32.

    With `read_once` (handler.synthetic.host_sampling_floor) the host samples nothing: it
    reads the logits once, as numpy's max over the whole buffer (contiguous, the fastest read
    of every value), and keeps the synthetic tokens. An exact sampler must read every logit
    of its rows (any one can be the best), so what this costs a step is the least any exact
    host sampler over these logits can cost: the floor its cells are measured against.
    """

    SPIKE = 1e6

    def __init__(self, rows: int, vocab: int, eos_ids: frozenset[int], seed: int = 0,
                 layout: str = "nxdi", read_once: bool = False) -> None:
        import torch

        generator = torch.Generator().manual_seed(seed)
        self.layout = layout
        self.read_once = read_once
        if layout == "neuron":  # [vocab, 1, rows], the device's dtype
            self.logits = (torch.randn(vocab, 1, rows, generator=generator) * 2).bfloat16()
        else:  # [rows, vocab]
            self.logits = torch.randn(rows, vocab, generator=generator) * 2
        self._eos = eos_ids
        self._held: tuple[Any, Any] | None = None  # the last call's raised logits, as were
        self._emitted: tuple[list[int], list[int]] | None = None  # its tokens and lines

    def sampler(self, params: SamplingParams, prompt: Sequence[int]) -> Any:
        import torch

        from handlers.backends.sampling import RowSampler

        return RowSampler(params, self._eos, torch.device("cpu"), prompt)

    def emit(self, tokens: Sequence[int], lines: Sequence[int] | None = None) -> None:
        """The device's side of a call: logits whose best token of each row is its synthetic
        token (`lines`: each row's slot, default 0..n-1), the last call's put back first."""
        import torch

        n = len(tokens)
        lines = list(range(n)) if lines is None else list(lines)
        self._restore()
        at = ((torch.tensor(tokens), 0, torch.tensor(lines)) if self.layout == "neuron"
              else (torch.arange(n), torch.tensor(tokens)))
        self._held = (at, self.logits[at].clone())
        self.logits[at] = self.SPIKE
        self._emitted = (list(tokens), lines)

    def _restore(self) -> None:
        if self._held is not None:
            at, held = self._held
            self.logits[at] = held
            self._held = self._emitted = None

    def pick(self, samplers: Sequence[Any], tokens: list[int], masks: Any = None,
             lines: Sequence[int] | None = None) -> list[int]:
        """The host's tokens for rows whose synthetic tokens are `tokens` (the same), from
        the logits `emit` left (emitted here first where the call did not); `masks`: the
        constrained rows' StepMasks, which allow their tokens; `lines`: each row's slot
        (default 0..n-1)."""
        import torch

        from handlers.backends.sampling import sample_rows

        n = len(tokens)
        lines = list(range(n)) if lines is None else list(lines)
        if self._emitted != (list(tokens), lines):
            self.emit(tokens, lines)
        if self.read_once:
            self._read(n)
            return list(tokens)
        with torch.inference_mode():
            if self.layout == "neuron":
                chosen = self._pick_neuron(samplers, masks, lines)
            else:
                chosen = sample_rows(self.logits[:n], samplers, masks=masks)
        if chosen != tokens:
            raise RuntimeError(f"host sampling chose {chosen} where the synthetic model has "
                               f"{tokens}")
        return chosen

    def _read(self, n: int) -> None:
        """One read of every logit the sampler would read: the first n rows (nxdi), or the
        device's whole buffer, every compiled line (neuron: a row is a strided column of it,
        so a read of its rows alone touches every cache line anyway)."""
        import torch

        if self.layout == "neuron":
            self.logits.view(torch.int16).numpy().max()
        else:
            self.logits[:n].numpy().max()

    def _pick_neuron(self, samplers: Sequence[Any], masks: Any, lines: list[int]
                     ) -> list[int]:
        """transformers-neuronx's host side, then the sampler: the (no-op) cast, the first m
        rows of the view (m: the highest slot + 1), as the neuron backend names seq ids
        0..m-1 so that forward() gathers no rows; free lines are sampled greedily and
        dropped. Tokens come back in the rows' own order."""
        import numpy as np
        import torch

        from handlers.backends.sampling import RowSampler, sample_rows
        from handlers.structured.masks import StepMasks

        m = max(lines) + 1
        # cast_logits_dtype bf16 (neuron_backend.host_logits_dtype): the cast is a no-op
        view = self.logits.to(torch.bfloat16)[:, -1, :].transpose(0, 1)  # [rows, vocab]
        idle = RowSampler(SamplingParams(), frozenset(), torch.device("cpu"))
        at_line = [idle] * m
        for i, line in enumerate(lines):
            at_line[line] = samplers[i]
        if masks is not None:  # the masks name rows in the caller's order
            rows = np.asarray(lines, dtype=np.int64)[masks.rows]
            ascending = np.argsort(rows)
            masks = StepMasks(rows[ascending], masks.bitmask[ascending])
        got = sample_rows(view[:m], at_line, masks=masks)
        return [got[line] for line in lines]
