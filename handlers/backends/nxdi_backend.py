"""NxD Inference (neuronx-distributed-inference) on Inferentia2, behind the same contract.

The Inf2 path of the Neuron SDKs without transformers-neuronx (2.26 on); NxD Inference
supports Inf2 up to SDK 2.28 (the 2.29 notes drop Inf2/Trn1, aws-neuron/aws-neuron-sdk@
81ce03ae:about-neuron/whats-new.rst:L281). Start-up, in order: claim tp_degree NeuronCores
-> apply the Neuron environment -> import the SDK -> NeuronConfig + LlamaInferenceConfig
-> compile, or load from the versioned compile cache (the compiled graphs; weights are
sharded from the checkpoint at every load).

Quantized weights (handler.neuron.quantization.weights): NxD Inference reads every weight
from a pre-quantized checkpoint (models/application_base.py:L635-L641), which we write with
its own save_quantized_state_dict before the first compile, into the entry's
artifacts/quantized/v1/ (published with the compiled graphs, checksummed with them); a
load from the cache reads it there and quantizes nothing. fp8 KV cache and async mode
(handler.nxdi.async_mode) are NeuronConfig settings (see build_neuron_config).

Continuous batching only, as vLLM's NxDI plugin runs it: one context row per call, each
slot a KV-cache line addressed by its seq_id, decode of every running slot per step with
seq_ids sorted. Sampling on the host with each request's own parameters, or on the device
(handler.neuron.on_device_sampling) with per-row top-k/top-p/temperature.

Speculation (handler.neuron.speculation) is NxD Inference's fused speculation, as vLLM's
NxDI integration builds it: the draft's InferenceConfig (a copy of the target's
NeuronConfig) on config.fused_spec_config, one compile of target and draft together. A
decode step drafts S - 1 tokens (S = speculation_length = length + 1), the target checks
them and keeps its own tokens up to the first disagreement: 1 to S tokens a row, read from
`fused_outputs` (models/model_base.py:L2841-L2897). See build_fused_spec_config.
Citations: aws-neuron/neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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
from handlers.backends.capabilities import (
    GRAMMAR_SPECULATION_WHY,
    on_device_capabilities,
    refusing,
)
from handlers.backends.capabilities import device_sampling_row as capabilities_row
from handlers.backends.neuron_cores import backend_claim
from handlers.backends.neuron_env import apply_neuron_env, cache_root, neuron_env
from handlers.backends.nxdi_families import check_family
from handlers.config import HandlerConfig
from handlers.errors import CacheError, ConfigError, GenerationError, RequestError
from handlers.families import family_name
from neuron_cache.compile import compile_or_load
from neuron_cache.key import KeyInputs, key_inputs, nxdi_buckets, read_model_config
from neuron_cache.store import ARTIFACTS, TMP_PREFIX, CacheStore, fsync_dir, fsync_tree

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


#: where a cache entry keeps its pre-quantized checkpoint, under artifacts/ (the version is
#: this layout's; the SDK versions in the key cover the library's own format)
QUANTIZED_DIR = "quantized/v1"
#: the key field naming the weights a quantized entry was made from (see weights_fingerprint)
WEIGHTS_FIELD = "_inf2serve_weights"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def build_neuron_config(spec: dict[str, Any], quantized_checkpoints_path: str | None = None,
                        neuron_config_cls: type | None = None) -> Any:
    """NeuronConfig from our plain-data spec (neuron_cache.key.nxdi_neuron_config).

    NeuronConfig logs and drops keywords it does not know (models/config.py:L604-L605), so a
    renamed field would compile another model silently: every one we pass must come back.
    Two more come from here, not the key: where the pre-quantized checkpoint is (required
    when quantized, L216-L226), and the fp8 KV cache's config. In 0.8 (SDK 2.28) the cache
    dtype comes from kv_quant_config alone, kv_cache_quant only adds the compiler's fp8 flag
    (modules/kvcache/kv_cache_manager.py:L139-L150, models/model_wrapper.py:L148-L157); up
    to 0.7 kv_cache_quant itself makes the cache fp8 and there is no kv_quant_config, which
    that NeuronConfig drops with a warning. We pass both and accept either.

    `neuron_config_cls`: the family's (InferenceConfig.get_neuron_config_cls(): Mixtral's
    is MoENeuronConfig, Qwen's a NeuronConfig that names their attention class,
    models/mixtral/modeling_mixtral.py:L156-L158, qwen2/modeling_qwen2.py:L50-L54).
    """
    from neuronx_distributed_inference.models.config import NeuronConfig, OnDeviceSamplingConfig

    NeuronConfig = neuron_config_cls or NeuronConfig  # noqa: N806

    kwargs = dict(spec)
    sampling = kwargs.pop("on_device_sampling_config")
    speculation = kwargs.pop("speculation", None)  # key data: k and the draft's config.json
    if speculation:  # fused, S = k + 1 (see build_fused_spec_config)
        kwargs.update(speculation_length=speculation["length"] + 1,
                      enable_fused_speculation=True)
    extra: dict[str, Any] = {}
    if kwargs.get("quantized"):
        if not quantized_checkpoints_path:
            raise GenerationError("a quantized NeuronConfig needs quantized_checkpoints_path")
        extra["quantized_checkpoints_path"] = quantized_checkpoints_path
    if kwargs.get("kv_cache_quant"):
        import torch

        # neuronx-distributed's KVQuantizationConfig from a dict (models/config.py:L299-L304):
        # per-tensor K and V, cast without scales, as inference_demo.py:L451-L463 builds it
        extra["kv_quant_config"] = {"quant_dtype": torch.float8_e4m3fn, "direct_cast": True}
    nc = NeuronConfig(**kwargs, **extra, on_device_sampling_config=(
        OnDeviceSamplingConfig(**sampling) if sampling else None))
    lost = sorted(k for k in [*kwargs, *extra] if k != "kv_quant_config" and not hasattr(nc, k))
    if lost:
        raise ConfigError(f"this neuronx-distributed-inference's NeuronConfig has no {lost}; "
                          "use 0.3 (SDK 2.23) to 0.8 (SDK 2.28)")
    if "kv_quant_config" in extra and getattr(nc, "kv_quant_config", None) is None:
        log.info("this NxD Inference has no kv_quant_config (0.7 or older): kv_cache_quant "
                 "alone makes the KV cache fp8")
    return nc


def weights_fingerprint(checkpoint: Path, sample: int = 4096, stride: int = 16 << 20,
                        whole: int = 64 << 20) -> str:
    """Identity of the checkpoint's weight files, for the key of an entry that stores weights
    made from them (the quantized checkpoint): two fine-tunes of one architecture share a
    config.json, so without it the second would load the first's weights from a shared
    cache. sha256 over each file's name and size, its first MiB (a safetensors header
    names every tensor, dtype, shape and offset) and `sample` bytes every `stride` after;
    files up to `whole` bytes entirely. A few MB per start rather than the whole checkpoint;
    weights that differ only inside tensors smaller than `stride` are not told apart."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(checkpoint).iterdir()
                   if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size <= whole:
                while block := f.read(1 << 20):
                    h.update(block)
                continue
            h.update(f.read(1 << 20))
            for offset in [*range(1 << 20, size, stride), size - sample]:
                f.seek(offset)
                h.update(f.read(sample))
    return h.hexdigest()


