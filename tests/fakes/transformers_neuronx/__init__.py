"""TEST FAKE of transformers-neuronx for inf2serve's tests; never shipped.

It keeps the real package's public API and rules (argument names, load() before
to_neuron(), compiled batch size and positions, heads divisible by tp_degree,
streamer.put() of [batch, 1] token tensors) and computes with the real
checkpoint on CPU through transformers, so generated text is real. See
_runtime.py for the test hooks (compile/load event log, simulated NeuronCores).
"""

from transformers_neuronx.config import ContinuousBatchingConfig, GenerationConfig, NeuronConfig
from transformers_neuronx.constants import GQA, Layout
from transformers_neuronx.llama.model import LlamaForSampling
from transformers_neuronx.version import __version__

__all__ = ["GQA", "ContinuousBatchingConfig", "GenerationConfig", "Layout", "LlamaForSampling",
           "NeuronConfig", "__version__"]
