"""One small hierarchy, so callers catch by meaning and messages carry the fix.

The base class and CacheError come from the compile cache, the lowest layer
(neuron_cache/errors.py), so it needs nothing from here.
"""

from __future__ import annotations

from neuron_cache.errors import CacheError, Inf2ServeError

__all__ = ["CacheError", "CapacityError", "ConfigError", "EngineProcessError",
           "GenerationError", "Inf2ServeError", "NeuronUnavailableError", "RequestError"]


class ConfigError(Inf2ServeError):
    """model-config.yaml is invalid; raised at load and when packaging."""


class RequestError(Inf2ServeError):
    """One request is invalid; becomes an HTTP 4xx for that request only."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message
        self.status = status


class CapacityError(Inf2ServeError):
    """The server is full; becomes HTTP 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class GenerationError(Inf2ServeError):
    """The backend failed while running a batch; becomes HTTP 5xx for that batch's requests."""


class EngineProcessError(Inf2ServeError):
    """The engine process died, or exited before the model was loaded."""


class NeuronUnavailableError(Inf2ServeError):
    """The Neuron SDK (torch-neuronx, transformers-neuronx) is not installed here."""
