"""Reductions, scans and TopK along original axes: the model axis is never reduced."""
from __future__ import annotations

from typing import TYPE_CHECKING

from onnxfuse.core.layout import Layout, stacked
from onnxfuse.core.rules._common import axes_arg, emit_with_axes, norm_axis
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup

REDUCE = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
          "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")


def _keep_model_axis(g: "NodeGroup", axes: list[int]) -> Layout:
    L = g.layout(0)
    if L is None or L.is_shared:
        return stacked(0)
    return stacked(L.axis) if L.kind == "packed" and L.axis in axes else L


def _after_removal(L: Layout, axes: list[int]) -> Layout:
    """Layout once ``axes`` are removed (keepdims=0): the model axis shifts left past the removed ones."""
    return Layout(L.kind, L.axis - sum(k < L.axis for k in axes))


@rule(*REDUCE)
def fuse_reduce(g: "NodeGroup") -> None:
    """Reduce original axes (all of them when ``axes`` is absent and noop_with_empty_axes is 0).

    Layout: the input's (packed(a) with a reduced -> stacked(a)); fused axes j + (j >= a); keepdims=1 keeps the
    layout, keepdims=0 shifts the model axis left past the removed axes. Math: every reduced element belongs to
    one model.
    """
    r = g.rank(0)
    axes = axes_arg(g, 1)
    if not axes:
        if axes is not None and g.attr("noop_with_empty_axes", 0):
            g.fail("noop_with_empty_axes with empty axes is not supported")
        axes = list(range(r))
    axes = sorted(norm_axis(k, r) for k in axes)
    L = _keep_model_axis(g, axes)
    out = L if g.attr("keepdims", 1) else _after_removal(L, axes)
    as_input = g.opset >= (13 if g.op_type == "ReduceSum" else 18)
    emit_with_axes(g, [g.get(0, L)], [L.fused_axis(k) for k in axes], as_input, out, 1)


@rule("ArgMax", "ArgMin")
def fuse_argmax(g: "NodeGroup") -> None:
    """Index of the max/min along one original axis: fused axis k + (k >= a), layout as for a reduction."""
    r = g.rank(0)
    k = norm_axis(int(g.attr("axis", 0)), r)
    L = _keep_model_axis(g, [k])
    out = L if g.attr("keepdims", 1) else _after_removal(L, [k])
    g.emit_same([g.get(0, L)], out, axis=L.fused_axis(k))


@rule("CumSum")
def fuse_cumsum(g: "NodeGroup") -> None:
    """Cumulative sum along original axis k (a constant input): fused axis k + (k >= a); layout unchanged."""
    r = g.rank(0)
    k = g.const(1)
    if k is None:
        g.fail("CumSum's axis must be a constant")
    k = norm_axis(int(k.reshape(-1)[0]), r)
    L = _keep_model_axis(g, [k])
    g.emit_same([g.get(0, L), g.new_const(L.fused_axis(k), "axis")], L)


@rule("TopK")
def fuse_top_k(g: "NodeGroup") -> None:
    """The K largest (smallest) along one original axis, K shared: values and indices keep the input's layout,
    fused axis k + (k >= a) (packed along k -> stacked). Indices count along that axis within one model's slice,
    as alone (a mixture of experts' top-k routing: B routers are one TopK)."""
    if g.opset < 10:
        g.fail("TopK before opset 10 (k as an attribute) is not supported")
    if not g.is_shared(1):
        g.fail("K must be the same for every model")
    r = g.rank(0)
    k = norm_axis(int(g.attr("axis", -1)), r)
    L = _keep_model_axis(g, [k])
    g.emit_same([g.get(0, L), g.shared(1)], L, axis=L.fused_axis(k))
