"""What NxD Inference 0.8 (Neuron SDK 2.28) needs of each family, beyond its class.

One place for the nxdi backend's per-family rules, so nxdi_backend.py stays one code
path: every family is a NeuronBaseForCausalLM with the same forward, buckets, continuous
batching, sampling and fused speculation; the classes differ in what their
InferenceConfig and attention read of config.json and in how they convert the state
dict. `problems` lists every setting or checkpoint field the SDK would refuse, ignore or
fail on, one line each with the fix; `validate`, `package` and the backend's start run
it, and the fake (tests/fakes/nxdi) enforces the same lines.

Citations: aws-neuron/neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/
(ND = aws-neuron/neuronx-distributed@73ab227:src/neuronx_distributed/).
"""

from __future__ import annotations

from typing import Any

from handlers.config import HandlerConfig
from handlers.errors import ConfigError
from handlers.families import family_for, model_class_for, rope_scaling

#: the first NxD Inference whose Llama class reads config.json's sliding_window (0.7.x,
#: Neuron SDK 2.27: models/llama/modeling_llama.py at fcb5a86 passes it, at f9e99f9 (2.25)
#: it does not); older releases run a Mistral v0.1 with full attention
LLAMA_WINDOW_SINCE = (0, 7)


def _window(model_config: dict[str, Any]) -> int | None:
    value = model_config.get("sliding_window")
    return value if isinstance(value, int) and not isinstance(value, bool) and value else None


def binding_window(model_config: dict[str, Any], max_length: int) -> int | None:
    """config.json's sliding window where it binds within max_length: a token at position
    p attends to positions > p - window, so the window changes nothing while max_length
    <= window. Qwen2/Qwen3 configs carry one that applies only with use_sliding_window."""
    window = _window(model_config)
    if window is None or window >= max_length:
        return None
    if model_config.get("model_type") in ("qwen2", "qwen3") and \
            not model_config.get("use_sliding_window"):
        return None
    return window


def check_family(config: HandlerConfig, model_config: dict[str, Any],
                 draft_config: dict[str, Any] | None = None) -> str:
    """The class the backend builds this checkpoint with, after every rule below and the
    installed release's: the backend's start runs it before compiling anything."""
    found = problems(config, model_config, draft_config)
    found += version_problems(model_config, config, installed_version())
    if found:
        raise ConfigError("; ".join(found))
    return model_class_for("nxdi", model_config, config.nxdi.model_class)


def installed_version() -> tuple[int, ...]:
    """The installed neuronx-distributed-inference as numbers (0.8.16251 -> (0, 8, 16251))."""
    from importlib import metadata

    try:
        text = metadata.version("neuronx-distributed-inference")
    except metadata.PackageNotFoundError:
        return ()
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


