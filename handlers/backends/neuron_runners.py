"""What runs a compiled transformers-neuronx model, one runner per handler.batching.

- continuous: NeuronConfig(continuous_batching=...) with one KV-cache row per slot;
  `forward(input_ids, cache_ids, start_ids=seq_ids)` per prefill/decode and host-side
  sampling with each request's own parameters (handlers.backends.sampling.RowSampler),
  or, with handler.neuron.on_device_sampling, the device's sampler with each slot's
  top-k/top-p/temperature, forward() then returning token ids.
- micro: the SDK's own `sample(..., streamer=)` on the compiled batch, run in a
  thread; the streamer hands each [batch, 1] step to a queue that `decode` drains.
  One parameter set per call, so micro-batches hold requests that sample alike.

With handler.neuron.speculation, the continuous runner decodes through the SDK's
FusedSpeculativeDecoder (a draft model proposes k tokens, the target verifies them in the
same compiled graph): each decode yields 1 to k + 1 tokens per slot (SpeculativeRunner).
NeuronBackend (handlers/backends/neuron_backend.py) loads the model and picks the runner.
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handlers.backends.base import Capabilities, Rows, SamplingParams
from handlers.backends.capabilities import (
    GRAMMAR_SPECULATION_WHY,
    GREEDY_ROW,
    device_sampling_row,
    on_device_capabilities,
    refusing,
    sampling_group,
)
from handlers.config import HandlerConfig
from handlers.errors import ConfigError, GenerationError, RequestError
from neuron_cache.key import neuron_config_spec

log = logging.getLogger(__name__)
STEP_TIMEOUT_S = 600.0  # one sample() step; beyond this the SDK thread is considered stuck


def check_keywords(fn: Any, names: Sequence[str], what: str) -> None:
    """The SDK swallows keywords it does not know (**kwargs): refuse to pass one it lacks.

    LlamaForSampling.__init__ ends in **kwargs and ignores them
    (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/llama/model.py:L32-L34),
    and so does sample() (llama/model.py:L405-L407): a misspelt or renamed argument
    would silently compile or sample something else.
    """
    params = inspect.signature(fn).parameters
    named = [n for n, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"]
    unknown = sorted(set(names) - set(named))
    if unknown:
        raise ConfigError(f"{what} takes no {unknown} (it takes {named}); use a class and a "
                          "transformers-neuronx that do (0.13.x, Neuron SDK 2.21+)")


def capabilities(config: HandlerConfig) -> Capabilities:
    """What a NeuronBackend of `config` honours (handlers.backends.capabilities_for). The
    device's sampler takes per slot only top-k (after a global top-k), top-p and
    temperature, draws from its own RNG, which has no seed input, and returns token ids
    (layers/generation.py:L17-L199, hlo.py:L2422-L2456; base.py:L712-L713); a greedy row
    is top-k 1 (layers/generation.py:L153-L176), as vLLM maps temperature 0."""
    if config.batching != "continuous":
        return MicroRunner.CAPABILITIES
    if config.neuron.on_device_sampling:
        caps = on_device_capabilities(config.neuron.global_top_k)
    else:
        caps = ContinuousRunner.CAPABILITIES
    if config.neuron.speculation.enabled:
        caps = refusing(caps, "grammar", GRAMMAR_SPECULATION_WHY)
    return caps


def generation_config(flags: dict[str, Any], rows: Sequence[tuple[int, float, float]]) -> Any:
    """GenerationConfig with one (top_k, top_p, temperature) per compiled batch line: under
    per_batch_line each list must be batch_size long (decoder.py:L1074-L1099), and a line's
    parameters are read by its seq id, i.e. its slot (layers/generation.py:L107-L113)."""
    from transformers_neuronx.config import GenerationConfig

    return GenerationConfig(**flags, top_k=[r[0] for r in rows], top_p=[r[1] for r in rows],
                            temperature=[r[2] for r in rows])

def prefill_inputs(prompt: list[int]) -> tuple[list[int], list[int]]:
    """Token ids and cache ids that run `prompt` through context encoding, on its row only.

    transformers-neuronx encodes a context only when a call has more than one token and
    its first cache id is 0 (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/
    base.py:L502-L503). One token would run token generation instead, which pads the call
    to every compiled row with cache id 0 (base.py:L575-L587) and writes each row's K/V
    there (layers/attention.py:L276-L296): position 0 of every running sequence would be
    overwritten. So a 1-token prompt goes twice at cache ids [0, 0]: context encoding
    masks by index (hlo.py:L3140-L3148), so the first copy sees itself alone, at rotary
    position 0 (llama/hlo.py:L175), and its logits are returned because last_token_id is
    the largest cache id, 0 (base.py:L443). Both copies write this row only; the second
    lands on position 0 with identical K/V, or on position 1 when right padding renumbers
    the cache ids 0..bucket-1 (base.py:L472-L473), and the first decode rewrites position 1
    before any token attends to it (the prior mask is position < cache id, hlo.py:L3592).
    """
    if len(prompt) == 1:
        return prompt * 2, [0, 0]
    return prompt, list(range(len(prompt)))


@dataclass
class Row:
    """One slot's sequence under continuous batching."""

    length: int  # tokens in its KV-cache line (prompt + generated)
    last: int  # the last generated token: the next decode's input
    sampler: Any  # handlers.backends.sampling.RowSampler; None when the device samples


