"""CumSum has no gradient builder in ORT 1.19: rewrite it as a MatMul with a constant triangular 0/1 matrix."""
from __future__ import annotations

import numpy as np
import onnx

from onnxfuse.core.rewrite import Context, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["cumsum"]


@rewrite("CumSum")
def cumsum(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """CumSum(X, axis; exclusive, reverse)  ==>  MatMul(X, T) along the axis (moved last with Transpose when it is
    not one of the last two; MatMul(T^T, X) when it is the second to last).

    Layout: X [..., L, ...] with L static; T [L, L] in X's dtype.
    Math: Y[..., j] = sum_i X[..., i] T[i, j] with T[i, j] = 1 where i <= j (inclusive), i < j (exclusive),
    i >= j (reverse), i > j (reverse exclusive), else 0. The gradient is X' = Y' T^T, the reversed cumsum torch
    computes. Summation order differs from a running sum: equal up to float rounding.
    """
    x, y = node.input[0], node.output[0]
    if not ctx.is_float(x):
        return None  # an integer cumsum (index arithmetic) has no gradient to build
    axis_value = ctx.constant(node.input[1])
    if axis_value is None:
        raise ctx.error(node, f"its axis input '{node.input[1]}' is not a constant", "use a constant dim")
    rank = ctx.rank(node, x)
    axis = int(axis_value.reshape(-1)[0])
    axis = axis + rank if axis < 0 else axis
    L = ctx.static_dim(node, x, axis, "the triangular matrix of CumSum")
    attrs = ctx.attrs(node)
    exclusive, reverse = int(attrs.get("exclusive", 0)), int(attrs.get("reverse", 0))
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    if reverse:
        tri = (i > j) if exclusive else (i >= j)
    else:
        tri = (i < j) if exclusive else (i <= j)
    em = Emitter(node, ctx)
    dtype = ctx.np_dtype(x)
    if axis == rank - 1:
        em.op("MatMul", [x, em.const(tri, dtype, "triangle")], [y])
    elif axis == rank - 2:
        em.op("MatMul", [em.const(tri.T, dtype, "triangle"), x], [y])
    else:
        perm = [a for a in range(rank) if a != axis] + [axis]
        moved = em.op("MatMul", [em.transpose(x, perm), em.const(tri, dtype, "triangle")])
        em.transpose(moved, list(np.argsort(perm)), output=y)
    return em.nodes
