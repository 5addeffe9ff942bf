"""NxD Inference (neuronx-distributed-inference) on Inferentia2, behind the same contract.

The Inf2 path of the Neuron SDKs without transformers-neuronx (2.26 on); NxD Inference
supports Inf2 up to SDK 2.28 (the 2.29 notes drop Inf2/Trn1, aws-neuron/aws-neuron-sdk@
81ce03ae:about-neuron/whats-new.rst:L281). Start-up, in order: claim tp_degree NeuronCores
-> apply the Neuron environment -> import the SDK -> NeuronConfig + LlamaInferenceConfig
-> compile, or load from the versioned compile cache (the compiled graphs only; weights
are sharded from the checkpoint at every load).

Continuous batching only, as vLLM's NxDI plugin runs it: one context row per call, each
slot a KV-cache line addressed by its seq_id, decode of every running slot per step with
seq_ids sorted. Sampling on the host with each request's own parameters, or on the device
(handler.neuron.on_device_sampling) with per-row top-k/top-p/temperature.
Citations: aws-neuron/neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handlers.backends.base import (
    Backend,
    Capabilities,
    Rows,
    SamplingParams,
    TokenLogprob,
    import_sdk_class,
    read_eos_ids,
)
from handlers.backends.capabilities import check_sampling
from handlers.backends.neuron_cores import backend_claim
from handlers.backends.neuron_env import apply_neuron_env, cache_root, neuron_env
from handlers.config import HandlerConfig
from handlers.errors import ConfigError, GenerationError, RequestError
from neuron_cache.compile import compile_or_load
from neuron_cache.key import key_inputs, nxdi_buckets, read_model_config
from neuron_cache.store import CacheStore

log = logging.getLogger(__name__)
PACKAGE = "neuronx_distributed_inference"
INSTALL = ("install NxD Inference from the AWS Neuron repository on an Inf2 host with SDK "
           "2.23-2.28: pip install 'neuronx-distributed-inference==0.8.*' --extra-index-url "
           "https://pip.repos.neuron.amazonaws.com (see README, 'Neuron SDKs'), or use "
           "handler.backend: torch")


def resolve_model_class(name: str) -> type:
    """"models.llama.modeling_llama.NeuronLlamaForCausalLM" -> the class in the SDK."""
    return import_sdk_class(PACKAGE, name, sdk=(PACKAGE, "neuronx_distributed", "torch_neuronx"),
                            backend="nxdi", key="handler.nxdi.model_class",
                            example="e.g. 'models.llama.modeling_llama.NeuronLlamaForCausalLM'",
                            install=INSTALL)


def build_neuron_config(spec: dict[str, Any]) -> Any:
    """NeuronConfig from our plain-data spec (neuron_cache.key.nxdi_neuron_config).

    NeuronConfig logs and drops keywords it does not know (models/config.py:L604-L605), so a
    renamed field would compile another model silently: every one we pass must come back.
    """
    from neuronx_distributed_inference.models.config import NeuronConfig, OnDeviceSamplingConfig

    kwargs = dict(spec)
    sampling = kwargs.pop("on_device_sampling_config")
    nc = NeuronConfig(**kwargs, on_device_sampling_config=(
        OnDeviceSamplingConfig(**sampling) if sampling else None))
    lost = sorted(k for k in kwargs if not hasattr(nc, k))
    if lost:
        raise ConfigError(f"this neuronx-distributed-inference's NeuronConfig has no {lost}; "
                          "use 0.3 (SDK 2.23) to 0.8 (SDK 2.28)")
    return nc


class _CompileAdapter:
    """NxD Inference's compile(dir)/load(dir) as the load/to_neuron/save neuron_cache drives.

    compile() writes neuron_config.json and model.pt into a directory (application_base.py:
    L292-L315); we compile into a private one, load from it, and save() copies it into the
    cache's staging directory, which the store publishes atomically.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._from: str | None = None
        self._staged: str | None = None

    def load(self, directory: str) -> None:
        self._from = directory

    def to_neuron(self) -> None:
        if self._from is not None:
            self.model.load(self._from)
            return
        self._staged = tempfile.mkdtemp(prefix="inf2serve-nxdi-")
        try:
            self.model.compile(self._staged)
            self.model.load(self._staged)
        except BaseException:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None
            raise

    def save(self, directory: str) -> None:
        if self._staged is None:
            raise GenerationError("nothing compiled to save")
        try:
            shutil.copytree(self._staged, directory, dirs_exist_ok=True)
        finally:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None


