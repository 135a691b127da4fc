"""Ops that make tensors from attributes or shapes: Constant, ConstantOfShape, Range."""
from __future__ import annotations

import torch

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, kern, op


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
