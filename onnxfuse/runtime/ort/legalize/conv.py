"""Convolutions whose gradient onnxruntime-training 1.19.2 (CPU) computes wrongly.

Its ConvGrad kernel computes the input gradient of every non-2-D convolution with a col2im over ``C * image_size``
elements per group instead of ``C / group * image_size``: for group > 1 each call zeroes past its own channels, and
the last group's call writes past the end of the input-gradient buffer, over whatever tensor ONNX Runtime placed
there (in a fused array: another parameter's gradient, which then came out zero or 25-90 % off, while the forward
pass and the convolution's own weight gradient were right). 2-D convolutions take another code path and are right,
and so is any convolution with group 1.

- 1-D (any group): run it as a 2-D convolution over a unit height, free (Unsqueeze/Squeeze are views);
- 3-D and higher with group > 1: one group-1 convolution per group (Split, Conv, Concat), correct but not fused.

ConvGrad also reads only the ``pads`` attribute: a convolution exported with ``auto_pad`` SAME_* (torch's
``padding='same'``) got the gradient of an unpadded convolution. Its pads are made explicit (the spatial dims are
static), which also lets ONNX Runtime run it with dilations (its CPU Conv refuses SAME_* with dilation > 1).
"""
from __future__ import annotations

import onnx

from onnxfuse.core.windows import same_pads
from onnxfuse.core.rewrite import Context, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["conv_with_correct_gradient"]


@rewrite("Conv")
def conv_with_correct_gradient(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """1-D: Conv(X [N, C, L], W [M, C/g, k], B; strides s, pads (pb, pe), dilations d, group g)
    ==>  Squeeze_2(Conv(Unsqueeze_2(X) [N, C, 1, L], Unsqueeze_2(W) [M, C/g, 1, k], B;
                        strides (1, s), pads (0, pb, 0, pe), dilations (1, d), group g)).
    A 2-D convolution whose kernel, input and output have height 1 is the 1-D convolution along the width.

    S-D, S >= 3, group g > 1: Conv(X, W, B; g) ==> Concat_1(Conv(X_i, W_i, B_i; group 1) for i < g), where X_i is
    channel block i of X [N, C, *S] (C/g channels), W_i and B_i block i of W [M, C/g, *K] and B [M] (M/g rows):
    a grouped convolution is exactly that, by definition.
    """
    w_shape = ctx.shape(node.input[1])  # the weight's rank is the input's, and known when the input's is not
    rank = len(w_shape) if w_shape is not None else ctx.rank(node, node.input[0])
    attrs = ctx.attrs(node)
    group = int(attrs.get("group", 1))
    auto_pad = attrs.pop("auto_pad", "NOTSET")
    if auto_pad != "NOTSET":
        attrs["pads"] = _explicit_pads(node, ctx, attrs, auto_pad, rank - 2)
    if rank == 3:
        return _as_2d(node, ctx, attrs)
    if rank >= 5 and group > 1:
        return _per_group(node, ctx, attrs, group)
    if auto_pad != "NOTSET":
        em = Emitter(node, ctx)
        em.op("Conv", list(node.input), list(node.output), **attrs)
        return em.nodes
    return None


def _explicit_pads(node: onnx.NodeProto, ctx: Context, attrs: dict, auto_pad: str, S: int) -> list[int]:
    """auto_pad as begin and end pads (:func:`onnxfuse.core.windows.same_pads`); the spatial dims must be static."""
    if auto_pad == "VALID":
        return [0] * (2 * S)
    w_shape = ctx.shape(node.input[1])
    kernel = attrs.get("kernel_shape") or (w_shape[2:] if w_shape else None)
    if kernel is None or not all(isinstance(k, int) for k in kernel):
        raise ctx.error(node, "its kernel shape is unknown", "use a weight initializer")
    strides, dilations = attrs.get("strides", [1] * S), attrs.get("dilations", [1] * S)
    pads = [same_pads(ctx.static_dim(node, node.input[0], 2 + a, f"auto_pad {auto_pad}"), kernel[a], strides[a],
                      dilations[a], auto_pad == "SAME_UPPER") for a in range(S)]
    return [p[0] for p in pads] + [p[1] for p in pads]


def _as_2d(node: onnx.NodeProto, ctx: Context, attrs: dict) -> list[onnx.NodeProto]:
    em = Emitter(node, ctx)
    two_d = {k: attrs[k] for k in ("group",) if k in attrs}
    for key in ("kernel_shape", "strides", "dilations"):
        if key in attrs:
            two_d[key] = [1, *attrs[key]]
    if "pads" in attrs:
        pb, pe = attrs["pads"]
        two_d["pads"] = [0, pb, 0, pe]
    ins = [em.unsqueeze(node.input[0], [2]), em.unsqueeze(node.input[1], [2])] + list(node.input[2:3])
    em.squeeze(em.op("Conv", ins, **two_d), [2], output=node.output[0])
    return em.nodes


def _per_group(node: onnx.NodeProto, ctx: Context, attrs: dict, group: int) -> list[onnx.NodeProto]:
    em = Emitter(node, ctx)
    C = ctx.static_dim(node, node.input[0], 1, "splitting a grouped convolution into its groups")
    M = ctx.static_dim(node, node.input[1], 0, "splitting a grouped convolution into its groups")
    single = {k: v for k, v in attrs.items() if k != "group"}

    def blocks(t: str, size: int, axis: int) -> list[str]:
        return em.op("Split", [t, em.const([size // group] * group, hint="split")], group, axis=axis)

    xs, ws = blocks(node.input[0], C, 1), blocks(node.input[1], M, 0)
    bs = blocks(node.input[2], M, 0) if len(node.input) > 2 and node.input[2] else [None] * group
    ys = [em.op("Conv", [x, w] + ([b] if b else []), **single) for x, w, b in zip(xs, ws, bs)]
    em.op("Concat", ys, [node.output[0]], axis=1)
    return em.nodes
