"""Enums of the real transformers_neuronx.constants (values as documented)."""

import enum


class Layout(enum.Enum):
    HSB = "HSB"
    BSH = "BSH"
    SBH = "SBH"


class GQA(enum.Enum):
    """Group-query attention sharding; the value strings are the real ones."""

    SHARD_OVER_HEADS = "shard-over-heads"
    SHARD_OVER_BATCH = "shard-over-batch"
    REPLICATED_HEADS = "replicated-heads"
    ALL_GATHER_HEADS = "all-gather-heads"
