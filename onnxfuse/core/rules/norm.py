"""Normalization: statistics never cross models (BatchNorm/InstanceNorm/GroupNorm per channel, LayerNorm per row, LRN
within a sample, Lp and mean-variance normalization along original axes)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from onnxfuse.core.layout import packed, stacked
from onnxfuse.core.weights import WeightSlot
from onnxfuse.core.rules._common import broadcast_input, norm_axis
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup


@rule("BatchNormalization")
def fuse_batchnorm(g: "NodeGroup") -> None:
    """B BatchNorms -> one BatchNorm over B*C channels (inference or training mode).

    Layout: x, y [N, B*C, *S] channel-packed; scale, bias, running mean, running var [B*C] (model b's at b*C...);
    training-mode outputs running_mean/running_var [B*C].
    Math: statistics and the affine transform are per channel and channels never mix, so each model's
    channels see exactly its own BatchNorm.
    """
    x = g.get(0, packed(1))
    C = g.input_shape(0)[1]
    if not isinstance(C, int):
        g.fail("the channel count of the input is not static")
    inputs = [x]
    for i, role in ((1, "param"), (2, "param"), (3, "buffer"), (4, "buffer")):
        inputs.append(g.weight(i, WeightSlot(None, (C,)), role) if g.is_weight(i) else g.get(i, packed(0)))
    outs = g.emit_same(inputs, packed(1))
    for j in (1, 2):
        if j < len(outs) and outs[j]:
            g.set_output(j, outs[j], packed(0))


@rule("LayerNormalization")
def fuse_layernorm(g: "NodeGroup") -> None:
    """B LayerNorms -> one LayerNorm without affine, then per-model scale and bias.

    Layout: stacked(a) with the model axis before the normalized axes [k, r) (else stacked(0));
    LayerNorm on fused axis k + (k >= a) with scale 1 and bias 0, then y * scale_b + bias_b with the
    scale/bias packed to broadcast per model (e.g. [B, 1, 1, D] next to [B, N, T, D]).
    Math: normalization statistics are per row of one model; the affine part is elementwise.
    Mean/InvStdDev outputs, when present, keep the input's layout.
    """
    r = g.rank(0)
    k = norm_axis(int(g.attr("axis", -1)), r)
    L = g.layout(0)
    # stacked, so a per-model scale [D] can carry the model axis: [B, 1.., D]
    L = stacked(0) if L is None or L.is_shared or L.axis >= k else stacked(L.axis)
    norm_shape = g.input_shape(0)[k:]
    if any(not isinstance(d, int) for d in norm_shape):
        g.fail(f"the normalized dims {norm_shape} of input '{g.node.input[0]}' must be static (the scale and bias "
               "are packed per model); normalize over dims that do not depend on the batch size")
    dtype = np.float32
    # ones/zeros rather than no bias: onnxruntime-training 1.19 builds LayerNorm's gradient only with all 3 inputs
    ones = g.new_const(np.ones(norm_shape, dtype), "ln_ones", dtype)
    zeros = g.new_const(np.zeros(norm_shape, dtype), "ln_zeros", dtype)
    names = [g.temp_name(o) if j == 0 else (g.out_name(j) if o else "") for j, o in enumerate(g.node.output)]
    g.emit("LayerNormalization", [g.get(0, L), ones, zeros], names, axis=L.fused_axis(k),
           epsilon=float(g.attr("epsilon", 1e-5)), stash_type=int(g.attr("stash_type", 1)))
    y = names[0]
    scale = broadcast_input(g, 1, L)
    last = not g.has_input(2)
    y = g.emit("Mul", [y, scale], [g.out_name(0)] if last else 1)[0]
    if not last:
        y = g.emit("Add", [y, broadcast_input(g, 2, L)], [g.out_name(0)])[0]
    g.set_output(0, y, L)
    for j in (1, 2):
        if j < len(names) and names[j]:
            g.set_output(j, names[j], L)


@rule("InstanceNormalization")
def fuse_instancenorm(g: "NodeGroup") -> None:
    """B InstanceNorms -> one over B*C channels: x [N, B*C, *S] channel-packed, scale/bias [B*C]. Statistics are
    per sample and channel, so models never mix."""
    x = g.get(0, packed(1))
    C = g.input_shape(0)[1]
    ins = [x] + [g.weight(i, WeightSlot(None, (C,))) if g.is_weight(i) else g.get(i, packed(0)) for i in (1, 2)]
    g.emit_same(ins, packed(1))


@rule("GroupNormalization")
def fuse_groupnorm(g: "NodeGroup") -> None:
    """B GroupNorms of G groups -> one of B*G groups over B*C channels.

    Layout: x, y [N, B*C, *S] channel-packed; scale, bias [B*C] per channel (opset 21) or [B*G] per group (18).
    Math: groups are contiguous blocks of C/G channels and model b's channels are the block [bC, (b+1)C), so fused
    group b*G + j is model b's group j: each model's statistics and affine are its own.
    """
    C = g.input_shape(0)[1]
    G = int(g.attr("num_groups"))
    if not isinstance(C, int):
        g.fail("the channel count of the input is not static")
    n = C if g.opset >= 21 else G
    ins = [g.get(0, packed(1))] + [g.weight(i, WeightSlot(None, (n,))) if g.is_weight(i) else g.get(i, packed(0))
                                   for i in (1, 2)]
    g.emit_same(ins, packed(1), num_groups=G * g.B)


@rule("LRN")
def fuse_lrn(g: "NodeGroup") -> None:
    """LRN across channels (axis 1) of [N, C, *S]: the models side by side along the batch, [B*N, C, *S]
    (packed(0)), so a window never reaches another model's channels."""
    g.emit_same([g.get(0, packed(0))], packed(0))


@rule("LpNormalization")
def fuse_lp_normalization(g: "NodeGroup") -> None:
    """x / ||x||_p along one original axis: any layout whose model axis is not that axis (packed there ->
    stacked), fused axis k + (k >= a)."""
    r = g.rank(0)
    k = norm_axis(int(g.attr("axis", -1)), r)
    L = g.layout(0)
    L = stacked(0) if L is None or L.is_shared else (stacked(L.axis) if L.kind == "packed" and L.axis == k else L)
    g.emit_same([g.get(0, L)], L, axis=L.fused_axis(k))


@rule("MeanVarianceNormalization")
def fuse_mean_variance_normalization(g: "NodeGroup") -> None:
    """Statistics over original ``axes`` (default [0, 2, 3]): stacked on an axis outside them (packed there ->
    stacked), the axes shifted past the model axis."""
    r = g.rank(0)
    axes = sorted(norm_axis(int(a), r) for a in g.attr("axes", [0, 2, 3]))
    L = g.layout(0)
    L = stacked(0) if L is None or L.is_shared else (stacked(L.axis) if L.kind == "packed" and L.axis in axes else L)
    g.emit_same([g.get(0, L)], L, axes=[L.fused_axis(k) for k in axes])