class ContinuousRunner:
    """One KV-cache row per slot; each request samples with its own parameters.

    Token ids, cache ids and seq ids all go as int64: token generation scatters cache_ids
    into a tensor of input_ids' dtype, so the two must match (base.py:L576-L585); int64 is
    what vLLM passes, and each input is cast to its compiled buffer's dtype on the way to
    the device (decoder.py:L2197; compiler.py:L396-L397 with the executor). Every call runs
    under inference_mode: the embedding runs on CPU with trainable parameters
    (llama/model.py:L280-L282).

    On-device sampling: forward() returns token ids [n, 1] (base.py:L712-L713), each line
    sampled with the parameters at its seq id, i.e. its slot (layers/generation.py:
    L107-L113). `slot_params` mirrors what the device holds; a prefill whose parameters
    differ from its slot's writes the lists again (update_generation_config,
    decoder.py:L1107-L1114), as vLLM does when its batch changes.
    """

    CAPABILITIES = Capabilities.lacking(
        ("prompt_logprobs",), "handler.backend neuron returns logits for the last prompt "
        "position only, so there are no prompt logprobs; send echo without logprobs, or use "
        "backend torch")

    @staticmethod
    def check(model_cls: type, buckets: list[int]) -> None:
        if buckets[-1] < 2:
            raise ConfigError(f"handler.neuron.context_length_estimate: {buckets} has no bucket "
                              "of 2 or more tokens; continuous batching prefills through one")

    def __init__(self, model: Any, config: HandlerConfig, buckets: list[int], eos: int) -> None:
        self.model, self.buckets, self.eos = model, buckets, eos
        self.max_length = config.max_length
        #: what update_generation_config writes the device's per-line parameters through
        self.generation = model
        self.rows: dict[int, Row] = {}
        self.on_device = config.neuron.on_device_sampling
        self.global_top_k = config.neuron.global_top_k
        self.caps = capabilities(config)
        self.grammars: Any = None  # the backend's SlotGrammars, with host sampling
        # as build_neuron_config compiled them: every line greedy
        self.slot_params = [GREEDY_ROW] * config.batch_size
        self._flags = neuron_config_spec(config).get("on_device_generation")

    def _set_slot_params(self, slot: int, p: SamplingParams) -> None:
        row = device_sampling_row(p, self.caps, self.global_top_k)
        if self.slot_params[slot] != row:
            rows = list(self.slot_params)
            rows[slot] = row
            self.generation.update_generation_config(generation_config(self._flags, rows))
            self.slot_params = rows  # only once the device holds them

    def prefill(self, slots: list[int], prompts: list[list[int]], params: list[SamplingParams],
                eos_ids: frozenset[int]) -> list[int]:
        import torch

        from handlers.backends.sampling import RowSampler, sample_rows

        out = []
        for slot, prompt, p in zip(slots, prompts, params, strict=True):
            if len(prompt) > self.buckets[-1]:
                raise RequestError("prompt", f"{len(prompt)} tokens exceed the largest prefill "
                                   f"bucket {self.buckets[-1]} (handler.neuron."
                                   "context_length_estimate)")
            tokens, positions = prefill_inputs(prompt)
            sampler = None
            if self.on_device:
                self._set_slot_params(slot, p)
            else:
                sampler = RowSampler(p, eos_ids, torch.device("cpu"), prompt)
            constrained = self.grammars is not None and slot in self.grammars
            if constrained:
                self.grammars.start([slot])  # filled while the context encodes
            with torch.inference_mode():  # logits are inference tensors: sample inside
                logits = self._context(torch.tensor([tokens], dtype=torch.int64),  # [1, L]
                                       torch.tensor([positions], dtype=torch.int64),
                                       torch.tensor([slot], dtype=torch.int64))
                # logits: [1, vocab]; or the device's token ids, [1, 1]
                if constrained:
                    token = sample_rows(logits, [sampler], masks=self.grammars.masks())[0]
                    self.grammars.took([slot], [token])
                else:
                    token = int(logits[0, 0]) if sampler is None else sampler(logits[0])
            self.rows[slot] = Row(len(prompt), token, sampler)
            out.append(token)
        return out

    def _context(self, ids: Any, cache_ids: Any, seq_ids: Any) -> Any:
        """Context encoding of one slot's prompt: [1, L] ids and cache ids, [1] seq id."""
        return self.model.forward(ids, cache_ids, seq_ids)

    def decode_rows(self, slots: list[int]) -> Rows:
        return [[token] for token in self.decode(slots)]

    def decode(self, slots: list[int]) -> list[int]:
        """One token per slot, in `slots`' order.

        With host sampling the call names seq ids 0..m-1 (m: the highest running slot + 1),
        the free lines among them with token 0 at cache id 0 -- what forward() writes into
        every line a call leaves out anyway (base.py:L575-L585) -- because forward() then
        hands back the first m rows of its transposed view of the logits, where any other
        seq ids make it gather their rows through that view (base.py:L631-L637): 36-44 ms
        for 32 of 64 lines at 128,256 on the 2-core bench host, against none. The free
        lines' rows are sampled greedily and dropped (a column of the same scan)."""
        order = sorted(slots)
        lines = order if self.on_device else list(range(order[-1] + 1))
        by_line = dict(zip(lines, self._decode_lines(lines), strict=True))
        return [by_line[s] for s in slots]

    def _decode_lines(self, lines: list[int]) -> list[int]:
        import torch

        from handlers.backends.sampling import RowSampler, sample_rows

        rows = [self.rows.get(s) for s in lines]  # None: a free line
        ids = torch.tensor([[r.last if r else 0] for r in rows], dtype=torch.int64)  # [n, 1]
        cache_ids = torch.tensor([[r.length if r else 0] for r in rows],
                                 dtype=torch.int64)  # [n, 1]
        constrained = self.grammars is not None and self.grammars.any(lines)
        if constrained:  # the masks fill on their thread while the device runs the step
            self.grammars.start(lines)
        with torch.inference_mode():
            logits = self.model.forward(ids, cache_ids, torch.tensor(lines, dtype=torch.int64))
            if self.on_device:  # token ids [n, 1] in slot order (base.py:L627-L639)
                out = [int(t) for t in logits[:, 0]]
            else:  # logits: [n, vocab] in line order; every row in one batched pass
                idle = RowSampler(SamplingParams(), frozenset(), torch.device("cpu"))
                out = sample_rows(logits, [r.sampler if r else idle for r in rows],
                                  masks=self.grammars.masks() if constrained else None)
                if constrained:
                    self.grammars.took(lines, out)
        for row, token in zip(rows, out, strict=True):
            if row is not None:
                row.length, row.last = row.length + 1, token
        return out

    def release(self, slots: list[int]) -> None:
        for s in slots:
            self.rows.pop(s, None)

    def warmup(self) -> None:
        free = next(s for s in range(len(self.rows) + 1) if s not in self.rows)
        for bucket in self.buckets:  # a prompt of the bucket's length runs that bucket's graph
            prompt = [self.eos] * max(2, min(bucket, self.max_length - 1))
            self.prefill([free], [prompt], [SamplingParams()], frozenset())
            self.decode_rows([free])
            self.release([free])


