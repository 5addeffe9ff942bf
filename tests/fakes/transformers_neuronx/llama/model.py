"""Fake LlamaForSampling: the real API and its rules, computed on CPU with transformers.

Rules enforced (each raises like the real stack would, or stricter):
- exact keyword names in the constructor / from_pretrained (no silent **kwargs);
- num_attention_heads divisible by tp_degree; GQA K/V heads shardable;
- load(dir) only before to_neuron(); save(dir) only after it; forward/sample only after it;
- the compiled batch size is fixed: other batch sizes raise; positions beyond
  n_positions raise; continuous batching: seq ids < batch, prompt <= largest bucket;
- to_neuron() after load() needs every NEFF of this graph in the directory;
- streamer.put() receives [batch, 1] int tensors, then end().
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, LlamaForCausalLM

from transformers_neuronx import _runtime
from transformers_neuronx.config import NeuronConfig
from transformers_neuronx.constants import GQA

AMP = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _token_buckets(n_positions: int) -> list[int]:
    buckets, b = [], 128
    while b < n_positions:
        buckets.append(b)
        b *= 2
    return buckets + [n_positions]


class LlamaForSampling:
    def __init__(self, config, *, n_positions=2048, batch_size=1, amp="f32", tp_degree=2,
                 context_length_estimate=None, context_unroll=None, unroll=None,
                 neuron_config=None, prefixed_length=0):
        if amp not in AMP:
            raise KeyError(f"amp {amp!r}: expected one of {sorted(AMP)}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise TypeError("batch_size must be list of ints or int type")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % tp_degree:
            raise ValueError(f"num_attention_heads {heads} is not divisible by tp_degree "
                             f"{tp_degree}")
        self.neuron_config = neuron_config if neuron_config is not None else NeuronConfig()
        gqa = self.neuron_config.group_query_attention
        if kv_heads != heads and gqa in (None, GQA.SHARD_OVER_HEADS) \
                and kv_heads % tp_degree and tp_degree % kv_heads:
            raise ValueError(f"shard-over-heads: {kv_heads} K/V heads cannot be split evenly "
                             f"over tp_degree {tp_degree}")
        if gqa == GQA.SHARD_OVER_BATCH and batch_size % tp_degree:
            raise ValueError(f"shard-over-batch: batch_size {batch_size} is not divisible by "
                             f"tp_degree {tp_degree}")
        if isinstance(context_length_estimate, int):
            context_length_estimate = [context_length_estimate]
        buckets = sorted(context_length_estimate or [n // 2 for n in _token_buckets(n_positions)])
        if buckets[-1] > n_positions:
            raise ValueError(f"context_length_estimate {buckets[-1]} > n_positions {n_positions}")
        cb = self.neuron_config.continuous_batching
        if cb is not None and cb.batch_size_for_shared_caches != batch_size:
            raise ValueError(f"batch_size_for_shared_caches {cb.batch_size_for_shared_caches} != "
                             f"batch_size {batch_size}")
        self.config = config
        self.n_positions, self.batch_size, self.amp, self.tp_degree = (
            n_positions, batch_size, amp, tp_degree)
        self.batch_sizes = [batch_size]
        self.context_buckets = buckets
        self._checkpoint: str | None = None
        self._load_dir: str | None = None
        self._neffs: dict[str, bytes] | None = None
        self._hf = None
        self._rows: list[list[int]] = []  # static batching: real tokens of each row
        self._length = 0  # static batching: positions filled (padded)
        self._slots: dict[int, list[int]] = {}  # continuous batching: seq id -> tokens

    @classmethod
    def from_pretrained(cls, pretrained_model_path, *model_args, **kwargs):
        config = AutoConfig.from_pretrained(pretrained_model_path)
        model = cls(config, *model_args, **kwargs)
        if not any(os.path.isfile(os.path.join(pretrained_model_path, f)) for f in WEIGHT_FILES):
            raise FileNotFoundError("Can not find model.safetensors or pytorch_model.bin in "
                                    f"{pretrained_model_path}")
        model._checkpoint = str(pretrained_model_path)
        return model

    # --- compile / serialize -------------------------------------------------------------
    def _graphs(self) -> dict[str, bytes]:
        c = self.config
        base = {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "vocab": c.vocab_size,
                "heads": c.num_attention_heads, "tp": self.tp_degree, "amp": self.amp,
                "batch": self.batch_size, "neuron_config": self.neuron_config.spec()}
        specs = [{**base, "kind": "token", "bucket": b} for b in _token_buckets(self.n_positions)]
        specs += [{**base, "kind": "context", "bucket": b} for b in self.context_buckets]
        out = {}
        for spec in specs:
            hlo = json.dumps(spec, sort_keys=True)
            name = hashlib.sha256(hlo.encode()).hexdigest()[:20] + ".neff"
            body = {"hlo": spec, "cc_flags": os.environ.get("NEURON_CC_FLAGS", "")}
            out[name] = json.dumps(body).encode() + bytes(range(256)) * 16
        return out

    def load(self, directory):
        if self._hf is not None:
            raise RuntimeError("load() must be called before to_neuron(); the model is already "
                               "on Neuron")
        self._load_dir = str(directory)

    def to_neuron(self):
        if self._hf is not None:
            raise RuntimeError("to_neuron() was already called")
        cores = _runtime.reserve_cores(self.tp_degree)
        expected = self._graphs()
        fields = {"visible_cores": cores, "tp_degree": self.tp_degree,
                  "batch_size": self.batch_size, "cc_flags": os.environ.get("NEURON_CC_FLAGS")}
        if self._load_dir is not None:
            self._neffs = {}
            for name in expected:
                try:
                    self._neffs[name] = Path(self._load_dir, name).read_bytes()
                except FileNotFoundError:
                    raise FileNotFoundError(
                        "Could not find a matching NEFF for your HLO in this directory. Ensure "
                        "that the model you are trying to load is the same type and has the same "
                        "parameters as the one you saved or call \"save\" on this model to "
                        "reserialize it.") from None
            _runtime.record("load", directory=self._load_dir, **fields)
        else:
            _runtime.compile_delay()
            self._neffs = expected
            _runtime.record("compile", **fields)
        hf = LlamaForCausalLM.from_pretrained(self._checkpoint, dtype=AMP[self.amp])
        self._hf = hf.eval()

    def save(self, directory):
        if not self._neffs:
            raise AssertionError("cannot save a model which has not been successfully compiled")
        if os.path.isfile(directory):
            raise FileExistsError(f"Artifacts should be saved to a directory. Found existing "
                                  f"file: {directory}")
        os.makedirs(directory, exist_ok=True)
        for name, data in self._neffs.items():
            Path(directory, name).write_bytes(data)

    # --- execution -----------------------------------------------------------------------
    def _ready(self) -> None:
        if self._hf is None:
            raise RuntimeError("call to_neuron() before running the model")

    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        out = [self._hf(torch.tensor([r])).logits[0, -1].float() for r in rows]
        return torch.stack(out)  # [n, vocab]

    def _check_position(self, pos: int) -> None:
        if pos >= self.n_positions:
            raise ValueError(f"position {pos} is beyond n_positions {self.n_positions}")

    @torch.no_grad()
    def forward(self, input_ids, cache_ids=None, start_ids=None):
        self._ready()
        if self.neuron_config.continuous_batching is not None and start_ids is not None:
            return self._forward_continuous(input_ids, cache_ids, start_ids)
        batch, length = input_ids.shape  # input_ids: [batch, tokens]
        if batch not in self.batch_sizes:
            raise ValueError(f"Model not compiled for batch_size : {batch}. Acceptable "
                             f"batch_size is one of the following {self.batch_sizes}")
        starts = [0] * batch if start_ids is None else [int(s) for s in start_ids]
        if cache_ids is None:  # context: the whole (left-padded) prompt from position 0
            self._check_position(length - 1)
            self._rows = [input_ids[i, starts[i]:].tolist() for i in range(batch)]
            self._length = length
        else:  # one token per row at cache_ids[0]
            pos = int(cache_ids.flatten()[0])
            if length != 1 or pos != self._length:
                raise ValueError(f"token step at cache id {pos} with {length} tokens; expected "
                                 f"1 token at {self._length}")
            self._check_position(pos)
            for i in range(batch):
                self._rows[i].append(int(input_ids[i, 0]))
            self._length += 1
        return self._logits(self._rows)

    def _forward_continuous(self, input_ids, cache_ids, seq_ids):
        n, length = input_ids.shape
        seqs = [int(s) for s in seq_ids.flatten()]
        if any(s < 0 or s >= self.batch_size for s in seqs) or len(seqs) != n:
            raise ValueError(f"seq_ids {seqs} must be {n} ids in [0, {self.batch_size})")
        if cache_ids is None or tuple(cache_ids.shape) != (n, length):
            raise ValueError(f"continuous batching needs 2-D cache_ids of shape {(n, length)}")
        if length > 1:  # context encoding
            if length > self.context_buckets[-1]:
                raise AssertionError(f"invalid input prompt length ({length} <= "
                                     f"{self.context_buckets[-1]})")
            for i, s in enumerate(seqs):
                if cache_ids[i].tolist() != list(range(length)):
                    raise ValueError("context cache_ids must be 0..len-1 per sequence")
                self._slots[s] = input_ids[i].tolist()
        else:
            for i, s in enumerate(seqs):
                pos = int(cache_ids[i, 0])
                if s not in self._slots or pos != len(self._slots[s]):
                    have = len(self._slots.get(s, []))
                    raise ValueError(f"seq {s}: token at cache id {pos}, expected {have}")
                self._check_position(pos)
                self._slots[s].append(int(input_ids[i, 0]))
        return self._logits([self._slots[s] for s in seqs])

    @torch.no_grad()
    def sample(self, input_ids, sequence_length, start_ids=None, top_k=50, top_p=1.0,
               eos_token_override=None, temperature=1.0, streamer=None,
               stopping_criteria_list=None, no_repeat_ngram_size=None):
        self._ready()
        if not isinstance(top_k, int) or top_k <= 0:
            raise ValueError("top_k has to be a strictly positive int.")
        if not isinstance(top_p, float) or not 0.0 < top_p <= 1.0:
            raise ValueError("top_p has to be a strictly positive float that less than or "
                             "equal to 1.0.")
        if not isinstance(temperature, float) or temperature <= 0:
            raise ValueError("temperature has to be a strictly positive float.")
        eos = self.config.eos_token_id if eos_token_override is None else eos_token_override
        scores = self.forward(input_ids, None, start_ids)
        batch, start = input_ids.shape
        done = torch.zeros(batch, 1, dtype=torch.bool)
        tokens = [input_ids]
        for current in range(start, sequence_length):
            scores = scores / temperature
            values, indices = torch.topk(scores, min(top_k, scores.shape[-1]))
            probs = torch.softmax(values, dim=-1)
            if top_p < 1.0:
                keep = torch.cumsum(probs, dim=-1) - probs < top_p
                probs = torch.where(keep, probs, torch.zeros_like(probs))
            picked = torch.gather(indices, 1, torch.multinomial(probs, 1))  # [batch, 1]
            done = done | (picked == eos)
            token = torch.where(done, torch.full_like(picked, eos), picked)
            tokens.append(token)
            if streamer is not None:
                streamer.put(token)
            if current + 1 >= sequence_length or bool(done.all()):
                break
            scores = self.forward(picked, torch.as_tensor([current], dtype=torch.int32),
                                  start_ids)
        if streamer is not None:
            streamer.end()
        return torch.cat(tokens, dim=-1)
