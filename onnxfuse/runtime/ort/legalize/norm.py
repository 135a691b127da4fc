"""Normalization: LayerNormalization needs its optional statistics outputs for ORT's gradient builder;
InstanceNormalization (nn.InstanceNorm*d, and nn.GroupNorm's export) has no gradient builder at all."""
from __future__ import annotations

import onnx

from onnxfuse.core._graph import node_label
from onnxfuse.core.rewrite import Context, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["layernorm_outputs", "instancenorm"]


@rewrite("LayerNormalization")
def layernorm_outputs(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """LayerNormalization(X, Scale[, B]) -> Y  ==>  the same node -> Y, Mean, InvStdDev.

    Layout: X [..., D1..Dk] normalized over axes [axis, r); Mean and InvStdDev [..., 1..1] (stash_type, default
    float32), unused by the graph.
    Math: unchanged; ORT's LayerNormalizationGrad reads outputs 1 and 2, and its gradient builder fails on a node
    that does not declare them (torch's export at opset 17/20 declares only Y).

    A node whose Scale or B is a small constant (at most ``_SMALL`` elements; the fused LayerNorm rule feeds ones
    and zeros and applies the per-model affine after) is written as primitive ops instead (``_layernorm_ops``):
    ORT's gradient builder merges equal small constants of two LayerNorms into one tensor and then defines its
    gradient twice ("Duplicate definition of name (ln_ones__3_grad)": two LayerNorms over 8 features failed,
    over 16 they did not).
    """
    outputs = list(node.output) + [""] * (3 - len(node.output))
    if _small_constant_affine(node, ctx):
        return _layernorm_ops(node, ctx, outputs)
    if all(outputs[:3]):
        return None
    new = onnx.NodeProto()
    new.CopyFrom(node)
    del new.output[:]
    label = node_label(node)
    new.output.extend([outputs[0],
                       outputs[1] or ctx.fresh(f"{label}/Mean"),
                       outputs[2] or ctx.fresh(f"{label}/InvStdDev")])
    return [new]


_SMALL = 16


def _small_constant_affine(node: onnx.NodeProto, ctx: Context) -> bool:
    return any(name and ctx.is_fixed_constant(name) and ctx.constant(name).size <= _SMALL for name in node.input[1:3])


def _layernorm_ops(node: onnx.NodeProto, ctx: Context, outputs: list[str]) -> list[onnx.NodeProto]:
    """LayerNormalization as ReduceMean / Sub / Mul / Sqrt / Div: D = X - mean(X); Y = D / sqrt(mean(D*D) + eps)
    * Scale + B over axes [axis, r) (keepdims), Mean and InvStdDev written when the graph reads them."""
    x = node.input[0]
    rank = ctx.rank(node, x)
    attrs = ctx.attrs(node)
    axis = int(attrs.get("axis", -1)) % rank
    eps = float(attrs.get("epsilon", 1e-5))
    axes = list(range(axis, rank))
    em = Emitter(node, ctx)
    mean = em.reduce("ReduceMean", x, axes, keepdims=1)
    centered = em.op("Sub", [x, mean])
    std = em.op("Sqrt", [em.op("Add", [em.reduce("ReduceMean", em.op("Mul", [centered, centered]), axes, keepdims=1),
                                       em.like(eps, x, "epsilon")])])
    y = em.op("Mul", [em.op("Div", [centered, std]), node.input[1]])
    if len(node.input) > 2 and node.input[2]:
        y = em.op("Add", [y, node.input[2]])
    em.finish(y, outputs[0])
    if outputs[1] and ctx.is_used(outputs[1]):
        em.op("Identity", [mean], [outputs[1]])
    if outputs[2] and ctx.is_used(outputs[2]):
        em.op("Reciprocal", [std], [outputs[2]])
    return em.nodes


@rewrite("InstanceNormalization")
def instancenorm(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """InstanceNormalization(X, scale, B; epsilon)
    ==>  D = X - ReduceMean(X, S);  Y = D / Sqrt(ReduceMean(D * D, S) + epsilon) * scale' + B'

    Layout: X [N, C, D1..Dk], statistics over S = axes 2..k+1 per (n, c) (keepdims); scale, B [C] -> Unsqueeze to
    [C, 1..1] to broadcast. torch's nn.GroupNorm exports Reshape [N, G, -1] -> this with ones/zeros -> affine.
    Math: the definition with the biased variance, as torch's instance_norm; every op has an ORT gradient.
    """
    x, scale, bias, y = node.input[0], node.input[1], node.input[2], node.output[0]
    rank = ctx.rank(node, x)
    eps = float(ctx.attrs(node).get("epsilon", 1e-5))
    spatial = list(range(2, rank))
    em = Emitter(node, ctx)
    centered = em.op("Sub", [x, em.reduce("ReduceMean", x, spatial, keepdims=1)])
    var = em.reduce("ReduceMean", em.op("Mul", [centered, centered]), spatial, keepdims=1)
    std = em.op("Sqrt", [em.op("Add", [var, em.like(eps, x, "epsilon")])])
    normalized = em.op("Div", [centered, std])
    per_channel = list(range(1, rank - 1))
    scaled = em.op("Mul", [normalized, em.unsqueeze(scale, per_channel)])
    em.op("Add", [scaled, em.unsqueeze(bias, per_channel)], [y])
    return em.nodes
