"""The base of the project's error hierarchy, and the compile cache's own error.

They live here, in the lowest layer, so that the cache raises errors every caller
catches by meaning (handlers/errors.py builds the rest of the hierarchy on this base)
without the cache importing anything from the layers above it.
"""

from __future__ import annotations


class Inf2ServeError(Exception):
    """Base class: the message says what was seen, what was expected and the fix."""


class CacheError(Inf2ServeError):
    """A compile-cache entry is missing, corrupt or was built for another SDK or flags."""
