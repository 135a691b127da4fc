"""Indexing: Gather (per-model embedding tables with index offsets, or indexing a per-model tensor), GatherElements,
ScatterElements, GatherND, ScatterND (the model axis in front of the indexed ones) and OneHot."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx

from onnxfuse.core.layout import Layout, stacked
from onnxfuse.core.weights import WeightSlot
from onnxfuse.core.rules._common import norm_axis, unsqueeze
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup


@rule("Gather")
def fuse_gather(g: "NodeGroup") -> None:
    """Gather(data, indices, axis).

    Embedding (data is a weight table [V, ...], axis 0): the B tables are packed [B*V, ...] and model b's indices
    are offset by b*V: idx' = Mod(idx, V) + b*V, shaped [B, *idx] (shared indices gain the model axis by
    broadcasting), so one Gather returns [B, *idx, ...] = stacked(0). Mod maps ONNX's negative indices into range.
    Per-model data with shared indices: Gather on the fused axis; the model axis m stays before the gathered axis
    or moves right by rank(idx) - 1 after it. Per-model indices (an index buffer, the same in every model yet each
    model's own): :func:`_gather_per_model_indices`.
    """
    r = g.rank(0)
    axis = norm_axis(int(g.attr("axis", 0)), r)
    if g.is_weight(0) and axis == 0:
        shape = g.input_shape(0)
        V = shape[0]
        table = g.weight(0, WeightSlot(None, tuple(shape)))
        ri = g.rank(1)
        idx = g.shared(1) if g.is_shared(1) else g.get(1, stacked(0))
        idx = g.emit("Mod", [idx, g.new_const(V, "vocab")])[0]
        offsets = g.new_const((np.arange(g.B, dtype=np.int64) * V).reshape([g.B] + [1] * ri), "model_offsets")
        idx = g.emit("Add", [idx, offsets])[0]
        g.set_output(0, g.emit("Gather", [table, idx], [g.out_name(0)], axis=0)[0], stacked(0))
        return
    if not g.is_shared(1):
        _gather_per_model_indices(g, axis, r)
        return
    L = g.layout(0)
    L = stacked(0) if L is None or L.is_shared else (stacked(L.axis) if L.kind == "packed" and L.axis == axis else L)
    ri = g.rank(1)
    m, fa = L.axis, L.fused_axis(axis)
    out = L if m < fa else Layout(L.kind, m + ri - 1)  # data dims after the gathered one shift by rank(idx)-1
    g.emit_same([g.get(0, L), g.shared(1)], out, axis=fa)


def _gather_per_model_indices(g: "NodeGroup", axis: int, r: int) -> None:
    """Gather(data, indices, axis) with each model's own indices (x[:, self.src] with an index buffer): the model
    axis as a batch axis of GatherND.

    Layout: data [B, *D] and indices [B, *I] (stacked(0); a shared one copied per model); data's axis ``axis``
    moved next to the model axis (Transpose), GatherND(batch_dims=1) of indices [B, *I, 1] -> [B, *I, rest], and
    the I axes moved back to where ``axis`` was; output stacked(0).
    Math: batch entry b of GatherND reads only data[b] at indices[b]: model b's Gather.
    """
    ri = g.rank(1)
    data = _per_model_stacked(g, 0)
    if axis:  # [B, D_axis, D_0 .. D_axis-1, D_axis+1 ..]
        data = g.emit("Transpose", [data], perm=[0, axis + 1] + [k + 1 for k in range(r) if k != axis])[0]
    idx = unsqueeze(g, _per_model_stacked(g, 1), [ri + 1])
    picked = g.emit("GatherND", [data, idx], [g.temp_name(g.out_name(0)) if axis else g.out_name(0)],
                    batch_dims=1)[0]
    if axis:  # [B, *I, D_0 .. D_axis-1, rest] -> [B, D_0 .. D_axis-1, *I, rest]
        before = list(range(1 + ri, 1 + ri + axis))
        perm = [0] + before + list(range(1, 1 + ri)) + list(range(1 + ri + axis, ri + r))
        picked = g.emit("Transpose", [picked], [g.out_name(0)], perm=perm)[0]
    g.set_output(0, picked, stacked(0))


def _per_model_stacked(g: "NodeGroup", i: int) -> str:
    """Input i as stacked(0) [B, ...]: a per-model tensor in that layout, a shared one (indices computed from
    constants, the same graph in every model) given one copy per model by broadcasting against [B, 1, ...]."""
    if not g.is_shared(i):
        return g.get(i, stacked(0))
    x = unsqueeze(g, g.shared(i), [0])
    return g.emit("Expand", [x, g.new_const([g.B] + [1] * g.rank(i), "model_copies")])[0]


@rule("GatherElements", "ScatterElements")
def fuse_elements(g: "NodeGroup") -> None:
    """GatherElements(data, indices, axis) and ScatterElements(data, indices, updates, axis, reduction): the same
    op on the models' tensors stacked at axis 0, along axis + 1.

    Layout: data, indices (and updates) [B, ...] (shared ones copied per model); output stacked(0).
    Math: an element of model b's output reads or combines only model b's data and updates, since the op pairs
    elements at equal positions of every axis but ``axis``, and axis 0 is the model's (the message passing of a
    graph network: B scatter_adds are one).
    """
    r = g.rank(0)
    axis = norm_axis(int(g.attr("axis", 0)), r)
    ins = [_per_model_stacked(g, i) for i in range(g.num_inputs)]
    g.emit_same(ins, stacked(0), axis=axis + 1)


@rule("GatherND")
def fuse_gather_nd(g: "NodeGroup") -> None:
    """GatherND(data, indices, batch_dims): the model axis is one more batch axis in front.

    Layout: data and indices [B, ...] (shared ones copied per model); batch_dims + 1; output stacked(0).
    Math: with the model as the first batch axis, model b's indices only address model b's data.
    """
    ins = [_per_model_stacked(g, i) for i in (0, 1)]
    g.emit_same(ins, stacked(0), batch_dims=int(g.attr("batch_dims", 0)) + 1)


@rule("ScatterND")
def fuse_scatter_nd(g: "NodeGroup") -> None:
    """ScatterND(data [*D, *R], indices [*Q, k], updates [*Q, *R], reduction): index tuples gain the model
    index in front.

    Layout: data, updates [B, ...]; indices [B, *Q, k] -> [B, *Q, k + 1] with entry 0 = b (Concat of b, broadcast
    to [B, *Q, 1], and the indices); output stacked(0).
    Math: model b's updates land in data[b][idx] = fused[b, *idx], and only there.
    """
    data, idx, upd = (_per_model_stacked(g, i) for i in (0, 1, 2))
    ri = g.rank(1)
    first = g.emit("Slice", [idx, g.new_const([0], "starts"), g.new_const([1], "ends"), g.new_const([-1], "axes")])[0]
    zeros = g.emit("Mul", [first, g.new_const(0, "zero")])[0]  # [B, *Q, 1] of 0
    model = g.new_const(np.arange(g.B, dtype=np.int64).reshape([g.B] + [1] * ri), "model_index")
    column = g.emit("Add", [zeros, model])[0]
    idx = g.emit("Concat", [column, g.emit("Cast", [idx], to=onnx.TensorProto.INT64)[0]], axis=-1)[0]
    g.emit_same([data, idx, upd], stacked(0))


@rule("OneHot")
def fuse_one_hot(g: "NodeGroup") -> None:
    """OneHot(indices, depth, values, axis): per-model indices [B, ...] (stacked(0)), depth and values shared; the
    new axis moves right by one (a negative axis counts from the end and stays). Output stacked(0)."""
    if not (g.is_shared(1) and g.is_shared(2)):
        g.fail("depth and values that differ per model are not supported")
    axis = int(g.attr("axis", -1))
    g.emit_same([g.get(0, stacked(0)), g.shared(1), g.shared(2)], stacked(0), axis=axis + 1 if axis >= 0 else axis)
