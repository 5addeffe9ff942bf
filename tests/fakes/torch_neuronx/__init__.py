"""TEST FAKE of torch-neuronx: only what inf2serve's tests touch (the version).

The real package initialises the Neuron runtime; the fake runtime lives in
transformers_neuronx/_runtime.py. Version metadata comes from the sibling
torch_neuronx-*.dist-info so importlib.metadata sees it as installed.
"""

__version__ = "2.1.2.2.3.0"