class Speculation:
    """Target, draft and their FusedSpeculativeDecoder as one model for compile_or_load.

    What the compile cache holds, and what not: the entry (keyed with the draft's
    config.json and k) holds the target's NEFFs (its context and token graphs) at its root
    and the draft's in draft/, each model's own save()/load(). The fused graphs (k + 1
    draft steps, the target's check and the acceptance, one per n_positions bucket) are
    not in it: FusedSpeculativeDecoder has no save()/load(), and its to_neuron() compiles
    through libneuronxla's compile cache only (aws-neuron/transformers-neuronx@1ade6d7:
    src/transformers_neuronx/fused_speculation.py:L464-L495, compiler.py:L147-L150), which
    NEURON_COMPILE_CACHE_URL points at <handler.neuron.cache_dir>/neuronx-cc
    (handlers/backends/neuron_env.py). A fresh process on the same cache_dir finds them
    there; an entry copied without that folder (or `cache pack`, which takes entries only)
    compiles the fused graphs again, though not the models.
    """

    DRAFT_DIR = "draft"

    def __init__(self, target: Any, draft: Any, k: int, workers: int) -> None:
        try:
            from transformers_neuronx.fused_speculation import FusedSpeculativeDecoder
        except ImportError as exc:
            raise ConfigError("handler.neuron.speculation: this transformers-neuronx has no "
                              f"FusedSpeculativeDecoder ({exc}); use 0.13.x (Neuron SDK "
                              "2.21+)") from exc
        check_keywords(FusedSpeculativeDecoder, ["pad_token_id"], "FusedSpeculativeDecoder")
        if not hasattr(FusedSpeculativeDecoder, "speculative_iteration"):
            raise ConfigError("handler.neuron.speculation: this transformers-neuronx's "
                              "FusedSpeculativeDecoder has no speculative_iteration (continuous "
                              "batching); use 0.13.x (Neuron SDK 2.21+)")
        self.target, self.draft, self.workers = target, draft, workers
        # built now, so what it asserts (same vocab and tp, on-device embedding and
        # sampling, fused_speculation.py:L296-L325) fails before minutes of compiling.
        # pad_token_id -1: its post-processing first replaces every token equal to the pad
        # id with row 0's first token (L227-L228), so the default 0 would corrupt an
        # accepted token 0; the rows are cut by their counts, never by pads
        try:
            self.fused = FusedSpeculativeDecoder(draft, target, k, pad_token_id=-1)
        except AssertionError as exc:
            raise ConfigError(f"handler.neuron.speculation: transformers-neuronx's "
                              f"FusedSpeculativeDecoder refuses this draft and model: "
                              f"{exc}") from exc

    def load(self, directory: str) -> None:
        self.target.load(directory)
        self.draft.load(str(Path(directory) / self.DRAFT_DIR))

    def to_neuron(self) -> None:
        self.target.to_neuron()
        self.draft.to_neuron()
        start = time.monotonic()
        # the SDK's default (None) builds every bucket at once; 0 means that here too
        self.fused.to_neuron(workers=self.workers or None)
        log.info("fused speculation graphs ready in %.1fs (through the compiler cache at %s, "
                 "not the compile-cache entry)", time.monotonic() - start,
                 os.environ.get("NEURON_COMPILE_CACHE_URL", "the SDK's default"))

    def save(self, directory: str) -> None:
        self.target.save(directory)
        self.draft.save(str(Path(directory) / self.DRAFT_DIR))


