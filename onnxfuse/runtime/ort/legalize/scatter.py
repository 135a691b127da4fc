"""ScatterElements with reduction max / min, whose gradient onnxruntime-training 1.19 builds as if nothing were
reduced (each update gets the output's gradient at its index, win or lose): torch's scatter_reduce amax / amin
gives it to the elements equal to the result, split evenly among ties."""
from __future__ import annotations

import onnx

from onnxfuse.core.rewrite import Context, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["scatter_extremum"]


@rewrite("ScatterElements")
def scatter_extremum(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """ScatterElements(data, idx, upd, axis, reduction=max|min)  ==>
    r = ScatterElements(data, idx, upd, max|min);  md = Cast(data == r);  mu = Cast(upd == GatherElements(r, idx));
    count = md + ScatterElements(0, idx, mu, add);  y = (data * md + ScatterElements(0, idx, upd * mu, add)) / count.

    Layout: as the node (axis unchanged).
    Math: y = r (the tied maxima summed, divided by how many there are; count >= 1 since r is one of them). r, md,
    mu and count reach y only through Equal (no gradient), so dy/ddata = md / count and dy/dupd = mu *
    gather(1 / count): torch's gradient of scatter_reduce amax / amin with include_self.
    """
    attrs = ctx.attrs(node)
    reduction = attrs.get("reduction", "none")
    if reduction not in ("max", "min") or not ctx.is_float(node.input[0]):
        return None
    data, idx, upd = node.input[:3]
    axis = int(attrs.get("axis", 0))
    em = Emitter(node, ctx)
    r = em.op("ScatterElements", [data, idx, upd], axis=axis, reduction=reduction)
    md = em.op("Cast", [em.op("Equal", [data, r])], to=ctx.dtype(data))
    mu = em.op("Cast", [em.op("Equal", [upd, em.op("GatherElements", [r, idx], axis=axis)])], to=ctx.dtype(data))
    zeros = em.op("Mul", [data, em.like(0.0, data, "zero")])
    count = em.op("Add", [md, em.op("ScatterElements", [zeros, idx, mu], axis=axis, reduction="add")])
    total = em.op("Add", [em.op("Mul", [data, md]),
                          em.op("ScatterElements", [zeros, idx, em.op("Mul", [upd, mu])], axis=axis, reduction="add")])
    em.op("Div", [total, count], [node.output[0]])
    return em.nodes
