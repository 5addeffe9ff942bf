"""CPU quantization of a float model, as NxD Inference's save_quantized_state_dict runs it.

aws-neuron/neuronx-distributed@73ab227:src/neuronx_distributed/quantization/
quantization_utils.py (the line numbers below). The real int8 path goes through torch's
dynamic quantization and then unpacks the packed params into `weight` (int8) and `scale`
(L92-L123); the fake computes the same numbers directly: symmetric scales as torch's
MinMaxObserver and NxD's PerChannelAbsMaxObserver compute them (absmax / 127.5, at least
float32 eps), round half to even, clamp to [-128, 127].
"""

from __future__ import annotations

import torch

from neuronx_distributed.quantization.quantization_config import DtypeBound

_EPS = torch.finfo(torch.float32).eps


class QuantizedLinear(torch.nn.Module):
    """A Linear after quantization: what its state dict holds (weight, scale, and its bias
    where it has one: convert_qint8_to_int8_state_dict keeps the packed bias, L116-L121)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        if bias is not None:
            self.register_buffer("bias", bias.detach().clone())


def _int8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.detach().to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max().reshape(1)
    scale = torch.clamp(amax / ((127 - (-128)) / 2), min=_EPS)
    q = torch.clamp(torch.round(w / (scale if per_channel else scale[0])), -128, 127)
    return q.to(torch.int8), scale.to(torch.float32)


def _fp8(w: torch.Tensor, dtype, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    fmax, fmin = DtypeBound.from_torch_dtype(dtype)
    w = w.detach().to(torch.float32)
    if per_channel:  # quantize_fp8_per_channel (L126-L142)
        scale = torch.clamp(w.abs().amax(dim=1, keepdim=True) / fmax, min=1e-05)
    else:  # quantize_fp8_per_tensor (L144-L152): a 0-d scale, no floor
        scale = torch.max(torch.abs(w)) / fmax
    return torch.clamp(w / scale, fmin, fmax).to(dtype), scale.to(torch.float32)


def _quantize(model: torch.nn.Module, dtype, per_channel: bool, skip: list[str]) -> torch.nn.Module:
    if dtype in (torch.qint8, torch.int8):
        how = lambda w: _int8(w, per_channel)  # noqa: E731
    elif dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        how = lambda w: _fp8(w, dtype, per_channel)  # noqa: E731
    else:  # L201-L202, L228-L229
        raise ValueError(f"dtype: {dtype} is not supported to quantize model on CPU")
    names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    for name in names:
        if any(key in name for key in skip):  # L12-L31: substrings of module names
            continue
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        linear = getattr(owner, leaf)
        setattr(owner, leaf, QuantizedLinear(*how(linear.weight), linear.bias))
    return model


def quantize_pytorch_model_per_tensor_symmetric(float_model, inplace=False, dtype=torch.qint8):
    """Every Linear, modules_to_not_convert or not: this path takes no such list (L190-L207)."""
    return _quantize(float_model, dtype, per_channel=False, skip=[])


def quantize_pytorch_model_per_channel_symmetric(float_model, inplace=False, dtype=torch.qint8,
                                                 modules_to_not_convert=None):
    """Output channels (ch_axis 0), except modules whose name contains an entry of
    modules_to_not_convert (L210-L234)."""
    return _quantize(float_model, dtype, per_channel=True, skip=list(modules_to_not_convert or []))
