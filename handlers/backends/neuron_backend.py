"""transformers-neuronx on Inferentia2, behind the same prefill/decode/release contract.

Start-up, in order (the order matters: the runtime reads its environment once):
claim a block of tp_degree NeuronCores -> apply the Neuron environment -> import the
SDK -> from_pretrained -> compile, or load from the versioned compile cache. The calls
to the compiled model, one runner per batching mode (continuous, speculative, micro),
live in handlers/backends/neuron_runners.py.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from handlers.backends.base import (
    Backend,
    Rows,
    SamplingParams,
    TokenLogprob,
    import_sdk_class,
    read_eos_ids,
)
from handlers.backends.capabilities import GREEDY_ROW
from handlers.backends.neuron_cores import backend_claim
from handlers.backends.neuron_env import apply_neuron_env, cache_root, neuron_env
from handlers.backends.neuron_families import check_family
from handlers.backends.neuron_runners import (
    ContinuousRunner,
    MicroRunner,
    Row,
    Speculation,
    SpeculativeRunner,
    capabilities,
    check_keywords,
    generation_config,
)
from handlers.config import HandlerConfig
from handlers.errors import ConfigError, RequestError
from handlers.families import family_name
from handlers.structured.masks import SlotGrammars
from neuron_cache.compile import compile_or_load
from neuron_cache.key import (
    AMP_DTYPES,
    context_buckets,
    key_inputs,
    read_model_config,
)
from neuron_cache.store import CacheStore

log = logging.getLogger(__name__)
INSTALL = ("install the Neuron SDK from the AWS Neuron repository: pip install "
           "transformers-neuronx --extra-index-url=https://pip.repos.neuron.amazonaws.com "
           "(on an Inf2 instance with the Neuron driver), or use handler.backend: torch")


def resolve_model_class(name: str) -> type:
    """"llama.model.LlamaForSampling" -> transformers_neuronx.llama.model.LlamaForSampling."""
    return import_sdk_class("transformers_neuronx", name,
                            sdk=("transformers_neuronx", "torch_neuronx"), backend="neuron",
                            key="handler.neuron.model_class_name (or the family's class)",
                            example="'<module>.<Class>', e.g. 'llama.model.LlamaForSampling'",
                            install=INSTALL)


def read_draft_config(draft_dir: Path) -> dict[str, Any]:
    """The speculation draft's config.json (the compile-cache key holds it)."""
    if not (draft_dir / "config.json").is_file():
        raise ConfigError(f"handler.neuron.speculation.draft_checkpoint: {draft_dir} has no "
                          "config.json; package the draft with `inf2serve package "
                          "--draft-checkpoint DIR`")
    return read_model_config(draft_dir)


QUANT_KEY = "handler.neuron.quantization"


def _quant_configs(spec: dict[str, Any]) -> dict[str, Any]:
    """QuantizationConfig / KVCacheQuantizationConfig keywords, refusing what transformers-
    neuronx would fail on or ignore (aws-neuron/transformers-neuronx@1ade6d7:
    src/transformers_neuronx/), named by our keys."""
    out: dict[str, Any] = {}
    if not (spec.get("quant") or spec.get("kv_cache_quant")):
        return out
    try:
        from transformers_neuronx.config import KVCacheQuantizationConfig, QuantizationConfig
    except ImportError as exc:
        raise ConfigError(f"{QUANT_KEY}: this transformers-neuronx has no "
                          f"QuantizationConfig/KVCacheQuantizationConfig ({exc}); use 0.13.x "
                          "(Neuron SDK 2.21+)") from exc
    if q := spec.get("quant"):  # what the SDK would fail on, handlers/config.py refused
        out["quant"] = QuantizationConfig(**q)
    if kv := spec.get("kv_cache_quant"):
        out["kv_cache_quant"] = KVCacheQuantizationConfig(**kv)
    return out