class SpeculativeRunner(ContinuousRunner):
    """Continuous batching through FusedSpeculativeDecoder.speculative_iteration.

    Prefill (a cache id 0 in the call) runs the target's then the draft's own context
    encoding on the slot's row, so both KV caches hold the prompt, and returns the target's
    token (fused_speculation.py:L776-L811). A decode runs one fused step for every compiled
    row: the rows asked for are scattered to their seq ids and the others get token 0 at
    cache ids 0..k in both caches (L813-L831, L871-L894), so every running slot must be in
    each decode (the base class checks). It returns tokens [n, k + 1] and counts [n, 1] in
    the order asked (L897-L915); a row's first count tokens are its accepted draft tokens
    and the target's own. Sampling parameters go per slot through the decoder's
    update_generation_config, to the target and, its config being dynamic, the draft
    (L498-L501): a greedy slot is top-k 1 on both, where acceptance keeps a draft token
    exactly when it is the target's argmax (hlo.py:L3806-L3845), so greedy output equals
    greedy output without speculation.
    """

    def __init__(self, model: Any, config: HandlerConfig, buckets: list[int], eos: int,
                 fused: Any) -> None:
        super().__init__(model, config, buckets, eos)
        self.fused = self.generation = fused
        self.k = config.neuron.speculation.length
        self.max_length = config.max_length - self.k  # as NeuronBackend.max_length

    def _context(self, ids: Any, cache_ids: Any, seq_ids: Any) -> Any:
        tokens, _ = self.fused.speculative_iteration(ids, cache_ids, seq_ids)
        return tokens  # [1, 1]: the target's token

    def decode_rows(self, slots: list[int]) -> Rows:
        import torch

        rows = [self.rows[s] for s in slots]
        ids = torch.tensor([[r.last] for r in rows], dtype=torch.int64)  # [n, 1]
        cache_ids = torch.tensor([[r.length] for r in rows], dtype=torch.int64)  # [n, 1]
        with torch.inference_mode():
            tokens, counts = self.fused.speculative_iteration(
                ids, cache_ids, torch.tensor(slots, dtype=torch.int64))
        n = [int(c) for c in counts[:, 0]]
        if not all(1 <= c <= self.k + 1 for c in n):
            raise GenerationError(f"speculative_iteration returned counts {n} for slots "
                                  f"{slots}; expected 1 to {self.k + 1} each")
        out: Rows = [[int(t) for t in tokens[i, :c]] for i, c in enumerate(n)]
        for row, c, new in zip(rows, n, out, strict=True):
            # the last input and the accepted drafts now sit at length .. length+c-1 of
            # both caches; what lies beyond is overwritten by the next step
            row.length, row.last = row.length + c, new[-1]
        return out

    def decode(self, slots: list[int]) -> list[int]:
        raise GenerationError("a speculative decode yields several tokens a row: decode_rows")


