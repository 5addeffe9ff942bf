"""The TorchServe adapter: the handler TorchServe loads (`generation_handler`), the worker's
side of its async protocol (`worker_service`), metrics, and what a worker holds
(`service`). The only place that knows TorchServe."""
