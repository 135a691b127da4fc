"""AveragePool's gradient kernel in onnxruntime-training 1.19.2 (CPU) takes the input-gradient shape from the graph's
declared shapes, where a symbolic batch dim reads as 0 (the train step divides by zero and crashes), ignores
ceil_mode, and overwrites instead of accumulating overlapping 3-D windows. Rewrite the pooling as a convolution with
a constant all-ones kernel, whose gradient is right, and divide by the window sizes torch uses."""
from __future__ import annotations

import numpy as np
import onnx

from onnxfuse.core.windows import average_divisors, floor_mode_end_pad, output_length
from onnxfuse.core.rewrite import Context, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["average_pool_as_conv"]


@rewrite("AveragePool")
def average_pool_as_conv(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """AveragePool(X [N, C, *S]; kernel k, strides s, pads (pb, pe), count_include_pad, ceil_mode)
    ==>  Reshape(Conv(Reshape(X, [N*C, 1, *S]), ones [1, 1, *k]; strides s, pads (pb, pe')), [N, C, *S'])
         * (1 / divisor)

    Layout: channels move into the batch so one single-channel convolution pools every channel (group 1, whose
    gradient is right in every rank; a 1-D one is legalized further). pe' >= pe gives the windows of ceil_mode in
    floor mode (:func:`onnxfuse.core.windows.floor_mode_end_pad`); the zero padding adds nothing to the sums.
    Math: window o's mean is its sum over the elements torch counts (:func:`onnxfuse.core.windows.average_divisors`:
    those inside the padded axis when count_include_pad, else those inside the input); divisor [1, 1, *S'] is the
    product of the per-axis counts, a constant.
    """
    x, y = node.input[0], node.output[0]
    rank = ctx.rank(node, x)
    S = rank - 2
    attrs = ctx.attrs(node)
    if attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise ctx.error(node, f"its auto_pad is {attrs['auto_pad']}", "export with explicit padding (torch does)")
    if any(d != 1 for d in attrs.get("dilations", [1] * S)):
        raise ctx.error(node, "it has dilations", "pool without dilation (torch's AvgPool has none)")
    k, s = list(attrs["kernel_shape"]), list(attrs.get("strides", [1] * S))
    pads = list(attrs.get("pads", [0] * (2 * S))) if attrs.get("auto_pad", "NOTSET") == "NOTSET" else [0] * (2 * S)
    ceil, include = bool(attrs.get("ceil_mode", 0)), bool(attrs.get("count_include_pad", 0))
    C = ctx.static_dim(node, x, 1, "pooling as a convolution")
    L = [ctx.static_dim(node, x, 2 + a, "pooling as a convolution") for a in range(S)]
    n = [output_length(L[a], k[a], s[a], pads[a], pads[S + a], 1, ceil) for a in range(S)]
    end = [floor_mode_end_pad(L[a], k[a], s[a], pads[a], pads[S + a], 1, n[a]) for a in range(S)]
    divisor = np.ones(n)
    for a in range(S):
        shape = [1] * S
        shape[a] = n[a]
        divisor = divisor * average_divisors(L[a], k[a], s[a], pads[a], pads[S + a], n[a], include).reshape(shape)
    dtype = ctx.np_dtype(x)
    em = Emitter(node, ctx)
    rows = em.reshape(x, [-1, 1] + L)
    sums = em.op("Conv", [rows, em.const(np.ones([1, 1] + k), dtype, "ones")], kernel_shape=k, strides=s,
                 pads=pads[:S] + end)
    per_channel = em.reshape(sums, [-1, C] + n)
    em.op("Mul", [per_channel, em.const((1.0 / divisor).reshape([1, 1] + n), dtype, "inverse_divisor")], [y])
    return em.nodes


@rewrite("GlobalMaxPool")
def global_max_pool_as_reduce_max(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """GlobalMaxPool(X [N, C, *S])  ==>  ReduceMax(X, axes = spatial, keepdims 1) [N, C, 1, ...].

    GlobalMaxPool has no gradient builder in onnxruntime-training 1.19; ReduceMax is legalized in turn (its gradient
    split evenly among tied maxima, like torch.amax; torch's adaptive_max_pool gives a tie to one element instead,
    which differs only at exact ties)."""
    rank = ctx.rank(node, node.input[0])
    em = Emitter(node, ctx)
    em.reduce("ReduceMax", node.input[0], list(range(2, rank)), keepdims=1, output=node.output[0])
    return em.nodes
