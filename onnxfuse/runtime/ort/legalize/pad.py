"""Pad in reflect, edge or wrap mode has no gradient builder in onnxruntime-training 1.19 (only constant mode):
rewrite each padded axis as a Gather with the padded positions' source indices."""
from __future__ import annotations

import numpy as np
import onnx

from onnxfuse.core.rewrite import Context, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["pad_as_gather"]

_SOURCE_INDEX = {  # position i of a padded axis of length L reads element f(i) of the input, -pb <= i < L + pe
    "reflect": lambda i, L: np.abs(i) if i < L else 2 * (L - 1) - i,
    "edge": lambda i, L: min(max(i, 0), L - 1),
    "wrap": lambda i, L: i % L,
}


@rewrite("Pad")
def pad_as_gather(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """Pad(X, pads, axes; mode reflect | edge | wrap)  ==>  Gather(.. Gather(X, idx_a, axis=a) .., idx_z, axis=z)
    over the padded axes, idx_a[j] = f(j - pb_a) for j < pb_a + L_a + pe_a (f above; negative pads crop).

    Layout: X [.., L_a, ..] -> [.., pb_a + L_a + pe_a, ..]; every index is a constant, so L_a must be static.
    Math: each padded element is a copy of one input element (reflect mirrors about the edge element without
    repeating it, edge repeats it, wrap continues from the other end); Gather's gradient scatter-adds into those
    elements, which is the gradient of the copies.
    """
    mode = ctx.attrs(node).get("mode", "constant")
    if mode not in _SOURCE_INDEX:
        return None  # constant mode: ORT's PadGrad handles it
    x, y = node.input[0], node.output[0]
    rank = ctx.rank(node, x)
    pads = ctx.constant(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    if pads is None:
        raise ctx.error(node, f"its pads (input 1) are computed at run time in {mode} mode",
                        "pad by constant amounts (torch computes them from static shapes when the input shape is "
                        "fixed: export with a fixed size along the padded axes)")
    axes_in = node.input[3] if len(node.input) > 3 and node.input[3] else None
    axes = list(range(rank)) if axes_in is None else [int(a) % rank for a in ctx.constant(axes_in).reshape(-1)]
    pads = [int(p) for p in pads.reshape(-1)]
    before, after = pads[: len(axes)], pads[len(axes):]
    em = Emitter(node, ctx)
    out = x
    padded = [(a, pb, pe) for a, pb, pe in zip(axes, before, after) if pb or pe]
    for k, (a, pb, pe) in enumerate(padded):
        L = ctx.static_dim(node, x, a, f"padding in {mode} mode")
        if mode == "reflect" and max(pb, pe) >= L:
            raise ctx.error(node, f"it pads axis {a} of length {L} by {max(pb, pe)} in reflect mode",
                            "pad by less than the axis length, as torch requires")
        idx = [int(_SOURCE_INDEX[mode](i, L)) for i in range(-pb, L + pe)]
        last = k == len(padded) - 1
        out = em.op("Gather", [out, em.const(idx, hint="indices")], [y] if last else 1, axis=a)
    if not padded:
        em.op("Identity", [x], [y])
    return em.nodes
