"""Reductions over axes (Reduce*), ArgMax / ArgMin and CumSum."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onnxfuse.runtime.torch.kernels._base import Kernel, NodeSpec, axes_of, identity, kern, norm_axis, op


def _reduce_fn(op_type: str):
    if op_type == "ReduceMean":
        return lambda x, d, k: x.mean(d, keepdim=k)
    if op_type == "ReduceSum":
        return lambda x, d, k: x.sum(d, keepdim=k)
    if op_type == "ReduceMax":
        return lambda x, d, k: x.amax(d, keepdim=k)
    if op_type == "ReduceMin":
        return lambda x, d, k: x.amin(d, keepdim=k)
    if op_type == "ReduceL1":
        return lambda x, d, k: x.abs().sum(d, keepdim=k)
    if op_type == "ReduceL2":
        return lambda x, d, k: torch.linalg.vector_norm(x, 2, d, keepdim=k)
    if op_type == "ReduceSumSquare":
        return lambda x, d, k: (x * x).sum(d, keepdim=k)
    if op_type == "ReduceLogSum":
        return lambda x, d, k: torch.log(x.sum(d, keepdim=k))
    if op_type == "ReduceLogSumExp":
        return lambda x, d, k: torch.logsumexp(x, d, keepdim=k)

    def prod(x, d, k):
        for a in sorted(d, reverse=True):
            x = x.prod(a, keepdim=True)
        return x if k else x.squeeze(tuple(d)) if d else x
    return prod


@op("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceSumSquare")
def reduce(spec: NodeSpec) -> Kernel:
    """Reduce ``axes`` (attribute before opset 18 - ReduceSum: 13 -, input from then on); no axes: every axis, or
    none with noop_with_empty_axes."""
    axes, _ = axes_of(spec, 13 if spec.op_type == "ReduceSum" else 18)
    keep = bool(spec.attr("keepdims", 1))
    f = _reduce_fn(spec.op_type)
    if not axes:
        if spec.attr("noop_with_empty_axes", 0):
            return kern(identity, 0)
        return kern(lambda x: f(x, tuple(range(x.dim())), keep), 0)
    dims = tuple(axes)
    return kern(lambda x: f(x, dims, keep), 0)


@op("ArgMax", "ArgMin")
def arg_max(spec: NodeSpec) -> Kernel:
    """Index of the first max/min along ``axis`` (the last with select_last_index)."""
    axis, keep = int(spec.attr("axis", 0)), bool(spec.attr("keepdims", 1))
    f = torch.argmax if spec.op_type == "ArgMax" else torch.argmin
    if int(spec.attr("select_last_index", 0)):
        def last(x):
            a = norm_axis(axis, x.dim())
            return x.shape[a] - 1 - f(x.flip(a), a, keep)
        return kern(last, 0)
    return kern(lambda x: f(x, axis, keep), 0)


@op("CumSum")
def cumsum(spec: NodeSpec) -> Kernel:
    spec.need_const(1, "axis")
    axis = spec.ints(1)[0]
    exclusive, reverse = int(spec.attr("exclusive", 0)), int(spec.attr("reverse", 0))

    def fn(x):
        a = norm_axis(axis, x.dim())
        y = x.flip(a) if reverse else x
        if exclusive:  # shift right by one: [0, x0, x0+x1, ...]
            y = F.pad(y.narrow(a, 0, y.shape[a] - 1), [0, 0] * (x.dim() - 1 - a) + [1, 0])
        y = torch.cumsum(y, a)
        return y.flip(a) if reverse else y
    return kern(fn, 0)
