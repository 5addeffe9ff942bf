"""NeuronModelBase of the fake: loading, compile/save/load, and the host-side input rules.

The device is a per-row KV model: for each compiled batch row, the token written at
each cache position (0 stands in for a zeroed cache entry). Context encoding and token
generation write it where the real kernels write K/V (at the cache ids, on the rows
they touch), and logits are computed by the HF model over what a row's attention
sees, so a write that corrupts another row changes that row's logits as on Inf2.
Citations are to aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from transformers_neuronx import _runtime, bucket
from transformers_neuronx.module import Weights, find_weights


def _sanity_check(kwargs: dict) -> None:
    """from_pretrained's argument asserts (module.py:L398-L422)."""
    n_positions = kwargs.get("n_positions", 2048)
    estimate = kwargs.get("context_length_estimate")
    max_pos = max(n_positions) if isinstance(n_positions, list) else n_positions
    max_cle = max(estimate) if isinstance(estimate, list) else estimate
    if isinstance(max_pos, int) and isinstance(max_cle, int):
        assert max_pos >= max_cle, (f"Max context_length_estimate {max_cle} cannot be more than "
                                    f"max n_positions {max_pos}.")
    nc = kwargs.get("neuron_config")
    bsh = nc is not None and nc.cache_layout == "BSH"
    if nc and nc.continuous_batching:
        expected = kwargs.get("batch_size")
        have = nc.continuous_batching.batch_size_for_shared_caches
        assert have == expected, (f"invalid batch_size_for_shared_caches ({have}), {expected} is "
                                  "expected")
    else:
        assert not bsh, "BSH cache layout can only be configured with continuous batching."


