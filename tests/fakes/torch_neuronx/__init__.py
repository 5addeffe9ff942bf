"""TEST FAKE of torch-neuronx: only what inf2serve's tests touch (the version).

The real package initialises the Neuron runtime; the fake runtime lives in
transformers_neuronx/_runtime.py. The version is the sibling torch_neuronx-*.dist-info's,
which is what importlib.metadata (and so the compile-cache key) sees.
"""

from importlib.metadata import version

__version__ = version("torch-neuronx")
