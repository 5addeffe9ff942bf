"""Quantization enums and the KV-cache quantization config of the fake.

aws-neuron/neuronx-distributed@73ab227:src/neuronx_distributed/quantization/
quantization_config.py (the line numbers below).
"""

from __future__ import annotations

import enum
from enum import Enum

import torch


class MyEnumMeta(enum.EnumMeta):  # L10-L17: `x in Enum` by value
    def __contains__(cls, item):
        try:
            cls(item)
        except ValueError:
            return False
        return True


class DtypeBound(Enum):  # L20-L62: fp8 e4m3 is clamped to the NeuronCore range, +-240
    F8E4M3_MAX = 240.0
    F8E4M3_MIN = -240.0
    INT8_MAX = 127
    INT8_MIN = -128

    @staticmethod
    def from_torch_dtype(dtype):
        if dtype == torch.float8_e4m3fn:
            return (DtypeBound.F8E4M3_MAX.value, DtypeBound.F8E4M3_MIN.value)
        if dtype == torch.float8_e5m2:
            return (torch.finfo(dtype).max, torch.finfo(dtype).min)
        if dtype == torch.int8:
            return (DtypeBound.INT8_MAX.value, DtypeBound.INT8_MIN.value)
        raise ValueError(f"Unsupported dtype: {dtype}")


class QuantizationType(Enum, metaclass=MyEnumMeta):  # L65-L70
    PER_TENSOR_SYMMETRIC = "per_tensor_symmetric"
    PER_CHANNEL_SYMMETRIC = "per_channel_symmetric"
    PER_KEY_SYMMETRIC = "per_key_symmetric"
    BLOCKWISE_SYMMETRIC = "blockwise_symmetric"
    EXPERT_WISE_PER_CHANNEL_SYMMETRIC = "expert_wise_per_channel_symmetric"


class KVQuantizationConfig:
    def __init__(self, **kwargs):  # L72-L80
        self.k_quant_method = kwargs.pop("k_quant_method", QuantizationType.PER_TENSOR_SYMMETRIC)
        self.v_quant_method = kwargs.pop("v_quant_method", QuantizationType.PER_TENSOR_SYMMETRIC)
        self.quant_dtype = kwargs.pop("quant_dtype", torch.float8_e4m3fn)
        self.direct_cast = kwargs.pop("direct_cast", True)
        if self.direct_cast:
            assert (self.k_quant_method == QuantizationType.PER_TENSOR_SYMMETRIC
                    and self.v_quant_method == QuantizationType.PER_TENSOR_SYMMETRIC), \
                "When using direct cast both K and V quantization strategies must be " \
                "PER_TENSOR_SYMMETRIC"


class QuantizedDtype(Enum, metaclass=MyEnumMeta):  # L100-L129: equal values are aliases
    INT8 = torch.int8
    F8E4M3 = torch.float8_e4m3fn
    F8E4M3FN = torch.float8_e4m3fn
    F8E5M2 = torch.float8_e5m2
    F4E2M1FN_X4 = torch.uint16
    F8E4M3FN_X4 = torch.uint32
    F8E5M2_X4 = torch.uint32

    @classmethod
    def has_dtype(cls, dtype_string: str) -> None:
        assert dtype_string.upper() in cls.__members__, \
            f"{dtype_string} is not a valid QuantizedDtype."

    @classmethod
    def get_dtype(cls, dtype_string: str) -> torch.dtype:
        QuantizedDtype.has_dtype(dtype_string=dtype_string)
        return cls[dtype_string.upper()].value