def write_quantized_checkpoint(model_cls: type, checkpoint: Path, config: Any, dest: Path
                               ) -> None:
    """`model_cls.save_quantized_state_dict` into a new directory beside `dest`, renamed to
    `dest` once complete, so `dest` never names a half-written checkpoint. The SDK writes
    safetensors when quantized_checkpoints_path is an existing directory
    (application_base.py:L744-L768); it reads the whole HF model into host memory to do so."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{dest.name}.", dir=dest.parent))
    nc = config.neuron_config
    previous = nc.quantized_checkpoints_path
    try:
        nc.quantized_checkpoints_path = str(tmp)
        log.info("quantizing %s (%s, %s) into %s", checkpoint, nc.quantization_dtype,
                 nc.quantization_type, dest)
        model_cls.save_quantized_state_dict(str(checkpoint), config)
        if not any(tmp.iterdir()):
            raise GenerationError(f"save_quantized_state_dict wrote nothing to {tmp}")
        fsync_tree(tmp)
        os.rename(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        nc.quantized_checkpoints_path = previous


def speculation_steps(config: HandlerConfig) -> int:
    """S, NxD Inference's speculation_length: the most tokens a fused step yields per row (it
    drafts S - 1 and the target samples S, models/model_base.py:L1854-L1971), so
    handler.neuron.speculation.length (k drafts) + 1; 0 without speculation."""
    sp = config.neuron.speculation
    return sp.length + 1 if sp.enabled else 0


def check_speculation(config: HandlerConfig) -> None:
    """What fused speculation on NxD Inference cannot run, named by our keys (handlers/
    config.py already asked for on-device sampling and continuous batching, which both SDKs
    assert: models/model_base.py:L1807, L1869)."""
    steps = speculation_steps(config)
    if not steps:
        return
    key = "handler.neuron.speculation"
    ctx, _, _ = nxdi_buckets(config)
    if bad := [b for b in ctx if b in (1, steps)]:
        # the fused context graph runs token generation for an input whose length is 1 or
        # speculation_length (models/model_base.py:L3020-L3024), and a prompt is padded to
        # its bucket
        raise ConfigError(f"handler.neuron.context_length_estimate: bucket(s) {bad} equal 1 or "
                          f"{key}.length + 1 ({steps}), which NxD Inference's fused graph takes "
                          "for a decode step; choose other buckets or another length")
    if config.neuron.quantization.weights:
        # the trace quantizes the draft too (models/model_wrapper.py:L1514-L1527), but its
        # weights are read from its checkpoint as they are (application_base.py:L658-L671)
        raise ConfigError(f"{key}: backend nxdi does not run a draft with handler.neuron."
                          "quantization.weights (NxD Inference would quantize the draft's graph "
                          "but not its checkpoint); turn one of them off")
    if config.nxdi.async_mode:
        raise ConfigError(f"{key}: backend nxdi does not run speculation with handler.nxdi."
                          "async_mode yet; turn one of them off")


def read_draft_config(draft_dir: Path) -> dict[str, Any]:
    """The draft's config.json: its graph settings are part of the compile-cache key."""
    if not (draft_dir / "config.json").is_file():
        raise ConfigError(f"handler.neuron.speculation.draft_checkpoint: {draft_dir} has no "
                          "config.json; package the draft with `inf2serve package "
                          "--draft-checkpoint DIR`")
    return read_model_config(draft_dir)


