"""Ops that make tensors from attributes, shapes or indices: Constant, ConstantOfShape, Range, EyeLike, OneHot."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, kern, norm_axis, op, torch_dtype


@op("Constant")
def constant(spec: NodeSpec) -> Kernel:
    """The value attribute in any of its forms (evaluated at build time, never at run time)."""
    a = spec.attrs
    if "value" in a:
        v = a["value"]
    elif "value_float" in a:
        v = torch.tensor(float(a["value_float"]), dtype=torch.float32)
    elif "value_floats" in a:
        v = torch.tensor(list(a["value_floats"]), dtype=torch.float32)
    elif "value_int" in a:
        v = torch.tensor(int(a["value_int"]), dtype=torch.int64)
    elif "value_ints" in a:
        v = torch.tensor(list(a["value_ints"]), dtype=torch.int64)
    else:
        spec.fail(f"Constant with attribute {sorted(a)} is not supported", "use a numeric value")
    return kern(lambda: v)


@op("ConstantOfShape")
def constant_of_shape(spec: NodeSpec) -> Kernel:
    value = spec.attr("value")
    v = value.reshape(-1)[0].item() if value is not None else 0.0
    dtype = value.dtype if value is not None else torch.float32
    device = spec.device
    return kern(lambda s: torch.full(s.tolist(), v, dtype=dtype, device=device()), 0, host=(0,))


@op("Range")
def range_(spec: NodeSpec) -> Kernel:
    device = spec.device

    def fn(start, limit, delta):
        return torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype, device=device())
    return kern(fn, 0, 1, 2, host=(0, 1, 2))


@op("EyeLike")
def eye_like(spec: NodeSpec) -> Kernel:
    """A 2-D tensor of x's shape with ones on diagonal ``k`` (above the main one when k > 0), zeros elsewhere, in
    ``dtype`` (default x's)."""
    k = int(spec.attr("k", 0))
    to = spec.attr("dtype")

    def fn(x):
        y = torch.zeros(x.shape, dtype=torch_dtype(int(to)) if to is not None else x.dtype, device=x.device)
        y.diagonal(k).fill_(1)
        return y
    return kern(fn, 0)


@op("OneHot")
def one_hot(spec: NodeSpec) -> Kernel:
    """OneHot(indices, depth, values [off, on]): a new axis of length depth at ``axis`` holding ``on`` where the
    index is, ``off`` elsewhere; a negative index counts from depth, one outside [-depth, depth) is all off. depth
    is a host value."""
    axis = int(spec.attr("axis", -1))

    def fn(i, depth, values):
        n = int(depth.reshape(-1)[0])
        i = i.to(torch.int64)
        i = torch.where(i < 0, i + n, i)
        hit = F.one_hot(i.clamp(0, n - 1), n).to(torch.bool) & ((i >= 0) & (i < n)).unsqueeze(-1)
        y = torch.where(hit, values[1], values[0])
        return y.movedim(-1, norm_axis(axis, y.dim()))
    return kern(fn, 0, 1, 2, host=(1,))
