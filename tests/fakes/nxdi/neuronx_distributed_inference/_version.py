__version__ = "0.8.0"  # src/neuronx_distributed_inference/_version.py at cd3abf3
