"""Reductions without a gradient builder in ORT 1.19: ReduceMax, ReduceMin, ReduceL1, ReduceSumSquare, ReduceLogSum.
(ReduceSum, ReduceMean, ReduceL2 and ReduceLogSumExp have one; ReduceProd has none and no exact rewrite here.)"""
from __future__ import annotations

import onnx

from onnxfuse.core.rewrite import Context, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["reduce_extremum", "reduce_via_sum"]


@rewrite("ReduceMax", "ReduceMin")
def reduce_extremum(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """ReduceMax(X, axes, keepdims)  ==>  m = ReduceMax(X, axes, keepdims=1);  mask = Cast(Equal(X, m));
    Y = ReduceSum(X * mask, axes, keepdims) / ReduceSum(mask, axes, keepdims).

    Layout: as the original reduction; m and mask broadcast against X.
    Math: the value is the maximum (k tied copies of it, summed, divided by k). m only feeds Equal, whose boolean
    output carries no gradient, so the gradient is dY * mask / count: split evenly among exact ties, like
    torch.amax / x.amax(dim) (torch.max(x, dim) gives it all to one index instead; ties are common after a ReLU,
    e.g. PointNet's max over points of a channel that is 0 everywhere). ReduceMin: the same with ReduceMin.
    """
    x, y = node.input[0], node.output[0]
    if not ctx.is_float(x):
        return None  # an integer reduction has no gradient to build
    attrs = ctx.attrs(node)
    keepdims = int(attrs.get("keepdims", 1))
    axes = _axes(node, ctx, attrs)
    em = Emitter(node, ctx)
    if axes is not None and len(axes) == 0:
        if int(attrs.get("noop_with_empty_axes", 0)):
            em.op("Identity", [x], [y])
            return em.nodes
        axes = None
    if axes is not None and any(a < 0 for a in axes):
        rank = ctx.rank(node, x)  # (raises when unknown)
        axes = sorted({a + rank if a < 0 else a for a in axes})
    extremum = em.reduce(node.op_type, x, axes, 1)
    mask = em.op("Cast", [em.op("Equal", [x, extremum])], to=ctx.dtype(x))
    total = em.reduce("ReduceSum", em.op("Mul", [x, mask]), axes, keepdims)
    em.op("Div", [total, em.reduce("ReduceSum", mask, axes, keepdims)], [y])
    return em.nodes


@rewrite("ReduceL1", "ReduceSumSquare", "ReduceLogSum")
def reduce_via_sum(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """ReduceL1(X) ==> ReduceSum(Abs(X));  ReduceSumSquare(X) ==> ReduceSum(X * X);
    ReduceLogSum(X) ==> Log(ReduceSum(X)); same axes and keepdims.

    Layout: as the original reduction (torch.norm(x, p=1, dim=d) exports ReduceL1).
    Math: the definitions; gradients sign(X) Y', 2 X Y', Y' / sum, as torch's.
    """
    x, y = node.input[0], node.output[0]
    if not ctx.is_float(x):
        return None
    attrs = ctx.attrs(node)
    keepdims = int(attrs.get("keepdims", 1))
    axes = _axes(node, ctx, attrs)
    if axes is not None and len(axes) == 0:
        if int(attrs.get("noop_with_empty_axes", 0)):
            raise ctx.error(node, "it has empty axes with noop_with_empty_axes=1",
                            "reduce over explicit axes")
        axes = None
    em = Emitter(node, ctx)
    if node.op_type == "ReduceL1":
        em.reduce("ReduceSum", em.op("Abs", [x]), axes, keepdims, output=y)
    elif node.op_type == "ReduceSumSquare":
        em.reduce("ReduceSum", em.op("Mul", [x, x]), axes, keepdims, output=y)
    else:
        em.op("Log", [em.reduce("ReduceSum", x, axes, keepdims)], [y])
    return em.nodes


def _axes(node: onnx.NodeProto, ctx: Context, attrs: dict) -> list[int] | None:
    """The reduced axes (None: all), from the attribute (opset < 18) or the constant second input (opset >= 18)."""
    if "axes" in attrs:
        return [int(a) for a in attrs["axes"]]
    if len(node.input) > 1 and node.input[1]:
        value = ctx.constant(node.input[1])
        if value is None:
            raise ctx.error(node, f"its axes input '{node.input[1]}' is not a constant",
                            "reduce over constant axes (e.g. torch.amax(x, dim=1))")
        return [int(a) for a in value.reshape(-1)]
    return None