class _Cancelled(Exception):
    """Raised from the streamer to stop sample() once every slot is released."""


class _QueueStreamer:
    """The SDK's streamer: put() gets a [batch, 1] tensor per step, end() once."""

    def __init__(self) -> None:
        self.steps: queue.Queue[Any] = queue.Queue(maxsize=1)  # backpressure: one step ahead
        self.cancelled = threading.Event()

    def put(self, tokens: Any) -> None:
        if self.cancelled.is_set():
            raise _Cancelled
        self.steps.put([int(t) for t in tokens[:, 0]])  # tokens: [batch, 1]

    def end(self) -> None:
        self.steps.put(None)


class MicroRunner:
    """Static micro-batches through `sample(streamer=)`; shorter batches are padded.

    sample() applies one top-k, top-p and temperature to every row of the call, draws
    from torch's global RNG, ends a row at EOS and returns no logits
    (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/sampling.py:
    L311-L373). So a micro-batch holds only requests that sample alike (the scheduler
    groups them: `Capabilities.shared_sampling`), a seeded request runs alone after
    seeding that RNG, and what needs logits or a say over EOS is refused."""

    SAMPLE_KEYWORDS = ("sequence_length", "start_ids", "eos_token_override", "streamer", "top_k",
                       "top_p", "temperature")
    CAPABILITIES = Capabilities.lacking(
        ("min_new_tokens", "ignore_eos", "repetition_penalty", "frequency_penalty",
         "presence_penalty", "logprobs", "prompt_logprobs"),
        "handler.batching micro samples inside transformers-neuronx's sample(), which ends "
        "rows at EOS and returns no logits; use handler.batching continuous",
        shared_sampling=True)
    CAPABILITIES = refusing(CAPABILITIES, "grammar", "handler.batching micro samples inside "
                            "transformers-neuronx's sample(), which takes no token mask; use "
                            "handler.batching continuous with host sampling")

    @classmethod
    def check(cls, model_cls: type, buckets: list[int]) -> None:
        check_keywords(model_cls.sample, cls.SAMPLE_KEYWORDS, f"{model_cls.__name__}.sample()")

    def __init__(self, model: Any, config: HandlerConfig, buckets: list[int], eos: int) -> None:
        self.model, self.eos = model, eos
        self.batch_size, self.max_length = config.batch_size, config.max_length
        self.vocab = int(getattr(model.config, "vocab_size", 0) or 0)
        self.rows: dict[int, int] = {}  # slot -> row of the running batch
        self.streamer: _QueueStreamer | None = None
        self.thread: threading.Thread | None = None

    def _sample_kwargs(self, params: list[SamplingParams]) -> dict[str, Any]:
        """The one parameter set of a micro-batch the scheduler grouped; a mixed batch is a
        bug upstream, never sampled with someone else's parameters."""
        groups = {sampling_group(q) for q in params}
        if len(groups) != 1 or (None in groups and len(params) > 1):
            raise GenerationError(f"micro-batch of {len(params)} requests that sample "
                                  "differently; sample() takes one parameter set per call")
        p = params[0]
        if p.greedy:
            return {"top_k": 1, "top_p": 1.0, "temperature": 1.0}
        import torch

        # sample() draws from the global RNG (multinomial): seeded, it reproduces; unseeded,
        # it must not continue a seeded request's stream
        torch.manual_seed(p.seed) if p.seed is not None else torch.seed()
        return {"top_k": p.top_k or self.vocab or 50, "top_p": float(p.top_p),
                "temperature": float(p.temperature)}

    def prefill(self, slots: list[int], prompts: list[list[int]], params: list[SamplingParams],
                eos_ids: frozenset[int]) -> list[int]:
        import torch

        if self.thread is not None:
            raise GenerationError(f"micro batching runs one batch at a time; slots "
                                  f"{sorted(self.rows)} are still running")
        width = max(len(p) for p in prompts)
        rows = list(prompts) + [[self.eos]] * (self.batch_size - len(prompts))  # pad the batch
        ids = torch.tensor([[self.eos] * (width - len(r)) + r for r in rows])  # [batch, width]
        start_ids = torch.tensor([width - len(r) for r in rows], dtype=torch.int32)  # left pads
        streamer = _QueueStreamer()
        kwargs = self._sample_kwargs(params)

        def run() -> None:
            try:
                with torch.inference_mode():  # per thread; the embedding runs on CPU
                    self.model.sample(ids, sequence_length=self.max_length, start_ids=start_ids,
                                      eos_token_override=self.eos, streamer=streamer, **kwargs)
            except _Cancelled:
                pass
            except Exception as exc:  # handed to the engine thread by decode()
                streamer.steps.put(exc)

        self.streamer, self.rows = streamer, {s: i for i, s in enumerate(slots)}
        self.thread = threading.Thread(target=run, name="neuron-sample", daemon=True)
        self.thread.start()
        return self.decode(slots)

    def decode(self, slots: list[int]) -> list[int]:
        if self.streamer is None:
            raise GenerationError(f"decode of slots {slots} with no micro-batch running")
        try:
            step = self.streamer.steps.get(timeout=STEP_TIMEOUT_S)
        except queue.Empty:
            raise GenerationError(f"sample() produced no token in {STEP_TIMEOUT_S:.0f}s") from None
        if isinstance(step, Exception):
            raise GenerationError(f"sample() failed: {type(step).__name__}: {step}") from step
        if step is None:
            raise GenerationError(
                f"the micro-batch reached n_positions {self.max_length}: with left padding every "
                "row ends when the longest prompt does. Lower max_new_tokens, raise "
                "handler.max_length, or use handler.batching: continuous")
        return [step[self.rows[s]] for s in slots]

    def decode_rows(self, slots: list[int]) -> Rows:
        return [[token] for token in self.decode(slots)]

    def release(self, slots: list[int]) -> None:
        for s in slots:
            self.rows.pop(s, None)
        if self.rows or self.thread is None:
            return
        self.streamer.cancelled.set()
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while self.thread.is_alive() and time.monotonic() < deadline:
            try:  # unblock a put() waiting on the full queue
                self.streamer.steps.get(timeout=0.05)
            except queue.Empty:
                pass
        if self.thread.is_alive():  # the SDK is stuck: let TorchServe restart this worker
            raise GenerationError(f"sample() did not stop within {STEP_TIMEOUT_S:.0f}s of "
                                  "release; the Neuron runtime is stuck")
        self.thread.join()
        self.thread, self.streamer = None, None

    def warmup(self) -> None:
        slots = list(range(self.batch_size))
        self.prefill(slots, [[self.eos] * 4] * self.batch_size, [SamplingParams()] * len(slots),
                     frozenset())
        self.decode(slots)
        self.release(slots)