def build_fused_spec_config(model_cls: type, target_config: Any, draft_dir: Path) -> Any:
    """FusedSpecNeuronConfig for config.fused_spec_config, built as NxD Inference's demo and
    vLLM build it (inference_demo.py:L500-L532): the draft's NeuronConfig is a copy of the
    target's without speculation (the fused graph forces the draft greedy,
    models/model_base.py:L1675-L1678), its model config from its own config.json. Its
    weights are read from draft_dir at every load (application_base.py:L658-L671)."""
    from neuronx_distributed_inference.models.config import FusedSpecNeuronConfig
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    draft_neuron_config = copy.deepcopy(target_config.neuron_config)
    draft_neuron_config.speculation_length = 0
    draft_neuron_config.enable_fused_speculation = False
    draft_config = model_cls.get_config_cls()(
        draft_neuron_config, load_config=load_pretrained_config(str(draft_dir)))
    return FusedSpecNeuronConfig(model_cls._model_cls, draft_config=draft_config,
                                 draft_model_path=str(draft_dir))


def accepted_rows(fused_outputs: Sequence[Any], positions: list[int], steps: int
                  ) -> list[list[int]]:
    """Each row's tokens from a fused decode step: `fused_outputs` is [accepted tokens
    [n, S] (-1 after the accepted ones), next input ids, next attention mask, next position
    ids [n, 1]] (models/model_base.py:L2841-L2897); a row kept next_pos - pos tokens (as
    vLLM counts them)."""
    accepted, next_pos = fused_outputs[0].tolist(), fused_outputs[3].reshape(-1).tolist()
    rows = []
    for tokens, start, end in zip(accepted, positions, next_pos, strict=True):
        count = int(end) - start
        if not 1 <= count <= steps or -1 in tokens[:count]:
            raise GenerationError(f"fused speculation step at position {start} kept {count} "
                                  f"tokens {tokens}; expected 1 to {steps} before any -1")
        rows.append([int(t) for t in tokens[:count]])
    return rows


