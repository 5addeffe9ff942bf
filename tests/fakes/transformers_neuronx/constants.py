"""Enums and layout names of the real transformers_neuronx.constants."""

import enum

# aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/constants.py:L30-L32
LAYOUT_BSH = "BSH"
LAYOUT_HSB = "HSB"
LAYOUT_SBH = "SBH"


class Layout(enum.Enum):
    HSB = "HSB"
    BSH = "BSH"
    SBH = "SBH"

    # compares equal to its string name (constants.py:L46-L47); like the real one, unhashable
    def __eq__(self, value):
        return super().__eq__(Layout(value))


class GQA(enum.Enum):
    """Group-query attention sharding; the real value strings (constants.py:L51-L86)."""

    SHARD_OVER_HEADS = "shard-over-heads"
    SHARD_OVER_BATCH = "shard-over-batch"
    REPLICATED_HEADS = "replicated-heads"
    ALL_GATHER_HEADS = "all-gather-heads"


class FpBounds:
    """fp8 range the quantizer scales to (constants.py:L36-L38)."""

    min = -240.0
    max = 240.0
