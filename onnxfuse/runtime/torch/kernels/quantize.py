"""Quantization: QuantizeLinear, DequantizeLinear, and the runtime's own ``FakeQuantize`` for the pair of them that
quantization-aware training exports (``runtime/torch/patterns.py``'s ``fake_quantize``): what torch's fake-quant
modules compute, with their straight-through gradient.

    q = clamp(round_half_even(x / scale) + zero_point, qmin, qmax)        QuantizeLinear (integer output)
    y = (q - zero_point) * scale                                          DequantizeLinear
    dy/dx = 1 where round(x / scale) + zero_point lies in [qmin, qmax], else 0   (FakeQuantize's estimator)

scale and zero_point are one value (per tensor) or one per slice along ``axis``; blocked quantization (opset 21's
``block_size``) is refused."""
from __future__ import annotations

import torch

from onnxfuse.runtime.torch.kernels._base import OPS, Kernel, NodeSpec, kern, norm_axis, op, torch_dtype

# the integer types a quantized tensor may have here, with their ranges
_RANGES = {torch.uint8: (0, 255), torch.int8: (-128, 127), torch.int16: (-32768, 32767),
           torch.uint16: (0, 65535), torch.int32: (-2 ** 31, 2 ** 31 - 1)}


def _per_axis(t: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    """A scale or zero point shaped to broadcast over x: as is when one value, else along ``axis``."""
    if t.numel() == 1:
        return t.reshape(())
    shape = [1] * x.dim()
    shape[norm_axis(axis, x.dim())] = t.numel()
    return t.reshape(shape)


def _blocked(spec: NodeSpec) -> None:
    if int(spec.attr("block_size", 0) or 0):
        spec.fail("blocked quantization (block_size) has no torch kernel", "quantize per tensor or per axis")


def _out_type(spec: NodeSpec, zero_point: torch.Tensor | None) -> torch.dtype:
    if zero_point is not None:
        return zero_point.dtype
    to = spec.attr("output_dtype")
    dtype = torch_dtype(int(to)) if to else torch.uint8
    if dtype not in _RANGES:
        spec.fail(f"quantizing to {dtype} has no torch kernel", "quantize to int8, uint8, int16 or uint16")
    return dtype


@op("QuantizeLinear")
def quantize_linear(spec: NodeSpec) -> Kernel:
    """q = clamp(round(x / scale) + zero_point) in zero_point's integer type (uint8 without one); no gradient (an
    integer output: the straight-through estimator is FakeQuantize's, for a QuantizeLinear read by a
    DequantizeLinear)."""
    _blocked(spec)
    axis = int(spec.attr("axis", 1))

    def fn(x, scale, zero_point=None):
        dtype = _out_type(spec, zero_point)
        lo, hi = _RANGES[dtype]
        q = torch.round(x / _per_axis(scale, x, axis))
        if zero_point is not None:
            q = q + _per_axis(zero_point, x, axis).to(q.dtype)
        return q.clamp(lo, hi).to(dtype)
    return kern(fn, *[i for i in (0, 1, 2) if spec.has(i)])


@op("DequantizeLinear")
def dequantize_linear(spec: NodeSpec) -> Kernel:
    """y = (q - zero_point) * scale in scale's float type."""
    _blocked(spec)
    axis = int(spec.attr("axis", 1))

    def fn(q, scale, zero_point=None):
        y = q.to(scale.dtype)
        if zero_point is not None:
            y = y - _per_axis(zero_point, q, axis).to(scale.dtype)
        return y * _per_axis(scale, q, axis)
    return kern(fn, *[i for i in (0, 1, 2) if spec.has(i)])


@OPS.register("FakeQuantize", domain="onnxfuse.torch")
def fake_quantize(spec: NodeSpec) -> Kernel:
    """``QuantizeLinear -> DequantizeLinear`` as one op: torch.fake_quantize_per_tensor_affine /
    fake_quantize_per_channel_affine (what torch.ao's FakeQuantize modules run), the same values as the pair and
    the straight-through gradient to x. Inputs: x, scale, zero_point (optional: 0 in uint8); attributes: axis, and
    ``qtype`` (the ONNX element type of the quantized tensor). No gradient to scale or zero point, as torch's."""
    axis = int(spec.attr("axis", 1))
    dtype = torch_dtype(int(spec.attr("qtype", 2)))  # 2: UINT8
    lo, hi = _RANGES[dtype]

    def fn(x, scale, zero_point=None):
        zp = zero_point if zero_point is not None else torch.zeros_like(scale, dtype=torch.int64)
        s = scale.detach().to(torch.float32)
        if scale.numel() == 1:
            return torch.fake_quantize_per_tensor_affine(x, s.reshape(()), zp.reshape(()).to(torch.int32), lo, hi)
        return torch.fake_quantize_per_channel_affine(x, s.reshape(-1), zp.reshape(-1).to(torch.int32),
                                                      norm_axis(axis, x.dim()), lo, hi)
    return kern(fn, *[i for i in (0, 1, 2) if spec.has(i)])
