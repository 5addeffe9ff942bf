"""What the server tells Prometheus: the metric families, under vLLM's names where vLLM has
one (`catalog`). Nothing here imports TorchServe, the engine or the CLI."""