def prefill_inputs(prompt: list[int], largest_bucket: int) -> tuple[list[int], list[int]]:
    """Token ids and position ids that give the logits after `prompt`'s last token.

    Context encoding pads positions with 1 (models/model_wrapper.py:L762-L778) and takes
    the hidden state at the first maximal position id (models/model_base.py:L1012-L1016).
    For one token that is the first pad, not the prompt: its logits would be those after
    [token, pad]. So a 1-token prompt is sent as the largest bucket, positions all 0: the
    bucket is then chosen as the input fills it exactly (model_wrapper.py:L898-L916), no
    pad is added, and the first maximum is the prompt. The extra rows are pads after the
    token under a causal mask, and the K/V they leave at positions 1.. are rewritten by
    each decode step before any token attends to them (attention below the position id).
    """
    if len(prompt) == 1:
        return prompt * largest_bucket, [0] * largest_bucket
    return prompt, list(range(len(prompt)))


def capabilities(on_device_sampling: bool, global_topk: int) -> Capabilities:
    """Context encoding returns the last prompt position's logits only, so no prompt
    logprobs; the on-device sampler (modules/generation/sampling.py:L99-L182) takes per
    row only top-k (at most global_topk), top-p and temperature, draws from the device's
    own RNG and returns token ids, not logits."""
    why = ("handler.neuron.on_device_sampling samples on the device, which takes only top_k, "
           "top_p and temperature per request and returns token ids; turn it off to sample "
           "on the host")
    unsupported = {"prompt_logprobs": "handler.backend nxdi returns logits for the last "
                   "prompt position only, so there are no prompt logprobs; send echo without "
                   "logprobs, or use backend torch"}
    if not on_device_sampling:
        return Capabilities(unsupported)
    for feature in ("seed", "min_new_tokens", "repetition_penalty", "frequency_penalty",
                    "presence_penalty", "logprobs"):
        unsupported[feature] = why
    return Capabilities(unsupported, max_top_k=global_topk,
                        max_top_k_setting="handler.neuron.global_top_k, the most the on-device "
                        "sampler considers")


def device_sampling_row(p: SamplingParams, caps: Capabilities, global_topk: int
                        ) -> list[float]:
    """(top_k, top_p, temperature) for the on-device sampler (sampling.py:L99-L182), for a
    request the APIs already checked against `caps` (checked again: the engine is public)."""
    check_sampling(p, caps)
    if p.greedy:
        return [1.0, 1.0, 1.0]
    # top_k 0 ("off") becomes global_topk: 0 means uniform there (sampling.py:L133-L134)
    return [float(p.top_k or global_topk), float(p.top_p), float(p.temperature)]


@dataclass
class _Row:
    """One slot's sequence: its KV-cache line's length, the next decode's input token, the
    host sampler (None on the device) and the request's parameters."""

    length: int
    last: int
    sampler: Any
    params: SamplingParams