class NeuronModelBase:
    config: object
    neuron_config: object
    HF_CLASS = "LlamaForCausalLM"  # the transformers class the fake computes with

    @classmethod
    def from_pretrained(cls, pretrained_model_path, *model_args, **kwargs):
        from transformers import AutoConfig

        _sanity_check(kwargs)
        config = AutoConfig.from_pretrained(pretrained_model_path)
        # the 4.x config the real library gets holds config.json's own rope_theta; transformers
        # 5 keeps it only inside rope_parameters, where 4.x never looks (fake only)
        raw = json.loads((Path(pretrained_model_path) / "config.json").read_text())
        if "rope_theta" in raw and not hasattr(config, "rope_theta"):
            config.rope_theta = raw["rope_theta"]
        model = cls(config, *model_args, **kwargs)
        model._weights = find_weights(str(pretrained_model_path))  # module.py:L430-L431
        model._checkpoint_config = config
        return model

    # --- serialization (base.py) ---------------------------------------------------------
    def graph_spec(self) -> dict:
        """What every graph of this model bakes in (the fake's stand-in for its HLO)."""
        c = self.config
        return {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "vocab": c.vocab_size,
                "heads": c.num_attention_heads, "tp": self.tp_degree, "amp": self.amp,
                "neuron_config": self.neuron_config.spec()}

    def _graphs(self) -> dict[str, bytes]:
        """NEFF name -> bytes for every graph (token buckets x batches, context buckets)."""
        base = self.graph_spec()
        specs = [{**base, "kind": "token", "bucket": n, "batch": b}
                 for n in self.token_buckets for b in self.batch_sizes]
        specs += [{**base, "kind": "context", "bucket": n, "batch": b}
                  for n in self.context_buckets for b in self.context_batch_sizes]
        out = {}
        for spec in specs:
            hlo = json.dumps(spec, sort_keys=True).encode()
            name = hashlib.sha256(hlo).hexdigest()[:20] + ".neff"  # base.py:L792-L798
            body = {"hlo": spec, "cc_flags": os.environ.get("NEURON_CC_FLAGS", "")}
            out[name] = json.dumps(body).encode() + bytes(range(256)) * 16
        return out

    def save(self, directory, sharded_weights=False):
        if os.path.isfile(directory):  # base.py:L163-L167
            raise FileExistsError(f"Artifacts should be saved to a directory. Found existing "
                                  f"file: {directory}")
        os.makedirs(directory, exist_ok=True)
        if self._neffs is None:  # no program before to_neuron (decoder.py:L1062-L1063)
            raise AttributeError("'NoneType' object has no attribute 'get_kernels'")
        for name, data in self._neffs.items():
            Path(directory, name).write_bytes(data)

    def load(self, directory):
        self._load_dir = directory  # only remembered; to_neuron() reads it (base.py:L50-L52)

    def to_neuron(self):
        cores = _runtime.reserve_cores(self.tp_degree)  # ops.init() (base.py:L80)
        hf = self._build_hf(self._weights)  # load_weights(): every weight must exist (L84)
        self._build_graphs()  # the HLO is built to name the NEFFs, for a load too
        expected = self._graphs()
        workers = self.neuron_config.compilation_worker_count
        fields = {"visible_cores": cores, "tp_degree": self.tp_degree,
                  "batch_size": self.batch_size, "checkpoint": self._weights.directory,
                  "cc_flags": os.environ.get("NEURON_CC_FLAGS"),
                  "compilation_worker_count": workers}
        if self._load_dir is not None:
            if not os.path.isdir(self._load_dir):  # base.py:L173-L174
                raise FileNotFoundError(f"Did not find directory: {self._load_dir}.")
            neffs = {}
            for name in expected:
                try:  # base.py:L775-L785
                    neffs[name] = Path(self._load_dir, name).read_bytes()
                except FileNotFoundError:
                    raise FileNotFoundError(
                        "Could not find a matching NEFF for your HLO in this directory. Ensure "
                        "that the model you are trying to load is the same type and has the same "
                        "parameters as the one you saved or call \"save\" on this model to "
                        "reserialize it.") from None
            _runtime.record("load", directory=str(self._load_dir), **fields)
        else:
            if workers is not None and workers <= 0:  # ProcessPoolExecutor(workers) (base.py:L60)
                raise ValueError("max_workers must be greater than 0")
            _runtime.compile_delay()
            neffs = expected
            _runtime.record("compile", **fields)
        self._neffs, self._hf, self._kv = neffs, hf, {}

    def _build_hf(self, weights: Weights):
        import transformers

        config = self._checkpoint_config
        hf = getattr(transformers, self.HF_CLASS)(config)
        tensors = weights.materialize(self._checkpoint_names(hf))
        # quantized from the checkpoint's values, before amp (decoder.py:L1581)
        self._quantize_weights(tensors)
        self._load_hf(hf, tensors)
        return hf.to(self.dtype).eval()

    def _checkpoint_names(self, hf) -> list[str]:
        """The checkpoint weights the real load_weights reads: transformers' names for these
        families (Mixtral's experts differ under transformers 5: mixtral/model.py)."""
        return list(hf.state_dict())

    def _load_hf(self, hf, tensors: dict[str, torch.Tensor]) -> None:
        hf.load_state_dict(tensors, strict=True)

    def _quantize_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Subclasses: the layers' weights as the device holds them (none here)."""

    def _build_graphs(self) -> None:
        """Subclasses: the checks of building the HLO (none here)."""

    def _device_tokens(self, logits: list[torch.Tensor], lines: list[int]) -> torch.Tensor:
        """Subclasses: on-device generation's token ids for each row's logits."""
        raise NotImplementedError

    # --- execution -----------------------------------------------------------------------
    def _ready(self) -> None:
        if self._hf is None:  # embed_tokens is materialized by to_neuron (llama/model.py:L116)
            raise ValueError("Attempted to use an uninitialized parameter in <built-in function "
                             "embedding>; call to_neuron() first")

    def _prepare(self, input_ids, cache_ids, start_ids) -> Plan:
        """The host-side preprocessing of forward(): which graph runs, on what inputs."""
        if self.neuron_config.continuous_batching and start_ids is not None:  # base.py:L496-L498
            return self._prepare_continuous(input_ids, cache_ids, start_ids)
        if self.neuron_config.lhs_aligned:
            raise NotImplementedError("fake: right padding without continuous batching")
        return self._prepare_static(input_ids, cache_ids, start_ids)

    def _prepare_continuous(self, input_ids, cache_ids, seq_ids) -> Plan:
        """Context, speculation or token generation, decided as base.py:L502-L549 does."""
        n_seqs, n_active = input_ids.shape
        rows = self.neuron_config.continuous_batching.batch_size_for_shared_caches
        if n_active > 1 and cache_ids.flatten()[0].item() == 0:  # context (base.py:L502-L503)
            size = bucket.find(self.context_buckets, n_active)
            assert n_seqs == cache_ids.shape[0], (f"invalid n_active_seqs ({n_seqs} vs "
                                                  f"{cache_ids.shape[0]})")
            assert n_active <= size, f"invalid input prompt length ({n_active} <= {size})"
            padded = torch.zeros(n_seqs, size, dtype=cache_ids.dtype)
            padded[:, :n_active] = cache_ids[:, :n_active]
            # logits at last_token_id = the max cache id, then right padding to the bucket
            # (base.py:L443-L448); padded cache ids become 0..size-1 (base.py:L472-L473)
            last = padded.max(dim=1).values
            if n_active < size:
                input_ids = torch.nn.functional.pad(input_ids, (0, size - n_active))
                padded = torch.arange(size, dtype=torch.int32).unsqueeze(0).expand(n_seqs, size)
            return Plan("context", rows, input_ids.tolist(), padded.tolist(),
                        seq_ids.flatten().tolist(), [int(x) + 1 for x in last])
        if n_active > 1:  # speculation: no speculative graph was compiled (base.py:L540-L549)
            size = bucket.find(self.context_buckets, n_active)
            assert n_active <= size, f"invalid input prompt length ({n_active} <= {size})"
            assert n_seqs in [], f"invalid batch size for speculative forward ({n_seqs} not in [])"
        # token generation pads to every compiled row (base.py:L575-L587); torch's scatter_
        # raises when cache_ids' dtype is not input_ids'
        full_ids = torch.zeros(rows, 1, dtype=input_ids.dtype)
        full_cache = torch.zeros(rows, 1, dtype=input_ids.dtype)
        index = seq_ids.flatten().unsqueeze(-1).to(torch.int64)
        full_ids.scatter_(dim=0, index=index, src=input_ids)
        full_cache.scatter_(dim=0, index=index, src=cache_ids)
        bucket.token_bucket_id(self.token_buckets, int(full_cache.max()))  # decoder.py:L490
        cache = full_cache.flatten().tolist()
        wanted = index.flatten().tolist()  # logits in seq_ids order (base.py:L630-L637)
        return Plan("token", rows, full_ids.tolist(), [[c] for c in cache], list(range(rows)),
                    [cache[r] + 1 for r in range(rows)], wanted)

    def _prepare_static(self, input_ids, cache_ids, start_ids) -> Plan:
        """Static batching of left-padded rows; start_ids hide the pads (decoder.py:L569-L571)."""
        batch, length = input_ids.shape
        starts = [0] * batch if start_ids is None else [int(s) for s in start_ids.flatten()]
        if length > 1:
            if cache_ids is not None:
                raise NotImplementedError("fake: static prefill with cache_ids")
            size = bucket.find(self.context_buckets, length)
            if batch not in self.context_batch_sizes:  # decoder_lm_head_for_context (base.py:L274)
                raise KeyError((size, batch))
            bucket.token_bucket_id(self.token_buckets, length - 1)  # leftovers run token graphs
            positions = [list(range(length))] * batch
        else:
            pos = int(cache_ids.flatten()[0])
            bucket_id = bucket.token_bucket_id(self.token_buckets, pos)  # (decoder.py:L504)
            if batch not in self.batch_sizes:  # executors[npos, batch] (decoder.py:L2394-L2395)
                raise KeyError((self.token_buckets[bucket_id], batch))
            positions = [[pos]] * batch
        return Plan("static", batch, input_ids.tolist(), positions, list(range(batch)),
                    [p[-1] + 1 for p in positions], list(range(batch)), starts)

    def _run(self, plan: Plan) -> torch.Tensor:
        """The device: write each row's tokens at its cache ids, then the logits asked for."""
        empty = [[0] * self.token_buckets[-1] for _ in range(plan.rows)]
        kv = self._kv.setdefault(plan.rows, empty)
        for row, tokens, positions in zip(plan.row_ids, plan.tokens, plan.positions, strict=True):
            if not 0 <= row < plan.rows:  # out-of-range rows are undefined on device; refused
                raise IndexError(f"seq_id {row} is not a compiled row (0..{plan.rows - 1})")
            for token, pos in zip(tokens, positions, strict=True):  # layers/attention.py:L276-L330
                kv[row][pos] = token
        out, lines = [], []
        for i, row in enumerate(plan.logits_of):
            if plan.kind == "context":  # causal by index, own tokens only (hlo.py:L3140-L3148)
                end = plan.ends[i]
                tokens, positions = plan.tokens[i][:end], plan.positions[i][:end]
                cached, line = 0, plan.row_ids[i]  # context K/V is fresh, not read back
            else:  # prior positions below the cache id, plus the active token (hlo.py:L3590-L3597)
                start, end = plan.starts[row], plan.ends[row]
                tokens, positions = kv[row][start:end], list(range(end - start))
                # what this call wrote is fresh; the rest is read from the cache
                cached, line = max(0, len(tokens) - len(plan.tokens[row])), row
            out.append(self._logits(tokens, positions, cached))
            lines.append(line)  # the seq id (continuous batching) or batch line of the row
        if self.neuron_config.on_device_generation:  # token ids, not logits (base.py:L712-L713)
            return self._device_tokens(out, lines)
        return self._host_logits(plan, out, lines)

    def _host_logits(self, plan: Plan, out: list[torch.Tensor], lines: list[int]
                     ) -> torch.Tensor:
        """The rows' logits laid out as the real forward() hands them back: the device's
        [vocab, 1, lines] cast to cast_logits_dtype (base.py:L641-L647, L715) and viewed
        transposed, [lines, vocab] with strides (1, lines) (L716-L720); a decode keeps the
        first n rows of that view when its seq ids are 0..n-1 and copies the rows out in
        seq-id order otherwise (L631-L637). Values stay float32's (the fake's model runs
        in float32)."""
        dtype = getattr(torch, self.neuron_config.cast_logits_dtype or "float32")
        width = plan.rows if plan.kind == "token" else len(out)
        device = torch.zeros(self.config.vocab_size, 1, width, dtype=dtype)  # [vocab, 1, lines]
        at = lines if plan.kind == "token" else list(range(len(out)))
        device[:, 0, at] = torch.stack(out, dim=1).to(dtype)
        view = device[:, -1, :].transpose(0, 1)  # [lines, vocab]
        if plan.kind != "token":
            return view
        if lines == list(range(len(lines))):
            return view[:len(lines)]
        return view[torch.tensor(lines, dtype=torch.long)]

    @torch.no_grad()
    def _logits(self, tokens: list[int], positions: list[int], cached: int = 0) -> torch.Tensor:
        """Logits after the last of `tokens` (causal by index, rotary at `positions`); the
        first `cached` positions' K/V are read back from the KV cache."""
        self._cached = cached  # read by the KV-cache hooks of a quantized cache (llama/model.py)
        out = self._hf(input_ids=torch.tensor([tokens], dtype=torch.long),
                       position_ids=torch.tensor([positions], dtype=torch.long), use_cache=False)
        return out.logits[0, -1, : self.config.vocab_size].float()  # base.py:L719


@dataclass(frozen=True)
class DecoderLmHead:
    """What other objects read of a model's token decoder (`model.decoder_lm_head`): its
    tensor parallel degree and token buckets (llama/model.py:L99-L108)."""

    tp_degree: int
    n_positions_list: list[int]


@dataclass
class Plan:
    """One device call: rows written, at which cache ids, and whose logits come back."""

    kind: str  # "context" | "token" | "static"
    rows: int  # rows of the compiled batch (the KV cache's batch dimension)
    tokens: list[list[int]]  # per written row, the tokens...
    positions: list[list[int]]  # ...and the cache ids they are written at
    row_ids: list[int]  # the KV row each of those goes to
    ends: list[int]  # per row (context: per call row), positions its logits attend to
    logits_of: list[int] = field(default_factory=list)  # rows whose logits return, in order
    starts: list[int] = field(default_factory=list)  # static: each row's left padding

    def __post_init__(self) -> None:
        if not self.logits_of:
            self.logits_of = list(range(len(self.row_ids)))
        if not self.starts:
            self.starts = [0] * max(self.rows, len(self.row_ids))
