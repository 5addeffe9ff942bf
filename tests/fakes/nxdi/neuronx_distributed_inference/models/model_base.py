"""NeuronBaseForCausalLM of the fake: compile/load, and forward's host-side rules.

The device is a KV cache of `kv_cache_batch_size` lines; each line records, per cache
position, the token written there and its rotary position. Context encoding and token
generation write where the real graphs write (the whole padded bucket of a context; one
position per generated token, on the line the real padding/sorting picks), and logits are
the HF model's over what that line's attention sees, so a call that would corrupt another
sequence's cache on Inf2 changes that sequence's tokens here.

Citations: aws-neuron/neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/
(AB = models/application_base.py, MB = models/model_base.py, MW = models/model_wrapper.py,
KV = modules/kvcache/kv_cache_manager.py, BK = modules/autobucketing.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from math import log2

import torch

from neuronx_distributed_inference import _fake_runtime as rt
from neuronx_distributed_inference.models.config import to_dict
from neuronx_distributed_inference.modules.generation import sampling

COMPILED_MODEL_FILE_NAME = "model.pt"  # AB:L47
CONTEXT_ENCODING_MODEL_TAG = "context_encoding_model"
TOKEN_GENERATION_MODEL_TAG = "token_generation_model"
UNMODELLED = ("async_mode", "speculation_length", "medusa_speculation_length",
              "enable_fused_speculation", "is_prefix_caching", "is_block_kv_layout", "lora_config")


def normalize_path(path) -> str:
    return os.path.join(os.path.normpath(path), "")  # AB:L51-L54: always a trailing slash


def generate_buckets(min_length: int, max_length: int) -> list[int]:
    if min_length == max_length:  # BK:L8-L19
        return [max_length]
    lo, hi = int(log2(min_length)), round(log2(max_length))
    return [2**i for i in range(lo, hi)] + [max_length]


def buckets_for(nc, tag: str) -> list[int]:
    """Context buckets up to max_context_length, token buckets up to max_length (BK:L149-L250)."""
    top = nc.max_context_length if tag == CONTEXT_ENCODING_MODEL_TAG else nc.max_length
    given = (nc.context_encoding_buckets if tag == CONTEXT_ENCODING_MODEL_TAG
             else nc.token_generation_buckets)
    if not nc.enable_bucketing:
        return generate_buckets(top, top)
    return list(given) if given is not None else generate_buckets(128, top)


def seq_bucket(buckets: list[int], input_len: int, tag: str, truncate: bool) -> int:
    """first_fit: the first bucket strictly longer than the input, else the largest when the
    input fills it exactly (MW:L898-L916)."""
    for b in buckets:
        if input_len < b:
            return b
    if input_len == buckets[-1] or truncate:
        return buckets[-1]
    raise ValueError(f"Input len {input_len} exceeds largest bucket ({buckets[-1]}) for {tag}")


class _Output:
    """CausalLMOutputWithPast's fields the callers read (MB:L3851-L3876)."""

    def __init__(self, logits, hidden_states, tokens):
        self.logits, self.hidden_states, self.tokens = logits, hidden_states, tokens

    def __getitem__(self, i):
        return [x for x in (self.logits, self.hidden_states) if x is not None][i]


