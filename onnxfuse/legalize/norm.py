"""Normalization: LayerNormalization needs its optional statistics outputs for ORT's gradient builder;
InstanceNormalization (nn.InstanceNorm*d, and nn.GroupNorm's export) has no gradient builder at all."""
from __future__ import annotations

import onnx

from ._engine import Context, Emitter, rewrite

__all__ = ["layernorm_outputs", "instancenorm"]


@rewrite("LayerNormalization")
def layernorm_outputs(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """LayerNormalization(X, Scale[, B]) -> Y  ==>  the same node -> Y, Mean, InvStdDev.

    Layout: X [..., D1..Dk] normalized over axes [axis, r); Mean and InvStdDev [..., 1..1] (stash_type, default
    float32), unused by the graph.
    Math: unchanged; ORT's LayerNormalizationGrad reads outputs 1 and 2, and its gradient builder fails on a node
    that does not declare them (torch's export at opset 17/20 declares only Y).
    """
    outputs = list(node.output) + [""] * (3 - len(node.output))
    if all(outputs[:3]):
        return None
    new = onnx.NodeProto()
    new.CopyFrom(node)
    del new.output[:]
    label = node.name or outputs[0]
    new.output.extend([outputs[0],
                       outputs[1] or ctx.fresh(f"{label}/Mean"),
                       outputs[2] or ctx.fresh(f"{label}/InvStdDev")])
    return [new]


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