class NxdiBackend(Backend):
    def __init__(self, checkpoint: Path, config: HandlerConfig, model_dir: Path,
                 cores: Sequence[int] | None = None) -> None:
        n, x = config.neuron, config.nxdi
        if config.batching != "continuous":
            raise ConfigError("handler.batching: backend nxdi runs continuous batching only")
        self.batch_size, self.max_length = config.batch_size, config.max_length
        ctx, _, _ = nxdi_buckets(config)
        self.largest_bucket = ctx[-1]
        # checked at submit, so a too-long prompt is a 400 for that request
        self.max_prompt_length = min(ctx[-1], config.max_length - 1)
        self.on_device, self.global_topk = n.on_device_sampling, n.global_top_k
        self.capabilities = capabilities(n.on_device_sampling, n.global_top_k)
        self._claim = backend_claim(n, cores)
        try:
            apply_neuron_env(neuron_env(config, self._claim.cores, model_dir))
            model_config = read_model_config(checkpoint)
            self.eos_token_ids = read_eos_ids(checkpoint, model_config)
            model_cls = resolve_model_class(x.model_class)
            from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

            inputs = key_inputs(config, model_config)
            neuron_config = build_neuron_config(inputs.neuron_config)
            inference_config = model_cls.get_config_cls()(
                neuron_config, load_config=load_pretrained_config(str(checkpoint)))
            self.model = model_cls(str(checkpoint), inference_config)
            store = CacheStore(cache_root(config, model_dir))
            self.start = compile_or_load(store, inputs, _CompileAdapter(self.model),
                                         n.on_mismatch)
        except BaseException:
            self._claim.release()
            raise
        self.rows: dict[int, _Row] = {}

    def _forward(self, ids: list[list[int]], positions: list[list[int]], seq_ids: list[int],
                 params: list[SamplingParams], samplers: list[Any]) -> list[int]:
        """One model call; the next token of each row, in row order."""
        import torch

        rows = [device_sampling_row(p, self.capabilities, self.global_topk) if self.on_device
                else [1.0, 1.0, 1.0] for p in params]
        with torch.inference_mode():  # logits are inference tensors: sample inside
            out = self.model.forward(
                input_ids=torch.tensor(ids, dtype=torch.int64),
                seq_ids=torch.tensor(seq_ids, dtype=torch.int64),  # [n]
                position_ids=torch.tensor(positions, dtype=torch.int64),
                sampling_params=torch.tensor(rows, dtype=torch.float32))  # [n, 3]
            if self.on_device:  # token ids in place of logits (models/model_base.py:L3851-L3876)
                return [int(t) for t in out.hidden_states.reshape(-1)]
            from handlers.backends.sampling import sample_rows

            # [n, 1, vocab] -> [n, vocab]: every row in one batched pass (sampling.py)
            return sample_rows(out.logits[:, -1], samplers)

    def _prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                 params: Sequence[SamplingParams]) -> list[int]:
        import torch

        from handlers.backends.sampling import RowSampler

        out = []
        for slot, prompt, p in zip(slots, prompts, params, strict=True):
            if not 0 < len(prompt) <= self.max_prompt_length:
                raise RequestError("prompt", f"{len(prompt)} tokens; expected 1 to "
                                   f"{self.max_prompt_length} (the largest prefill bucket)")
            ids, positions = prefill_inputs(list(prompt), self.largest_bucket)
            sampler = None if self.on_device else RowSampler(p, self.eos_token_ids,
                                                             torch.device("cpu"), prompt)
            # one context row per call under continuous batching (kv_cache_manager.py:L488-L489)
            token = self._forward([ids], [positions], [slot], [p], [sampler])[0]
            self.rows[slot] = _Row(len(prompt), token, sampler, p)
            out.append(token)
        return out

    def _decode(self, slots: Sequence[int]) -> Rows:
        # every running slot, as the base class checks: padding writes row 0 into every
        # line not in the call (model_wrapper.py:L515), so a decode of fewer would
        # overwrite the others' KV-cache lines
        order = sorted(slots)  # a full batch runs rows as cache lines 0..n-1 (L1342-L1348)
        rows = [self.rows[s] for s in order]
        tokens = self._forward([[r.last] for r in rows], [[r.length] for r in rows], order,
                               [r.params for r in rows], [r.sampler for r in rows])
        by_slot = {}
        for slot, row, token in zip(order, rows, tokens, strict=True):
            row.length, row.last = row.length + 1, token
            by_slot[slot] = [token]
        return [by_slot[s] for s in slots]

    def _release(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.rows.pop(s, None)

    def token_logprobs(self, slot: int) -> TokenLogprob | None:
        """Host sampling only (on-device sampling refuses logprobs)."""
        row = self.rows.get(slot)
        return row.sampler.last if row is not None and row.sampler is not None else None

    def warmup(self) -> None:
        """One prefill and one decode on a free slot (load() already ran every graph once)."""
        if self.rows:
            return
        free, eos = 0, min(self.eos_token_ids) if self.eos_token_ids else 0
        self.prefill([free], [[eos] * min(2, self.max_prompt_length)], [SamplingParams()])
        self.decode([free])
        self.release([free])

    def close(self) -> None:
        try:
            self.rows.clear()
        finally:
            self._claim.release()