@contextmanager
def _kept_fresh(path: Path, every_s: float = 300.0) -> Iterator[None]:
    """Touch `path` every `every_s` while the block runs: `inf2serve cache prune` removes a
    `.tmp-*` directory idle for an hour (neuron_cache.maintain.STALE_TMP_S), and a large
    model's compile writes nothing into ours for longer than that."""
    stop = threading.Event()

    def touch() -> None:
        while not stop.wait(every_s):
            try:
                os.utime(path)
            except OSError:
                return

    thread = threading.Thread(target=touch, name="nxdi-staging-touch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class _CompileAdapter:
    """NxD Inference's compile(dir)/load(dir) as the load/to_neuron/save neuron_cache drives.

    compile() writes neuron_config.json and model.pt into a directory (application_base.py:
    L292-L315); we compile into a private one in the cache root (a hidden `.tmp-*`, pruned if
    a killed start leaves it), load from it, and save() moves it into the cache's staging
    directory, which the store publishes atomically. Quantized, the checkpoint is written
    into the private directory first (the SDK's own order: inference_demo.py:L541-L548),
    since load() reads it; neuron_config.json names where it will be in the entry.
    """

    def __init__(self, model: Any, staging_root: Path, quantize: Any = None,
                 entry_checkpoint: Path | None = None) -> None:
        self.model = model
        self.staging_root = staging_root
        self.quantize = quantize  # (dest: Path) -> None, when quantized
        self.entry_checkpoint = entry_checkpoint
        self._from: str | None = None
        self._staged: str | None = None

    def _checkpoint_at(self, path: Path) -> None:
        self.model.neuron_config.quantized_checkpoints_path = str(path)

    def load(self, directory: str) -> None:
        self._from = directory

    def to_neuron(self) -> None:
        if self._from is not None:
            if self.quantize is not None:
                path = Path(self._from) / QUANTIZED_DIR
                if not path.is_dir():
                    raise CacheError(f"compile-cache entry {Path(self._from).parent} has no "
                                     f"quantized checkpoint ({ARTIFACTS}/{QUANTIZED_DIR}); "
                                     "remove it (`inf2serve cache prune`) and start again")
                self._checkpoint_at(path)
            self.model.load(self._from)
            return
        self.staging_root.mkdir(parents=True, exist_ok=True)
        self._staged = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}nxdi-", dir=self.staging_root)
        try:
            with _kept_fresh(Path(self._staged)):
                if self.quantize is not None:
                    staged = Path(self._staged) / QUANTIZED_DIR
                    self.quantize(staged)
                    self._checkpoint_at(self.entry_checkpoint)  # as neuron_config.json says
                    self.model.compile(self._staged)
                    self._checkpoint_at(staged)
                else:
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
            os.makedirs(directory, exist_ok=True)
            for item in sorted(Path(self._staged).iterdir()):  # renames: one file system
                shutil.move(str(item), os.path.join(directory, item.name))
        finally:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None
            if self.quantize is not None:
                self._checkpoint_at(self.entry_checkpoint)


