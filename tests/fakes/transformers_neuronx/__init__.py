"""TEST FAKE of transformers-neuronx for inf2serve's tests; never shipped.

It keeps the real package's public API and the rules that decide behaviour (argument
names, what is lenient and what raises, which graph a forward() call runs and which
KV-cache rows it writes) and computes with the real checkpoint on CPU through
transformers, so generated text is real. Each rule cites the real source at
aws-neuron/transformers-neuronx@1ade6d7. See _runtime.py for the test hooks
(compile/load event log, simulated NeuronCores).
"""

# the real top level has QuantizationConfig but not KVCacheQuantizationConfig (__init__.py:L19)
from transformers_neuronx.config import (
    ContinuousBatchingConfig,
    GenerationConfig,
    NeuronConfig,
    QuantizationConfig,
)
from transformers_neuronx.constants import GQA, Layout
from transformers_neuronx.llama.model import LlamaForSampling
from transformers_neuronx.mistral.model import MistralForSampling
from transformers_neuronx.mixtral.model import MixtralForSampling
from transformers_neuronx.version import __version__

__all__ = ["GQA", "ContinuousBatchingConfig", "GenerationConfig", "Layout", "LlamaForSampling",
           "MistralForSampling", "MixtralForSampling", "NeuronConfig", "QuantizationConfig",
           "__version__"]
