"""The Neuron environment of a worker: computed by a pure function, applied in one place.

The runtime reads NEURON_RT_* when it initialises (at the first Neuron import), and
the compiler reads NEURON_CC_FLAGS at compile time, so `apply_neuron_env` must run
before transformers-neuronx is imported. Nothing here runs at import time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from handlers.errors import ConfigError

if TYPE_CHECKING:
    from handlers.config import HandlerConfig

log = logging.getLogger(__name__)

#: the compiler's own cache, inside our compile-cache directory
COMPILER_CACHE_SUBDIR = "neuronx-cc"
#: fp8 as NeuronCore-v2 runs it: torch's float8_e4m3fn converted to the core's e4m3
FP8_FLAG = "--internal-hlo2tensorizer-options=--experimental-unsafe-fp8e4m3fn-as-fp8e4m3"


def format_cores(cores: Sequence[int]) -> str:
    """[2, 3] -> "2-3" (the runtime's range syntax); a lone core -> "2"."""
    cores = sorted(cores)
    if not cores:
        raise ConfigError("no NeuronCores to make visible; expected at least one core id")
    if cores != list(range(cores[0], cores[-1] + 1)):
        return ",".join(str(c) for c in cores)
    return str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"


def cache_root(config: HandlerConfig, model_dir: Path) -> Path:
    """handler.neuron.cache_dir, resolved against the model directory (absolute paths win)."""
    return (Path(model_dir) / config.neuron.cache_dir).resolve()


def neuron_env(config: HandlerConfig, visible_cores: Sequence[int],
               model_dir: Path = Path(".")) -> dict[str, str]:
    """The variables a worker running `config` on `visible_cores` needs; no side effects."""
    flags = [str(f) for f in config.neuron.compiler_flags]
    spaced = [f for f in flags if not f or any(ch.isspace() for ch in f)]
    if spaced:
        raise ConfigError(f"handler.neuron.compiler_flags: {spaced!r} contain whitespace; "
                          "NEURON_CC_FLAGS is split on spaces, so give each flag as its own "
                          "list item, e.g. ['--model-type=transformer', '-O2']")
    if len(visible_cores) != config.neuron.tp_degree:
        raise ConfigError(f"{len(visible_cores)} visible NeuronCores for tp_degree "
                          f"{config.neuron.tp_degree}; a worker needs exactly tp_degree cores")
    env = {}
    q = config.neuron.quantization
    if "fp8" in (q.weights, q.kv_cache):
        if config.backend == "nxdi":
            # NxD Inference adds the compiler flag itself (models/model_wrapper.py:L148-L157);
            # its guide and demo set these for fp8 (inference_demo.py:L465-L467)
            env.update(XLA_HANDLE_SPECIAL_SCALAR="1", UNSAFE_FP8FNCAST="1")
        elif FP8_FLAG not in flags:
            # transformers-neuronx passes NEURON_CC_FLAGS through; its demo adds this for an
            # fp8 cache, since NeuronCore-v2 runs e4m3, not torch's e4m3fn
            # (aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/
            # generation_demo.py:L558-L559, L570)
            flags.append(FP8_FLAG)
    return {
        "NEURON_CC_FLAGS": " ".join(flags),
        "NEURON_RT_NUM_CORES": str(len(visible_cores)),
        "NEURON_RT_VISIBLE_CORES": format_cores(visible_cores),
        "NEURON_COMPILE_CACHE_URL": str(cache_root(config, model_dir) / COMPILER_CACHE_SUBDIR),
        **env,
    }


def apply_neuron_env(env: dict[str, str],
                     environ: MutableMapping[str, str] | None = None) -> None:
    """Set `env` in the process environment (the one place that does), logging each change."""
    target = os.environ if environ is None else environ
    for name, value in sorted(env.items()):
        if target.get(name) not in (None, value):
            log.info("%s: %r replaces %r inherited from the frontend", name, value, target[name])
        target[name] = value
    log.info("Neuron environment: %s", " ".join(f"{k}={v}" for k, v in sorted(env.items())))
