"""Model backends behind one small interface (`base.Backend`).

Backends are imported lazily so that the scheduler, config and CLI import
without torch or the Neuron SDK.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from handlers.backends.base import Backend, Capabilities
    from handlers.config import HandlerConfig


def capabilities_for(config: HandlerConfig) -> Capabilities:
    """What the configured backend will honour (its `capabilities` once loaded), without
    loading it: for packaging checks and tests. Each backend module declares its own."""
    if config.backend == "neuron":
        from handlers.backends.neuron_backend import capabilities

        return capabilities(config)
    if config.backend == "nxdi":
        from handlers.backends.nxdi_backend import capabilities

        return capabilities(config.neuron.on_device_sampling, config.neuron.global_top_k)
    if config.backend == "synthetic":
        from handlers.backends.synthetic_backend import capabilities

        return capabilities(config)
    from handlers.backends.base import Capabilities

    return Capabilities()  # torch: host sampling from full logits, every prompt position


def family_problems(config: HandlerConfig, model_config: dict[str, Any],
                    draft_config: dict[str, Any] | None = None) -> list[str]:
    """What the configured Neuron backend's SDK refuses, ignores or fails on of this
    checkpoint's family with these settings, one line each (none for torch and synthetic).
    Each backend keeps its per-family rules in one module: neuron_families, nxdi_families."""
    if config.backend == "neuron":
        from handlers.backends.neuron_families import problems

        return problems(config, model_config, draft_config)
    if config.backend == "nxdi":
        from handlers.backends.nxdi_families import problems

        return problems(config, model_config, draft_config)
    return []


def load_backend(config: HandlerConfig, model_dir: Path,
                 cores: Sequence[int] | None = None, tokenizer: object | None = None) -> Backend:
    """Build the configured backend; the checkpoint path is resolved against model_dir.

    `cores`: NeuronCores the TorchServe worker already claimed for this process (None:
    the Neuron backends claim their own). `tokenizer`: the engine's, for the synthetic
    device's words (None: it loads the checkpoint's)."""
    checkpoint = (model_dir / config.checkpoint).resolve()
    if config.backend == "neuron":
        from handlers.backends.neuron_backend import NeuronBackend

        return NeuronBackend(checkpoint, config, model_dir=model_dir, cores=cores)
    if config.backend == "synthetic":  # no torch: runs on any transformers the worker has
        from handlers.backends.synthetic_backend import SyntheticBackend

        return SyntheticBackend(checkpoint, config, tokenizer=tokenizer)
    if config.backend == "nxdi":
        from handlers.backends.nxdi_backend import NxdiBackend

        return NxdiBackend(checkpoint, config, model_dir=model_dir, cores=cores)
    try:
        from handlers.backends.torch_backend import TorchBackend
    except ImportError as exc:  # a Neuron SDK stack ships transformers 4.x
        import transformers

        from handlers.errors import ConfigError

        raise ConfigError(
            f"handler.backend: 'torch' needs transformers>=5 (its attention and cache "
            f"interfaces), this worker has {transformers.__version__}; use backend 'neuron' "
            f"on a Neuron SDK stack ({exc})") from exc
    return TorchBackend(checkpoint, config)