def quantized_key(inputs: KeyInputs, checkpoint: Path) -> KeyInputs:
    """The key, with the weights' fingerprint when the entry will hold quantized weights
    (what the SDK would refuse of the settings, handlers/config.py already refused)."""
    spec = inputs.neuron_config
    if not spec.get("quantized"):
        return inputs
    weights = weights_fingerprint(checkpoint)
    return dataclasses.replace(inputs, model_config={**inputs.model_config,
                                                     WEIGHTS_FIELD: weights})


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
    prompt = {"prompt_logprobs": "handler.backend nxdi returns logits for the last prompt "
              "position only, so there are no prompt logprobs; send echo without logprobs, or "
              "use backend torch"}
    if not on_device_sampling:
        return Capabilities(prompt)
    return on_device_capabilities(global_topk, prompt)


def device_sampling_row(p: SamplingParams, caps: Capabilities, global_topk: int
                        ) -> list[float]:
    """(top_k, top_p, temperature) as the on-device sampler's float tensor row
    (sampling.py:L99-L182; top_k 0 would mean uniform there, sampling.py:L133-L134)."""
    return [float(x) for x in capabilities_row(p, caps, global_topk)]


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
        n = config.neuron
        if config.batching != "continuous":
            raise ConfigError("handler.batching: backend nxdi runs continuous batching only")
        check_speculation(config)
        self.speculation = speculation_steps(config)  # S, or 0
        self.max_tokens_per_step = self.speculation or 1
        ctx, tkg, _ = nxdi_buckets(config)
        self.batch_size, self.max_length = config.batch_size, config.max_length
        if self.speculation:
            # a decode at position p writes p..p+S-1 and must fit the largest token bucket,
            # p + S <= tkg[-1] (models/model_wrapper.py:L826-L841, L898-L916); the engine
            # decodes a sequence of up to max_length - 1 tokens, at p = max_length - 2
            self.max_length = min(config.max_length, tkg[-1] - self.speculation + 2)
        self.largest_bucket = ctx[-1]
        # checked at submit, so a too-long prompt is a 400 for that request
        self.max_prompt_length = min(ctx[-1], self.max_length - 1)
        self.on_device, self.global_topk = n.on_device_sampling, n.global_top_k
        self.capabilities = capabilities(n.on_device_sampling, n.global_top_k)
        if self.speculation:
            self.capabilities = refusing(self.capabilities, "grammar", GRAMMAR_SPECULATION_WHY)
        self._claim = backend_claim(n, cores)
        try:
            apply_neuron_env(neuron_env(config, self._claim.cores, model_dir))
            model_config = read_model_config(checkpoint)
            self.eos_token_ids = read_eos_ids(checkpoint, model_config)
            draft_dir = Path(model_dir) / n.speculation.draft_checkpoint
            draft_model_config = read_draft_config(draft_dir) if self.speculation else None
            class_name = check_family(config, model_config, draft_model_config)
            model_cls = resolve_model_class(class_name)
            from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

            inputs = quantized_key(key_inputs(
                config, model_config, draft_model_config=draft_model_config,
                model_class=class_name, family=family_name(model_config)), checkpoint)
            store = CacheStore(cache_root(config, model_dir))
            quantized = bool(inputs.neuron_config.get("quantized"))
            entry_checkpoint = store.root / inputs.entry_name / ARTIFACTS / QUANTIZED_DIR
            neuron_config = build_neuron_config(
                inputs.neuron_config, str(entry_checkpoint) if quantized else None,
                model_cls.get_config_cls().get_neuron_config_cls())
            inference_config = model_cls.get_config_cls()(
                neuron_config, load_config=load_pretrained_config(str(checkpoint)))
            if self.speculation:
                inference_config.fused_spec_config = build_fused_spec_config(
                    model_cls, inference_config, draft_dir)
            self.model = model_cls(str(checkpoint), inference_config)
            quantize = functools.partial(write_quantized_checkpoint, model_cls, checkpoint,
                                         inference_config) if quantized else None
            adapter = _CompileAdapter(self.model, store.root, quantize, entry_checkpoint)
            self.start = compile_or_load(store, inputs, adapter, n.on_mismatch)
        except BaseException:
            self._claim.release()
            raise
        self.rows: dict[int, _Row] = {}
        if "grammar" not in self.capabilities.unsupported:  # host sampling, one token a step
            from handlers.structured.masks import SlotGrammars

            self.grammars = SlotGrammars(self.batch_size, int(model_config.get("vocab_size")))

    def _forward(self, ids: list[list[int]], positions: list[list[int]], seq_ids: list[int],
                 params: list[SamplingParams], samplers: list[Any]) -> Rows:
        """One model call; the new tokens of each row, in row order (one, or with fused
        speculation 1 to S after a decode)."""
        import torch

        rows = [device_sampling_row(p, self.capabilities, self.global_topk) if self.on_device
                else [1.0, 1.0, 1.0] for p in params]
        constrained = self.grammars is not None and self.grammars.any(seq_ids)
        if constrained:  # the masks fill on their thread while the device runs
            self.grammars.start(list(seq_ids))
        with torch.inference_mode():  # logits are inference tensors: sample inside
            out = self.model.forward(
                input_ids=torch.tensor(ids, dtype=torch.int64),
                seq_ids=torch.tensor(seq_ids, dtype=torch.int64),  # [n]
                position_ids=torch.tensor(positions, dtype=torch.int64),
                sampling_params=torch.tensor(rows, dtype=torch.float32))  # [n, 3]
            if self.speculation:  # prefill: [token, -1, ...] (model_base.py:L2798-L2839)
                if positions[0][0] == 0:  # the SDK's prefill test (model_base.py:L3591-L3592)
                    return [[int(row[0])] for row in out.fused_outputs[0].tolist()]
                return accepted_rows(out.fused_outputs, [p[0] for p in positions],
                                     self.speculation)
            if self.on_device:  # token ids in place of logits (models/model_base.py:L3851-L3876)
                return [[int(t)] for t in out.hidden_states.reshape(-1)]
            from handlers.backends.sampling import sample_rows

            # [n, 1, vocab] -> [n, vocab]: every row in one batched pass (sampling/batched.py)
            if not constrained:
                return [[t] for t in sample_rows(out.logits[:, -1], samplers)]
            tokens = sample_rows(out.logits[:, -1], samplers, masks=self.grammars.masks())
            self.grammars.took(list(seq_ids), tokens)
            return [[t] for t in tokens]

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
            token = self._forward([ids], [positions], [slot], [p], [sampler])[0][0]
            self.rows[slot] = _Row(len(prompt), token, sampler, p)
            out.append(token)
        return out

    def _decode(self, slots: Sequence[int]) -> Rows:
        # every running slot, as the base class checks: padding writes row 0 into every
        # line not in the call (model_wrapper.py:L515), so a decode of fewer would
        # overwrite the others' KV-cache lines
        order = sorted(slots)  # a full batch runs rows as cache lines 0..n-1 (L1342-L1348)
        rows = [self.rows[s] for s in order]
        new = self._forward([[r.last] for r in rows], [[r.length] for r in rows], order,
                            [r.params for r in rows], [r.sampler for r in rows])
        by_slot = {}
        for slot, row, tokens in zip(order, rows, new, strict=True):
            # the KV-cache line now holds the input and every kept token but the last
            row.length, row.last = row.length + len(tokens), tokens[-1]
            by_slot[slot] = tokens
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
