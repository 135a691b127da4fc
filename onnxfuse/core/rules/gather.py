"""Gather: per-model embedding tables with index offsets, or indexing a per-model tensor."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from onnxfuse.core.layout import Layout, stacked
from onnxfuse.core.weights import WeightSlot
from onnxfuse.core.rules._common import norm_axis
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
    or moves right by rank(idx) - 1 after it.
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
        g.fail("indices that differ per model into a per-model tensor are not supported")
    L = g.layout(0)
    L = stacked(0) if L is None or L.is_shared else (stacked(L.axis) if L.kind == "packed" and L.axis == axis else L)
    ri = g.rank(1)
    m, fa = L.axis, L.fused_axis(axis)
    out = L if m < fa else Layout(L.kind, m + ri - 1)  # data dims after the gathered one shift by rank(idx)-1
    g.emit_same([g.get(0, L), g.shared(1)], out, axis=fa)
