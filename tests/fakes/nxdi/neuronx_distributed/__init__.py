"""TEST FAKE of neuronx-distributed 0.17.26814 (Neuron SDK 2.28.x); never shipped.

Only what the NxD Inference fake imports: quantization/ (configs and CPU quantization).
Citations: aws-neuron/neuronx-distributed@73ab227:src/neuronx_distributed/.
"""