def host_logits_dtype(config: HandlerConfig) -> str | None:
    """cast_logits_dtype where our sampler reads the logits (continuous batching, host
    sampling, no speculation) and the model runs in bf16 or fp16: that dtype, else None (the
    SDK's float32).

    The device's logits are already in the model's dtype (the LM head's dot keeps its
    weight's, layers/transformer.py:L282-L288, hlo.py:L307-L312), and forward() casts them
    on the host (base.py:L641-L647, L715): to float32 that is the same numbers, so every
    request samples exactly as before, at 4 bytes x vocab x every compiled row written each
    step (33 MB at 64 x 128,256); left in bf16 the cast is a no-op and the sampler converts
    only the rows it reads (sampling/scan.py). Host-only: no graph changes, so not keyed.
    micro keeps float32: sample() draws on the logits in their own dtype."""
    n = config.neuron
    if (config.batching != "continuous" or n.on_device_sampling or n.speculation.enabled
            or config.amp not in ("bf16", "f16")):
        return None
    return AMP_DTYPES[config.amp]


def build_neuron_config(spec: dict[str, Any], batch_size: int,
                        compilation_worker_count: int = 0,
                        on_device_embedding: bool = False,
                        cast_logits_dtype: str | None = None) -> Any:
    """Our plain-data spec (neuron_cache.key.neuron_config_spec) as SDK objects.

    compilation_worker_count is not in the spec (it changes no graph): 0 leaves the
    SDK's default, every graph compiled at once. batch_size sizes on-device sampling's
    per-line parameter lists; every line starts greedy. on_device_embedding: speculation
    needs it on both models (its key has the speculation entry, so it is keyed).
    """
    from transformers_neuronx.config import ContinuousBatchingConfig, NeuronConfig
    from transformers_neuronx.constants import GQA

    kwargs: dict[str, Any] = _quant_configs(spec)
    if on_device_embedding:
        kwargs["on_device_embedding"] = True
    if flags := spec.get("on_device_generation"):
        kwargs["on_device_generation"] = generation_config(flags, [GREEDY_ROW] * batch_size)
    if spec.get("continuous_batching"):
        # keyword-only in 0.13 (config.py:L78-L79), which reads it as max_num_seqs; older
        # releases take the same name positionally
        kwargs["continuous_batching"] = ContinuousBatchingConfig(
            batch_size_for_shared_caches=spec["continuous_batching"])
    if spec.get("group_query_attention"):
        kwargs["group_query_attention"] = GQA(spec["group_query_attention"])
    if cast_logits_dtype:  # host-only (base.py:L641-L647), see host_logits_dtype
        kwargs["cast_logits_dtype"] = cast_logits_dtype
    if compilation_worker_count:
        if "compilation_worker_count" not in inspect.signature(NeuronConfig).parameters:
            raise ConfigError("handler.neuron.compilation_worker_count: this transformers-"
                              "neuronx's NeuronConfig has no compilation_worker_count (0.13+); "
                              "set it to 0 (compile every graph at once)")
        kwargs["compilation_worker_count"] = compilation_worker_count
    return NeuronConfig(**kwargs)


