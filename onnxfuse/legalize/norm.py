"""Normalization: LayerNormalization needs its optional statistics outputs for ORT's gradient builder."""
from __future__ import annotations

import onnx

from ._engine import Context, rewrite

__all__ = ["layernorm_outputs"]


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
