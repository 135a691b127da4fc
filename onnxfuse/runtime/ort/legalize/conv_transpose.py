"""ConvTranspose has a gradient op without a CPU kernel in ORT 1.19 (ConvTransposeGrad): rewrite it as a Conv over
the zero-upsampled input, with the weight transformed in the graph so its gradient reaches the original parameter."""
from __future__ import annotations

import numpy as np
import onnx

from onnxfuse.core.rewrite import COPY, Context, Dims, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["conv_transpose"]

_INT64_MAX = int(np.iinfo(np.int64).max)


@rewrite("ConvTranspose")
def conv_transpose(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """ConvTranspose(X, W[, B]; strides s, pads (pb, pe), dilations d, output_padding op, group g)
    ==>  Conv(Upsample_s(X), W', B; dilations d, pads (d(k-1) - pb, d(k-1) - pe + op), strides 1, group g).

    Layout: X [N, Cin, L1..LS]; W [Cin, Cout/g, k1..kS]; W' [Cout, Cin/g, k1..kS] =
    Reshape(W, [g, Cin/g, Cout/g, k]) -> Transpose(0, 2, 1, ...) -> Reshape [Cout, Cin/g, k] -> flip every spatial
    axis (Gather with reversed indices). Upsample_s inserts s-1 zeros between neighbours: Unsqueeze a unit axis
    after each spatial axis, Pad it to s, Reshape [N, Cin, L*s] (the s-1 trailing zeros come off the end padding).
    Math: a transposed convolution is the adjoint of a strided convolution, i.e. a stride-1 convolution of the
    dilated input with the flipped, in/out-swapped kernel; output length s(L-1) + op + d(k-1) + 1 - pb - pe in both.
    Negative Conv pads (pb > d(k-1)) crop the input with Slice instead.
    """
    x, w, y = node.input[0], node.input[1], node.output[0]
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    attrs = ctx.attrs(node)
    rank = ctx.rank(node, x)
    S = rank - 2
    w_shape = ctx.shape(w)
    if w_shape is None or len(w_shape) != rank or not all(isinstance(d, int) for d in w_shape):
        raise ctx.error(node, f"the shape of its weight '{w}' is not static", "use a weight initializer")
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "VALID"):
        raise ctx.error(node, f"auto_pad is {auto_pad}", "export with explicit padding (torch always does)")
    if "output_shape" in attrs:
        raise ctx.error(node, "it sets output_shape", "give pads and output_padding instead (torch does)")
    g = int(attrs.get("group", 1))
    k = [int(v) for v in attrs.get("kernel_shape", w_shape[2:])]
    s = [int(v) for v in attrs.get("strides", [1] * S)]
    d = [int(v) for v in attrs.get("dilations", [1] * S)]
    op = [int(v) for v in attrs.get("output_padding", [0] * S)]
    pads = [0] * (2 * S) if auto_pad == "VALID" else [int(v) for v in attrs.get("pads", [0] * (2 * S))]
    cin, cout_g = w_shape[0], w_shape[1]
    if cin % g:
        raise ctx.error(node, f"its weight has {cin} input channels, not a multiple of group {g}", "fix the group")
    em = Emitter(node, ctx)

    # W [Cin, Cout/g, k] -> W' [Cout, Cin/g, k], flipped: W'[j*Cout/g + o, i, t] = W[j*Cin/g + i, o, k-1-t] (group j)
    if g == 1:
        w2 = em.transpose(w, [1, 0] + list(range(2, rank)))
    else:
        w2 = em.reshape(w, [g, cin // g, cout_g] + k)
        w2 = em.transpose(w2, [0, 2, 1] + list(range(3, S + 3)))
        w2 = em.reshape(w2, [g * cout_g, cin // g] + k)
    for a in range(S):
        if k[a] > 1:  # flip with Gather: ORT 1.19's SliceGrad fails on a negative step along the last axis
            w2 = em.op("Gather", [w2, em.const(np.arange(k[a] - 1, -1, -1), hint="reversed")], axis=a + 2)

    begin = [d[a] * (k[a] - 1) - pads[a] for a in range(S)]
    end = [d[a] * (k[a] - 1) - pads[S + a] + op[a] for a in range(S)]
    shape = ctx.shape(x)
    if any(v > 1 for v in s):
        # zero-upsample: [N, C, L1, 1, L2, 1, ...] -Pad-> [N, C, L1, s1, L2, s2, ...] -Reshape-> [N, C, L1*s1, ...]
        unit = [2 + 2 * a + 1 for a in range(S)]
        x = em.unsqueeze(x, unit)
        pad_end = [0] * (2 + 2 * S)
        for a in range(S):
            pad_end[unit[a]] = s[a] - 1
        x = em.op("Pad", [x, em.const([0] * (2 + 2 * S) + pad_end, hint="pads")], mode="constant")
        up_dims = [shape[2 + a] for a in range(S)]
        x = em.reshape(x, [COPY, COPY] + [Dims(x, (2 + 2 * a, 3 + 2 * a), (up_dims[a], s[a])) for a in range(S)])
        end = [end[a] - (s[a] - 1) for a in range(S)]  # the s-1 zeros after the last element are not in Upsample_s
    crop = [a for a in range(S) if begin[a] < 0 or end[a] < 0]
    if crop:
        x = em.slice(x, [max(-begin[a], 0) for a in crop], [end[a] if end[a] < 0 else _INT64_MAX for a in crop],
                     [a + 2 for a in crop])
    conv_pads = [max(v, 0) for v in begin] + [max(v, 0) for v in end]
    em.op("Conv", [x, w2] + ([bias] if bias else []), [y], dilations=d, group=g, kernel_shape=k, pads=conv_pads,
          strides=[1] * S)
    return em.nodes