class NeuronBaseForCausalLM(torch.nn.Module):
    def __init__(self, model_path, config=None, neuron_config=None):
        super().__init__()
        model_path = normalize_path(model_path)
        if config is None:  # AB:L81-L82: a compiled dir's neuron_config.json
            config = self.get_config_cls().load(model_path)
        if neuron_config is not None:
            config.neuron_config = neuron_config
        if not hasattr(config, "neuron_config"):  # AB:L206-L207
            raise ValueError("Config must include a NeuronConfig")
        self.config, self.neuron_config, self.model_path = config, config.neuron_config, model_path
        nc = self.neuron_config
        if nc.is_chunked_prefill:  # MB:L3094-L3095
            raise NotImplementedError("Chunked Prefill is not available in NxDI for now")
        for name in UNMODELLED:
            if getattr(nc, name, None):
                raise NotImplementedError(f"fake: {name} is not modelled")
        self.on_device_sampling = nc.on_device_sampling_config is not None
        self.vocab_size = config.vocab_size
        self.cte_buckets = buckets_for(nc, CONTEXT_ENCODING_MODEL_TAG)
        self.tkg_buckets = buckets_for(nc, TOKEN_GENERATION_MODEL_TAG)
        self.is_compiled = os.path.isfile(model_path + COMPILED_MODEL_FILE_NAME)  # AB:L57-L58
        self.is_loaded_to_neuron = False
        self.kv_cache_populated = False
        self._hf = None
        self._kv: dict[int, dict[int, tuple[int, int]]] = {}

    @classmethod
    def get_config_cls(cls):
        raise NotImplementedError("get_config_cls is not implemented")

    # --- compile / load ------------------------------------------------------------------
    def _graphs(self) -> list[dict]:
        """One graph per bucket of each model; what model.pt holds (MB:L3149-L3196)."""
        c, nc = self.config, self.neuron_config
        base = {"model": {k: getattr(c, k, None) for k in c.get_required_attributes()},
                "neuron_config": {k: v for k, v in to_dict(nc).items() if k != "skip_warmup"}}
        graphs = [{**base, "tag": CONTEXT_ENCODING_MODEL_TAG, "bucket": b,
                   "batch": nc.ctx_batch_size} for b in self.cte_buckets]
        graphs += [{**base, "tag": TOKEN_GENERATION_MODEL_TAG, "bucket": b,
                    "batch": nc.tkg_batch_size} for b in self.tkg_buckets]
        return graphs

    def compile(self, compiled_model_path, debug=False, pre_shard_weights_hook=None,
                dry_run=False):
        """neuron_config.json, then the traced graphs in model.pt (AB:L292-L315)."""
        path = normalize_path(compiled_model_path)
        nc = self.neuron_config
        self.config.save(path)  # written first, even when tracing fails (AB:L299)
        if nc.is_continuous_batching and nc.ctx_batch_size != 1:  # KV:L488-L489, at trace time
            raise AssertionError("only supports single seq_id")
        if dry_run:
            return
        if nc.save_sharded_checkpoint:
            raise NotImplementedError("fake: save_sharded_checkpoint (weights/ pre-sharding)")
        rt.compile_delay()
        program = {"graphs": self._graphs(), "cc_flags": os.environ.get("NEURON_CC_FLAGS", "")}
        body = json.dumps(program, sort_keys=True, default=str).encode()
        with open(path + COMPILED_MODEL_FILE_NAME, "wb") as f:
            f.write(body + bytes(range(256)) * 16)
        self.is_compiled = True
        rt.record("compile", directory=path, tp_degree=nc.tp_degree, batch_size=nc.batch_size,
                  cc_flags=os.environ.get("NEURON_CC_FLAGS"))

    def load(self, compiled_model_path, start_rank_id=None, local_ranks_size=None,
             skip_warmup=False):
        """model.pt onto the cores, weights sharded from model_path, then warm-up (AB:L317-L346)."""
        path = normalize_path(compiled_model_path)
        pt = path + COMPILED_MODEL_FILE_NAME
        if not os.path.isfile(pt):  # torch.jit.load's error (AB:L326)
            raise ValueError(f"The provided filename {pt} does not exist")
        with open(pt, "rb") as f:
            raw = f.read()
        program = json.loads(raw[: raw.index(b"\x00")].decode())
        mine = json.loads(json.dumps(self._graphs(), sort_keys=True, default=str))
        if program["graphs"] != mine:  # the traced graphs take other shapes than this config's
            raise RuntimeError(f"fake: {pt} was traced for another config or model; the real "
                               "runtime fails on the first mismatching input")
        nc = self.neuron_config
        ranks = local_ranks_size or nc.local_ranks_size
        cores = rt.reserve_cores(ranks)  # nxd_model.initialize (AB:L414)
        from transformers import LlamaForCausalLM

        # sharded from the checkpoint at load, not stored in the compiled dir (AB:L403-L405)
        hf = LlamaForCausalLM.from_pretrained(self.model_path.rstrip("/"))
        self._hf = hf.to(nc.torch_dtype).eval()
        self._kv, self.is_loaded_to_neuron = {}, True
        rt.record("load", directory=path, visible_cores=cores, tp_degree=nc.tp_degree,
                  batch_size=nc.batch_size, warmup=not (nc.skip_warmup or skip_warmup))

    def reset(self):
        self.kv_cache_populated = False  # MB:L3942-L3946: the flag only, not the cache

    # --- forward -------------------------------------------------------------------------
    def forward(self, input_ids=None, seq_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, sampling_params=None, **kwargs):
        nc = self.neuron_config
        if attention_mask is None:  # MB:L3530-L3549
            assert position_ids is not None, \
                "need to call forward with position_ids if attention_mask is not provided"
            attention_mask = self._infer_attention_mask(position_ids)
        if seq_ids is None:
            seq_ids = torch.arange(input_ids.shape[0])
        if sampling_params is None:  # MB:L3089-L3091: greedy rows
            sampling_params = sampling.prepare_sampling_params(nc.batch_size)
        if self.on_device_sampling:  # MB:L3507-L3510
            sampling.validate_sampling_params(sampling_params, nc.on_device_sampling_config)
        sampling_params = sampling.infer_sampling_params(sampling_params.clone())
        prefill = position_ids.min().item() == 0  # MB:L3591-L3592, L3677
        if not self.is_loaded_to_neuron:  # MW:L1317-L1320
            raise RuntimeError("Forward called before load. Run load() or load_state_dict() "
                               "making calling forward")
        if seq_ids.dim() != 1 or not (input_ids.shape[0] == position_ids.shape[0]
                                      == attention_mask.shape[0] == seq_ids.shape[0]):
            raise RuntimeError(f"fake: the traced graphs take input_ids, attention_mask, "
                               f"position_ids [batch, n] and seq_ids [batch]; got "
                               f"{tuple(input_ids.shape)}, {tuple(attention_mask.shape)}, "
                               f"{tuple(position_ids.shape)}, {tuple(seq_ids.shape)}")
        if self.on_device_sampling and sampling_params.shape[0] != seq_ids.shape[0]:
            raise RuntimeError(f"fake: sampling_params {tuple(sampling_params.shape)} for "
                               f"{seq_ids.shape[0]} rows")
        ids, pos = input_ids.to(torch.int64), position_ids.to(torch.int64)  # MW:L715-L723
        with torch.no_grad():
            if prefill:
                logits = self._context(ids, attention_mask, pos, seq_ids.to(torch.int64))
                self.kv_cache_populated = True
            else:
                logits = self._token(ids, attention_mask, pos, seq_ids.to(torch.int64))
        if self.on_device_sampling:  # tokens instead of logits (MB:L3851-L3876)
            tokens = sampling.sample(logits[:, -1, :], sampling_params,
                                     nc.on_device_sampling_config)
            return _Output(None, tokens, tokens)
        return _Output(logits, logits, logits)

    __call__ = forward

    @staticmethod
    def _infer_attention_mask(position_ids):
        batch, n = position_ids.shape
        if n != 1:
            return (position_ids >= torch.arange(n).view(1, -1)).to(position_ids.dtype)
        seq_len = int(torch.max(position_ids))
        mask = torch.arange(seq_len).view(1, -1).expand(batch, seq_len)
        return (position_ids.expand(batch, seq_len) - 1 >= mask).to(position_ids.dtype)

    def _context(self, ids, mask, pos, seq_ids) -> torch.Tensor:
        """Pad to the bucket, run ctx_batch_size rows at a time (MW:L725-L795, L1314-L1380)."""
        nc = self.neuron_config
        tag = CONTEXT_ENCODING_MODEL_TAG
        bucket = seq_bucket(self.cte_buckets, mask.shape[1], tag, nc.allow_input_truncation)
        pad = bucket - ids.shape[1]
        if pad < 0 or bucket - pos.shape[1] < 0:  # MW:L765-L773
            raise ValueError(f"Inputs supplied ({pos.shape[1]} tokens) are longer than "
                             f"max_context_length ({nc.max_context_length} tokens). To truncate "
                             "inputs, set allow_input_truncation=True.")
        pad_id = getattr(self.config, "pad_token_id", None) or 0
        ids = torch.nn.functional.pad(ids, (0, pad), value=pad_id)  # pad values: MW:L762-L778
        pos = torch.nn.functional.pad(pos, (0, bucket - pos.shape[1]), value=1)
        out = []
        step = nc.ctx_batch_size
        if ids.shape[0] < step:
            raise NotImplementedError("fake: fewer context rows than ctx_batch_size")
        for start in range(0, ids.shape[0], step):  # vllm_cte_repadding per chunk (MW:L1296)
            rows = range(start, min(start + step, ids.shape[0]))
            for r in rows:
                line = int(seq_ids[r]) if nc.is_continuous_batching else r - start
                self._check_line(line)  # index_put on the line (modules/kvcache/utils.py:L106-L120)
                # the whole padded bucket is written, pads included (KV:L491-L492)
                self._kv[line] = {j: (int(t), int(p)) for j, (t, p)
                                  in enumerate(zip(ids[r].tolist(), pos[r].tolist(), strict=True))}
                # hidden state at the first maximal position id (MB:L1012-L1016): for a
                # 1-token prompt that is the first pad, position 1
                at = int(torch.max(pos[r : r + 1], dim=1, keepdim=True).indices)
                out.append(self._logits(ids[r, : at + 1].tolist(), pos[r, : at + 1].tolist()))
        return torch.stack(out).unsqueeze(1)  # [n, 1, vocab]

    def _token(self, ids, mask, pos, seq_ids) -> torch.Tensor:
        """One position per row; which cache line each row touches (MW:L569-L698)."""
        nc = self.neuron_config
        bucket = seq_bucket(self.tkg_buckets, mask.shape[1], TOKEN_GENERATION_MODEL_TAG,
                            nc.allow_input_truncation)
        if mask.shape[1] > bucket:  # MW:L810-L819
            raise ValueError(f"Attention mask supplied (length={mask.shape[1]}) is longer than "
                             f"max_length ({nc.max_length} tokens).")
        n, batch = ids.shape[0], nc.tkg_batch_size
        if n > batch:
            raise NotImplementedError("fake: more token-generation rows than tkg_batch_size")
        rows = [(int(ids[r, 0]), int(pos[r, 0])) for r in range(n)]
        given = seq_ids.tolist()
        if n == batch:  # a full batch runs as given: row i is cache line i (MW:L1342-L1348)
            lines = list(range(n))
            writes = dict(zip(lines, rows, strict=True))
        else:  # missing lines filled, sorted; they get row 0 repeated (MW:L611-L641, L515-L567)
            if len(set(given)) != n:
                raise RuntimeError(f"fake: duplicate seq_ids {given}; the real padding mixes "
                                   "rows silently")
            for s in given:
                if not 0 <= s < batch:  # index_select(logits, 0, seq_ids) (MW:L695)
                    raise IndexError("index out of range in self")
            lines = given
            writes = {line: rows[0] for line in range(batch)}
            writes.update(zip(given, rows, strict=True))
        for line, (token, p) in writes.items():
            self._check_line(line)
            if not 0 <= p < nc.max_length:
                raise IndexError(f"fake: position {p} outside the KV cache (max_length "
                                 f"{nc.max_length})")
            self._kv.setdefault(line, {})[p] = (token, p)
        out = []
        for line, (token, p) in zip(lines, rows, strict=True):
            cache = self._kv.get(line, {})
            # prior positions below the row's position id, then the active token (MB:L3530-L3549)
            prior = [cache.get(j, (0, j)) for j in range(p)]
            out.append(self._logits([t for t, _ in prior] + [token],
                                    [q for _, q in prior] + [p]))
        return torch.stack(out).unsqueeze(1)

    def _check_line(self, line: int) -> None:
        lines = self.neuron_config.kv_cache_batch_size
        if not 0 <= line < lines:
            raise IndexError(f"index {line} is out of bounds for dimension 0 with size {lines}")

    def _logits(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        out = self._hf(input_ids=torch.tensor([tokens], dtype=torch.long),
                       position_ids=torch.tensor([positions], dtype=torch.long), use_cache=False)
        return out.logits[0, -1, : self.vocab_size].float()  # logits.float() (MB:L1028)


def program_digest(path) -> str:
    """sha256 of a compiled model.pt (tests compare artefacts with it)."""
    with open(normalize_path(path) + COMPILED_MODEL_FILE_NAME, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
