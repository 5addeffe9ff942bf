"""TEST FAKE of neuronx-distributed-inference 0.8.16251 (Neuron SDK 2.28.x); never shipped.

See tests/fakes/README.md. Computes with the HF checkpoint on CPU; no Neuron SDK inside.
"""
