"""Fake FusedSpeculativeDecoder: draft k tokens, verify with the target, accept, in one call.

The real class fuses k + 1 draft steps, one target step over k + 1 tokens and the DeepMind
acceptance rule into one compiled graph per (batch, n_positions bucket), built through
libneuronxla's compile cache, since the class has no save()/load(). The fake keeps its
signature, asserts, host-side torch code (scatter by seq id, gather back, the pad
post-processing) and which bucket runs, and computes the graph per row on CPU with each
model's KV rows, as the models' own forward() does (base.py of this fake). Acceptance is
the real rule over the distributions the device samples from: for greedy lines (top-k 1)
both are one-hot, so a draft token is kept exactly when it is the target's argmax. For
sampled lines the fake draws its uniforms and samples from torch generators, not the
device's RNG: the same rule, other random numbers. Citations are to
aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import itertools
import json
import os
from pathlib import Path

import torch

from transformers_neuronx import _runtime, bucket

#: libneuronxla's compile cache when NEURON_COMPILE_CACHE_URL is unset
DEFAULT_COMPILE_CACHE = "/var/tmp/neuron-compile-cache"
PROGRAM = "fused-speculator"


def compile_cache_dir() -> Path:
    """Where neuron_xla_compile(..., use_cache=True, cache_dir=None) keeps NEFFs
    (compiler.py:L147-L150): NEURON_COMPILE_CACHE_URL. Fake: local paths only."""
    if "NEURONX_DUMP_TO" in os.environ:  # then neuronx-cc runs there, bypassing the cache
        raise NotImplementedError("fake: NEURONX_DUMP_TO (compiler.py:L116-L145)")
    url = os.environ.get("NEURON_COMPILE_CACHE_URL") or DEFAULT_COMPILE_CACHE
    if "://" in url:
        raise NotImplementedError(f"fake: compile cache URL {url!r} (local directories only)")
    return Path(url)


class FusedSpeculativeBase(torch.nn.Module):

    def speculative_iteration_post_process(self, output_tokens, output_counts):
        """fused_speculation.py:L220-L234, as written: every element equal to the pad id is
        first overwritten with row 0's first token, so an accepted token equal to the pad id
        (0 by default) comes back as another token."""
        if self.sampler:
            raise NotImplementedError("fake: simulation_acceptance_length")
        non_pad_value = output_tokens[0, 0]
        output_tokens[output_tokens == self.pad_token_id] = non_pad_value
        result_tokens = torch.full_like(output_tokens, fill_value=self.pad_token_id)
        for i in range(output_tokens.size(0)):
            result_tokens[i, :output_counts[i].item()] = output_tokens[i, :output_counts[i].item()]
        return result_tokens, output_counts


class FusedSpeculativeDecoder(FusedSpeculativeBase):
    # the real signature (fused_speculation.py:L281-L293)
    def __init__(self, draft, target, k: int = 2, pad_token_id: int = 0, eos_token_id=None,
                 buckets=None, output_scores=False, deterministic_threshold=None, debug=False,
                 simulation_acceptance_length=None) -> None:
        super().__init__()
        # fused_speculation.py:L296-L325, in order, with the real messages
        assert draft.neuron_config.on_device_embedding == True, (  # noqa: E712 (as written)
            "The draft model must enable on-device embedding.")
        assert draft.neuron_config.on_device_generation is not None, (
            "The draft model must enable on-device sampling.")
        assert target.neuron_config.on_device_embedding == True, (  # noqa: E712
            "The target model must enable on-device embedding.")
        assert target.neuron_config.on_device_generation is not None, (
            "The target model must enable on-device sampling.")
        assert target.config.vocab_size == draft.config.vocab_size, (
            "The target model and draft model must have the same vocab size.")
        assert target.decoder_lm_head.tp_degree == draft.decoder_lm_head.tp_degree, (
            "The target model and draft model must have the same tp degree.")
        assert isinstance(k, int), "The k value must be an integer."
        if draft.batch_sizes != [1]:
            assert draft.neuron_config.padding_side == "right", (
                "The draft model must set padding_side as right for batch size > 1.")
        if target.batch_sizes != [1]:
            assert target.neuron_config.padding_side == "right", (
                "The target model must set padding_side as right for batch size > 1.")
        if output_scores:
            raise NotImplementedError("fake: output_scores")
        self.draft, self.target, self.k = draft, target, k  # L330-L337
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.output_scores, self.deterministic_threshold = output_scores, deterministic_threshold
        self.debug = debug
        self.sampler = simulation_acceptance_length  # a PseudoAcceptorSampler (L339-L341)
        if simulation_acceptance_length is not None:
            raise NotImplementedError("fake: simulation_acceptance_length")
        self.neuron_config = target.neuron_config  # L344-L353
        self.neuron_config.is_sequence_parallel = False
        self.tp_degree = target.decoder_lm_head.tp_degree
        self.buckets = buckets if buckets is not None else target.decoder_lm_head.n_positions_list
        self.batch_sizes = target.batch_sizes
        self.max_position = self.buckets[-1]
        self.vocab_size = target.config.vocab_size
        self.is_eagle = draft.neuron_config.is_eagle_draft and target.neuron_config.is_eagle_target
        self.speculator = None  # L356-L357
        self.hidden = {}

    # --- compile: one graph per (batch, bucket), through the compiler cache only ------------
    def _neff_paths(self) -> list[tuple[tuple[int, int], Path]]:
        """The cache file of each graph, named by what it is built from (the fake's stand-in
        for the HLO hash, compiler flags and compiler version libneuronxla keys on)."""
        try:
            cc = importlib.metadata.version("neuronx-cc")
        except importlib.metadata.PackageNotFoundError:
            cc = "unknown"
        flags = os.environ.get("NEURON_CC_FLAGS", "")
        root = compile_cache_dir() / f"neuronxcc-{cc}"
        out = []
        for size in itertools.product(self.batch_sizes, self.buckets):  # L466
            spec = {"program": PROGRAM, "draft": self.draft.graph_spec(),
                    "target": self.target.graph_spec(), "k": self.k, "batch": size[0],
                    "n_positions": size[1], "pad_token_id": self.pad_token_id,
                    "deterministic_threshold": self.deterministic_threshold}
            digest = hashlib.sha256(json.dumps([spec, flags], sort_keys=True).encode())
            out.append((size, root / f"MODULE_{digest.hexdigest()[:20]}" / "model.neff"))
        return out

    def to_neuron(self, workers=None):
        """fused_speculation.py:L464-L495: every graph is built (compiled, or found in the
        compile cache) in a process pool of `workers`, then set up with both models' loaded
        weights; nothing is kept apart from the compile cache."""
        for name, model in (("draft", self.draft), ("target", self.target)):
            if model._hf is None:  # inferred: setup() takes their weights (L492-L495)
                raise RuntimeError(f"fake: FusedSpeculativeDecoder.to_neuron() before "
                                   f"{name}.to_neuron(); the real graph is set up with the "
                                   "models' loaded weights (fused_speculation.py:L492-L495)")
        for n_positions in self.buckets:  # the target verifies k + 1 tokens per step
            self.target._check_active_tokens(self.k + 1, n_positions)
        if workers is None:  # BucketedParallelProgram.build (program.py:L364-L369)
            workers = len(self.batch_sizes) * len(self.buckets)
        if workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        paths = self._neff_paths()
        missing = [p for _, p in paths if not p.is_file()]
        fields = {"program": PROGRAM, "graphs": len(paths), "cache_dir": str(compile_cache_dir()),
                  "k": self.k}
        if missing:
            _runtime.compile_delay()
            for path in missing:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_bytes(json.dumps({"program": PROGRAM}).encode() + bytes(range(256)))
                os.replace(tmp, path)
            _runtime.record("compile", compiled=len(missing), **fields)
        else:
            _runtime.record("cache-hit", **fields)
        self.speculator = [size for size, _ in paths]

    def update_generation_config(self, generation_config):
        """fused_speculation.py:L498-L501: the draft only if its config is dynamic."""
        if self.draft.neuron_config.on_device_generation.dynamic:
            self.draft.update_generation_config(generation_config)
        self.target.update_generation_config(generation_config)

    def sample(self, *args, **kwargs):
        raise NotImplementedError("fake: FusedSpeculativeDecoder.sample(); "
                                  "speculative_iteration() is simulated")

    # --- continuous batching: one iteration ------------------------------------------------
    def speculative_iteration(self, input_ids, cache_ids, start_ids):
        """fused_speculation.py:L746-L867. A call whose rows include a cache id 0 encodes
        contexts: the target's, then the draft's own context graph (both KV caches hold the
        prompt), returning the target's token and a count of 1. Otherwise one fused step of
        the whole compiled batch: rows scattered to their seq id, absent rows zeros."""
        batch_size, context_len = input_ids.shape
        cache_ids = self.prepare_cache_ids(cache_ids, batch_size, context_len)
        min_values_per_row, _ = torch.min(cache_ids, dim=-1)
        if (min_values_per_row == 0).any():  # L777-L811
            if self.is_eagle:
                raise NotImplementedError("fake: EAGLE speculation")
            target_next_id = self.target(input_ids, cache_ids, start_ids).reshape(batch_size, -1)
            self.draft(input_ids, cache_ids, start_ids)
            return target_next_id, torch.tensor([[1]] * batch_size)
        seq_ids = start_ids.flatten().to(torch.long)
        graph_batch_size = self.batch_sizes[0]  # L816-L817: the first batch size only
        full_input_ids, cache_ids_pad = [
            self.preprocess_input(tensor=t, seq_ids=seq_ids, target_batch_size=graph_batch_size)
            for t in [input_ids, cache_ids]]
        if self.speculator is None:  # L859: self.speculator.execute
            raise AttributeError("'NoneType' object has no attribute 'execute'")
        self._select(graph_batch_size, cache_ids_pad)
        tokens, counts = self._execute(full_input_ids, cache_ids_pad)
        output_tokens, output_counts = [self.postprocess_output(tensor=t, seq_ids=seq_ids)
                                        for t in [tokens, counts]]
        return self.speculative_iteration_post_process(output_tokens, output_counts)

    def preprocess_input(self, tensor, seq_ids, target_batch_size):
        """L871-L894: rows scattered by seq id into a zero batch."""
        output_tensor = torch.zeros((target_batch_size,) + tensor.shape[1:], dtype=tensor.dtype)
        output_tensor[seq_ids] = tensor
        return output_tensor

    def postprocess_output(self, tensor, seq_ids):
        return tensor[seq_ids]  # L897-L915

    def prepare_cache_ids(self, cache_ids, batch, seq_len):
        if cache_ids is not None:  # L918-L936
            return cache_ids
        if self.target.neuron_config and self.target.neuron_config.use_2d_cache_ids:
            return torch.tensor([[j for j in range(seq_len)] for i in range(batch)])
        return torch.tensor([i for i in range(seq_len)])

    def _select(self, batch_size: int, cache_ids) -> int:
        """FusedSpeculativeSelector (program.py:L406-L452): the bucket that holds the largest
        cache id + k. Past the last bucket bucket.find returns the last one and the graph
        writes beyond the cache: undefined on device, refused here."""
        if batch_size not in self.batch_sizes:
            raise IndexError(f"Could not find a program for batch size {batch_size}. Batch "
                             f"Sizes: {self.batch_sizes}")
        position = int(cache_ids.max()) + self.k
        seqlen = bucket.find(self.buckets, position + 1)
        if position + 1 > seqlen:
            raise IndexError(f"fake: position {position} (cache id + k) is past the largest "
                             f"bucket {seqlen}; the real selector runs that bucket and writes "
                             "past the KV cache")
        return self.speculator.index((batch_size, seqlen))

    def _execute(self, input_ids, cache_ids):
        """The fused graph (L150-L214, L385-L436) on [batch, 1] inputs: per row, k draft steps
        sampling from the draft's distribution, one more draft step writing the last draft
        token (the draft cache is complete whatever is accepted, L191-L194), the target over
        all k + 1 tokens at the same cache ids, then the acceptance."""
        if input_ids.shape[1] != 1 or cache_ids.shape != input_ids.shape:
            # inferred: the graph's inputs are [batch, 1] (inputs_builder(..., 1, batch), L156)
            raise ValueError(f"fake: the fused graph takes [batch, 1] token and cache ids; got "
                             f"{tuple(input_ids.shape)} and {tuple(cache_ids.shape)}")
        k, rows = self.k, input_ids.shape[0]
        tokens = torch.full((rows, k + 1), self.pad_token_id, dtype=torch.int32)
        counts = torch.zeros((rows, 1), dtype=torch.int32)
        for r in range(rows):  # the graph line is the seq id (L831: seq_ids_pad = arange)
            accepted, last = self._row(r, int(input_ids[r, 0]), int(cache_ids[r, 0]))
            tokens[r, :len(accepted)] = torch.tensor(accepted, dtype=torch.int32)
            tokens[r, len(accepted)] = last
            counts[r, 0] = len(accepted) + 1  # index + 1 (L428-L429)
        return tokens, counts

    def _row(self, line: int, token: int, c: int) -> tuple[list[int], int]:
        draft, target, k = self.draft, self.target, self.k
        dkv, tkv = _kv_line(draft, line), _kv_line(target, line)
        proposal, q = [token], []
        for i in range(k):  # L173-L186: one token a step at cache ids c .. c+k-1
            dkv[c + i] = proposal[i]
            q.append(draft.device_probs(draft._logits(dkv[:c + i + 1], list(range(c + i + 1)),
                                                      c), line))
            proposal.append(_draw(q[-1], draft._rng, draft.neuron_config.on_device_generation))
        dkv[c + k] = proposal[k]  # the final unroll (L191-L194)
        for i in range(k + 1):  # the target over [token, d1..dk] at c .. c+k (L200-L211)
            tkv[c + i] = proposal[i]
        p = [target.device_probs(target._logits(tkv[:c + i + 1], list(range(c + i + 1)), c),
                                 line) for i in range(k + 1)]
        n = 0
        while n < k:  # speculative_mask (hlo.py:L3806-L3845): the accepted prefix
            d = proposal[n + 1]
            ratio = min(1.0, float(p[n][d] / q[n][d]))
            u = (self.deterministic_threshold if self.deterministic_threshold
                 else float(torch.rand(1, generator=target._rng)))
            if not u < ratio:
                break
            n += 1
        if n < k:  # speculative_adjust_distribution (hlo.py:L3780-L3804)
            adjusted = torch.clamp(p[n] - q[n], min=0.0)
            adjusted = adjusted / adjusted.sum() if adjusted.sum() > 0 else p[n]  # real: NaN
        else:
            adjusted = p[k]  # all accepted: the target's own next token
        last = _draw(adjusted, target._rng, target.neuron_config.on_device_generation)
        return proposal[1:n + 1], last


def _kv_line(model, line: int) -> list[int]:
    """The model's KV row `line` (base.py of this fake: token per cache position)."""
    rows = model.neuron_config.continuous_batching.batch_size_for_shared_caches
    kv = model._kv.setdefault(rows, [[0] * model.token_buckets[-1] for _ in range(rows)])
    return kv[line]


def _draw(probs: torch.Tensor, rng: torch.Generator, gen) -> int:
    """A token from a distribution over the vocabulary (hlo.multinomial, L396): one-hot
    gives its token; deterministic takes the 0.5 point of the sorted mass."""
    if int((probs > 0).sum()) == 1:
        return int(probs.argmax())
    if gen.deterministic:
        order = torch.argsort(probs, descending=True)
        pick = int(torch.searchsorted(torch.cumsum(probs[order], -1), torch.tensor(0.5)))
        return int(order[min(pick, len(order) - 1)])
    return int(torch.multinomial(probs, 1, generator=rng))