def problems(config: HandlerConfig, model_config: dict[str, Any],
             draft_config: dict[str, Any] | None = None) -> list[str]:
    """Every reason backend nxdi cannot run this checkpoint with these settings."""
    try:
        model_class_for("nxdi", model_config, config.nxdi.model_class)
    except ValueError as exc:
        return [str(exc)]
    family = family_for(model_config.get("model_type"))
    name, out = family.name, []
    sp, x = config.neuron.speculation, config.nxdi
    if draft_config is not None and family_for(draft_config.get("model_type")) != family:
        # the draft is built with the model's class: FusedSpecNeuronConfig(model_cls._model_cls,
        # draft_config=model_cls.get_config_cls()(...)), as inference_demo.py:L500-L532
        out.append(f"handler.neuron.speculation: the draft is a "
                   f"{draft_config.get('model_type')!r} checkpoint, the model {name!r}; NxD "
                   "Inference builds the draft with the model's class: use a draft of the "
                   "model's family")
    window = _window(model_config)
    if name == "mistral" and window and sp.enabled:
        # modules/attention/attention_base.py:L321-L322 asserts the cascaded token-generation
        # kernel for any sliding_window with fused speculation
        out.append(f"handler.neuron.speculation: config.json's sliding_window {window} with "
                   "fused speculation needs NxD Inference's cascaded attention kernel "
                   "(attention_base.py:L321-L322), which inf2serve does not enable on Inf2; "
                   "turn speculation off")
    if name in ("qwen2", "qwen3", "mixtral"):
        # their attention passes no sliding_window (qwen2/modeling_qwen2.py:L83-L101,
        # qwen3/modeling_qwen3.py:L82-L101, mixtral/modeling_mixtral.py:L161-L176)
        bound = binding_window(model_config, config.max_length)
        if bound:
            out.append(f"config.json: sliding_window {bound} within handler.max_length "
                       f"{config.max_length}; NxD Inference's {name} class ignores it and would "
                       f"run full attention: set handler.max_length <= {bound}, or use backend "
                       "torch")
        if scaling := rope_scaling(model_config):
            # RotaryEmbedding(dim, max_position_embeddings, base) only
            out.append(f"config.json: rope_scaling {scaling!r}; NxD "
                       f"Inference's {name} class reads rope_theta only and would run unscaled "
                       "RoPE: remove rope_scaling (and keep handler.max_length within the "
                       "unscaled positions), or use backend torch")
    if name == "qwen3":
        if model_config.get("attention_bias"):
            out.append("config.json: attention_bias true; NxD Inference's Qwen3 attention "
                       "has no q/k/v bias (qwen3/modeling_qwen3.py:L92-L101) and would drop it; "
                       "use backend torch")
        if x.fused_qkv:
            # convert_hf_to_neuron_state_dict renames q/k norms but fuses no Wqkv
            # (qwen3/modeling_qwen3.py:L206-L233)
            out.append("handler.nxdi.fused_qkv: NxD Inference's Qwen3 does not fuse q/k/v "
                       "weights (qwen3/modeling_qwen3.py:L206-L233); set it false")
    if name == "mixtral":
        out += _mixtral(config, model_config)
    return out


def _mixtral(config: HandlerConfig, model_config: dict[str, Any]) -> list[str]:
    out = []
    tp, inter = config.neuron.tp_degree, model_config.get("intermediate_size")
    if isinstance(inter, int) and inter % tp:
        # each expert's gate/up and down projections are split over tp without padding
        # (ND modules/moe/moe_parallel_layers.py:L175-L230, L303-L350 ->
        # parallel_layers/layers.py:L630, L888; utils.py:L91-L100 asserts divisibility);
        # NxD Inference 0.8's Mixtral uses no expert parallelism (modules/moe.py:L6-L45)
        fits = [t for t in (1, 2, 4, 8, 24) if not inter % t]
        out.append(f"handler.neuron.tp_degree: {tp} does not divide config.json's "
                   f"intermediate_size {inter}; NxD Inference splits every expert over "
                   f"tp_degree without padding (neuronx-distributed's divide() asserts): use "
                   f"one of {fits}")
    if config.neuron.quantization.weights:
        # convert_mixtral_to_neuron_state_dict fuses each expert's w1/w3/w2 weights into
        # gate_up_proj/down_proj but not their scales (mixtral/modeling_mixtral.py:L52-L130)
        out.append("handler.neuron.quantization.weights: NxD Inference's Mixtral fuses the "
                   "experts' weights but not their quantization scales "
                   "(mixtral/modeling_mixtral.py:L52-L130); turn quantized weights off")
    if config.nxdi.fused_qkv:
        out.append("handler.nxdi.fused_qkv: NxD Inference's Mixtral does not fuse q/k/v "
                   "weights (mixtral/modeling_mixtral.py:L52-L130); set it false")
    return out


def version_problems(model_config: dict[str, Any], config: HandlerConfig,
                     version: tuple[int, ...]) -> list[str]:
    """What depends on the installed NxD Inference (the backend's start knows it; validate
    checks against 0.8): its Llama class ignores a Mistral's window before 0.7."""
    window = _window(model_config)
    if (family_for(model_config.get("model_type")) == family_for("mistral") and window
            and window < config.max_length and version
            and tuple(version[:2]) < LLAMA_WINDOW_SINCE):
        found = ".".join(str(v) for v in version)
        return [f"config.json: sliding_window {window} within handler.max_length "
                f"{config.max_length}; NxD Inference {found}'s Llama class reads no "
                "sliding_window (from 0.7, Neuron SDK 2.27) and would run full attention: set "
                f"handler.max_length <= {window}, or use Neuron SDK 2.27+"]
    return []
