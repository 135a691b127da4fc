"""Split with an output nobody reads breaks ORT 1.19's gradient graph (its SplitGrad shape inference): rewrite it as
one Slice per used output."""
from __future__ import annotations

import math

import onnx

from onnxfuse.core.rewrite import Context, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["split_used_outputs"]


@rewrite("Split")
def split_used_outputs(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """Split(X, split; axis) -> Y0..Yn-1 with some Yj unused  ==>  Yj = Slice(X, [o_j], [o_j + s_j], [axis]) for
    each used j, o_j = s_0 + .. + s_{j-1}.

    Layout: X [.., D, ..] along ``axis``; sizes s_j from the split input (opset >= 13) or attribute, else equal
    parts (ceil(D/n), the last one smaller, from opset 18; D/n before), which needs D static.
    Math: Split is a set of slices; the gradient of the used ones is zero-padded back into X's shape, the unused
    ones contribute zero.
    """
    x = node.input[0]
    used = [ctx.is_used(o) for o in node.output]
    if all(used):
        return None
    attrs = ctx.attrs(node)
    axis = int(attrs.get("axis", 0))
    if axis < 0:
        axis += ctx.rank(node, x)
    n = len(node.output)
    sizes = None
    if len(node.input) > 1 and node.input[1]:
        value = ctx.constant(node.input[1])
        if value is None:
            raise ctx.error(node, f"its split input '{node.input[1]}' is not a constant", "split by constant sizes")
        sizes = [int(v) for v in value.reshape(-1)]
    elif "split" in attrs:
        sizes = [int(v) for v in attrs["split"]]
    else:
        D = ctx.static_dim(node, x, axis, "an equal Split with an unused output")
        n = int(attrs.get("num_outputs", n))
        if ctx.opset >= 18:
            chunk = math.ceil(D / n)
            sizes = [min(chunk, D - chunk * j) for j in range(n)]
        else:
            if D % n:
                raise ctx.error(node, f"{D} is not divisible into {n} equal parts", "give the split sizes")
            sizes = [D // n] * n
    if len(sizes) != len(node.output):
        raise ctx.error(node, f"it has {len(sizes)} split sizes for {len(node.output)} outputs", "fix the split")
    em = Emitter(node, ctx)
    start = 0
    for out, size, is_used in zip(node.output, sizes, used):
        if is_used:
            em.slice(x, [start], [start + size], [axis], output=out)
        start += size
    return em.nodes
