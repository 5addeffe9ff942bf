"""Bucket arithmetic with the rules of the real transformers_neuronx.bucket."""

from __future__ import annotations

import bisect


def token_sizes(n_positions: int | list[int]) -> list[int]:
    """Token-generation buckets: a list as given, else powers of two from 128 up to n_positions."""
    # aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/bucket.py:L37-L39
    if isinstance(n_positions, list):
        return sorted(n_positions)
    sizes, size = [], 128
    while size < n_positions:
        sizes.append(size)
        size *= 2
    return sizes + [n_positions]


def context_sizes(estimate: int | list[int] | None, token_buckets: list[int]) -> list[int]:
    """Prefill buckets: a list as given, an int alone (<= 0: none), None: half of each token one."""
    # aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/bucket.py:L64-L73
    if isinstance(estimate, list):
        return sorted(estimate)
    if isinstance(estimate, int):
        return [estimate] if estimate > 0 else []
    if estimate is None:
        return [b // 2 for b in token_buckets]
    raise NotImplementedError(f"Prompt bucket config {estimate} not supported")


def batch_sizes(batch_size: int | list[int]) -> list[int]:
    # aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/bucket.py:L88-L93
    if isinstance(batch_size, int):
        return [batch_size]
    if isinstance(batch_size, list):
        return sorted(batch_size)
    raise TypeError("batch_size must be list of ints or int type")


def find(buckets: list[int] | None, size: int) -> int | None:
    """The smallest bucket >= size; the largest when none is (the caller asserts); None if none."""
    # aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/bucket.py:L110-L113
    if not buckets:
        return None
    return buckets[bisect.bisect_left(buckets, size, hi=len(buckets) - 1)]


def token_bucket_id(token_buckets: list[int], cache_id: int) -> int:
    """The token graph for a cache id; StopIteration past the last bucket, as the real one."""
    # aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/decoder.py:L2169-L2170
    return next(i for i, n in enumerate(token_buckets) if n >= cache_id + 1)