class NeuronBackend(Backend):
    def __init__(self, checkpoint: Path, config: HandlerConfig, model_dir: Path,
                 cores: Sequence[int] | None = None) -> None:
        n = config.neuron
        sp = n.speculation
        self.batch_size = config.batch_size
        # speculation writes k positions past a row's last token: a sequence may use only
        # n_positions - k of them (the SDK's sample() asserts the same, fused_speculation.py:
        # L546-L549), so the engine's length cut leaves that room
        self.max_length = config.max_length - (sp.length if sp.enabled else 0)
        self.max_tokens_per_step = sp.length + 1 if sp.enabled else 1
        # checked at submit, so a too-long prompt is a 400 for that request, not a failed batch
        self.max_prompt_length = min(context_buckets(config)[-1], self.max_length - 1)
        # cores given: the TorchServe worker holds their claim for its whole life, so a
        # restarted engine process gets the same block back (handlers/engine/client.py)
        self._claim = backend_claim(n, cores)
        try:
            apply_neuron_env(neuron_env(config, self._claim.cores, model_dir))
            model_config = read_model_config(checkpoint)
            self.eos_token_ids = read_eos_ids(checkpoint, model_config)
            draft_dir = Path(model_dir) / sp.draft_checkpoint if sp.enabled else None
            draft_config = read_draft_config(draft_dir) if draft_dir else None
            class_name = check_family(config, model_config, draft_config)
            model_cls = resolve_model_class(class_name)
            runner_cls = ContinuousRunner if config.batching == "continuous" else MicroRunner
            runner_cls.check(model_cls, context_buckets(config))  # before compiling
            inputs = key_inputs(config, model_config, draft_model_config=draft_config,
                                model_class=class_name, family=family_name(model_config))

            def model_kwargs() -> dict[str, Any]:  # a NeuronConfig per model: the SDK edits it
                return {"batch_size": config.batch_size, "tp_degree": n.tp_degree,
                        "amp": config.amp, "n_positions": config.max_length,
                        "context_length_estimate": context_buckets(config),
                        "neuron_config": build_neuron_config(
                            inputs.neuron_config, config.batch_size,
                            n.compilation_worker_count, on_device_embedding=sp.enabled,
                            cast_logits_dtype=host_logits_dtype(config))}

            # from_pretrained hands these to the class (module.py:L424-L426)
            check_keywords(model_cls, list(model_kwargs()), f"model class {class_name}")
            self.model = model_cls.from_pretrained(str(checkpoint), **model_kwargs())
            compiled: Any = self.model
            if draft_dir is not None:
                draft = model_cls.from_pretrained(str(draft_dir), **model_kwargs())
                compiled = Speculation(self.model, draft, sp.length,
                                        n.compilation_worker_count)
            store = CacheStore(cache_root(config, model_dir))
            self.start = compile_or_load(store, inputs, compiled, n.on_mismatch)
        except BaseException:
            self._claim.release()
            raise
        eos = min(self.eos_token_ids) if self.eos_token_ids else 0
        if isinstance(compiled, Speculation):
            self._runner = SpeculativeRunner(self.model, config, context_buckets(config), eos,
                                              compiled.fused)
        else:
            self._runner = runner_cls(self.model, config, context_buckets(config), eos)
        self.capabilities = capabilities(config)
        if "grammar" not in self.capabilities.unsupported:  # continuous, host sampling
            vocab = int(model_config.get("vocab_size") or 0)
            self.grammars = self._runner.grammars = SlotGrammars(self.batch_size, vocab)

    def _prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                 params: Sequence[SamplingParams]) -> list[int]:
        for prompt in prompts:
            if not 0 < len(prompt) < self.max_length:
                raise RequestError("prompt", f"{len(prompt)} tokens; expected 1 to "
                                   f"{self.max_length - 1} (handler.max_length {self.max_length})")
        return self._runner.prefill(list(slots), [list(p) for p in prompts], list(params),
                                    self.eos_token_ids)

    def _decode(self, slots: Sequence[int]) -> Rows:
        return self._runner.decode_rows(list(slots))

    def _release(self, slots: Sequence[int]) -> None:
        self._runner.release(list(slots))

    def token_logprobs(self, slot: int) -> TokenLogprob | None:
        """Continuous batching with host sampling only (micro batching and on-device sampling
        refuse logprobs)."""
        row = self._runner.rows.get(slot)
        return row.sampler.last if isinstance(row, Row) and row.sampler is not None else None

    def warmup(self) -> None:
        """Touch every prefill bucket once, then one decode step."""
        self._runner.warmup()

    def close(self) -> None:
        try:
            self._runner.release(list(range(self.batch_size)))
        finally:
            self._claim.release()
