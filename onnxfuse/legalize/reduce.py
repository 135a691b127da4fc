"""Reductions without a gradient builder in ORT 1.19: ReduceMax and ReduceMin."""
from __future__ import annotations

import onnx

from ._engine import Context, Emitter, rewrite

__all__ = ["reduce_extremum"]

_ARG = {"ReduceMax": "ArgMax", "ReduceMin": "ArgMin"}


@rewrite("ReduceMax", "ReduceMin")
def reduce_extremum(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """ReduceMax(X, axes, keepdims)  ==>  per axis a: X = GatherElements(X, ArgMax(X, a, keepdims=1), a); then
    Squeeze(axes) if keepdims=0. Over all axes: Reshape X to [1, n], the same on axis 1, Reshape to the result.

    Layout: X [d0..dr-1]; each ArgMax/GatherElements keeps its axis as size 1, so the nested result is X's shape
    with the reduced axes set to 1 (keepdims=1).
    Math: max over a set of axes = max over one axis after the other. ArgMax (select_last_index=0) picks the first
    maximum, so the whole gradient goes to that element, like torch.max(x, dim); torch.amax / x.max() split it
    evenly among exact ties, which differ only when maxima tie exactly. ReduceMin: ArgMin, the same way.
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
    rank = ctx.rank(node, x) if axes is None or any(a < 0 for a in axes) else None
    if axes is not None:
        axes = sorted({a + rank if a < 0 else a for a in axes} if rank is not None else set(axes))
    shape = ctx.shape(x)
    if axes is None or (shape is not None and len(axes) == len(shape) > 1):
        # every axis: one ArgMax over the flattened tensor (first maximum in row-major order)
        rank = ctx.rank(node, x)
        flat = em.reshape(x, [1, -1])
        picked = em.op("GatherElements", [flat, em.op(_ARG[node.op_type], [flat], axis=1, keepdims=1,
                                                        select_last_index=0)], axis=1)
        em.reshape(picked, [1] * rank if keepdims else [], output=y)
        return em.nodes
    for k, a in enumerate(axes):
        last = k == len(axes) - 1 and keepdims
        idx = em.op(_ARG[node.op_type], [x], axis=a, keepdims=1, select_last_index=0)
        x = em.op("GatherElements", [x, idx], [y] if last else 1, axis=a)
    if not keepdims:
        em.squeeze(x, axes, output=y)
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


