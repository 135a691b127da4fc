"""Slice with a negative step along the last axis (torch's x.flip(-1)) cannot be trained in ORT 1.19: its SliceGrad
kernel fails with 'narrowing_error' in the train step. The same slice along another axis works, so move the axis."""
from __future__ import annotations

import numpy as np
import onnx

from onnxfuse.core.rewrite import Context, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["slice_reversed_last_axis"]


@rewrite("Slice")
def slice_reversed_last_axis(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """Slice(X, starts, ends, axes, steps) with steps < 0 on axis r-1
    ==>  Gather(X, idx, axis=r-1) for the last axis + Slice for the rest, when its length and bounds are static;
         else Transpose(swap r-2, r-1) -> the same Slice with axis r-1 renamed r-2 -> Transpose back (r >= 2, and
         axis r-2 not also reversed). (The transposed form's SliceGrad also failed, with 'narrowing_error', on a
         flipped [N, 6] tensor in a fused array.)

    Layout: X [.., A, L]; the transposed X [.., L, A] is sliced along its axis r-2.
    Math: slicing commutes with a permutation of axes; Gather(idx = range(L)[start:end:step]) is the same selection
    and its gradient scatters back to those indices.
    """
    x, y = node.input[0], node.output[0]
    inputs = list(node.input) + [""] * (5 - len(node.input))
    steps = ctx.constant(inputs[4]) if inputs[4] else None
    if steps is None or not (steps < 0).any():
        return None  # positive (or unknown) steps: SliceGrad works
    rank = ctx.rank(node, x)
    axes_value = ctx.constant(inputs[3]) if inputs[3] else np.arange(len(steps))
    if axes_value is None:
        return None
    axes = [int(a) + rank if int(a) < 0 else int(a) for a in axes_value.reshape(-1)]
    steps = [int(s) for s in steps.reshape(-1)]
    last = rank - 1
    if last not in axes or steps[axes.index(last)] > 0:
        return None
    em = Emitter(node, ctx)
    j = axes.index(last)
    shape = ctx.shape(x)
    static_last = shape is not None and isinstance(shape[last], int)
    starts_c, ends_c = ctx.constant(inputs[1]), ctx.constant(inputs[2])
    if rank >= 2 and not (static_last and starts_c is not None and ends_c is not None) \
            and not (rank - 2 in axes and steps[axes.index(rank - 2)] < 0):
        perm = list(range(rank - 2)) + [rank - 1, rank - 2]
        swapped = [rank - 2 if a == last else rank - 1 if a == rank - 2 else a for a in axes]
        t = em.transpose(x, perm)
        s = em.op("Slice", [t, inputs[1], inputs[2], em.const(swapped, hint="axes"), inputs[4]])
        em.transpose(s, perm, output=y)
        return em.nodes
    starts, ends = starts_c, ends_c
    if starts is None or ends is None:
        raise ctx.error(node, "it reverses the last axis with non-constant starts or ends",
                        "flip a different axis (transpose first)")
    L = ctx.static_dim(node, x, last, "reversing the last axis with Gather")
    idx = np.arange(L)[_clamp(int(starts.reshape(-1)[j]), L):_clamp(int(ends.reshape(-1)[j]), L):steps[j]]
    rest = [k for k in range(len(axes)) if k != j]
    if rest:
        x = em.slice(x, [int(starts.reshape(-1)[k]) for k in rest], [int(ends.reshape(-1)[k]) for k in rest],
                     [axes[k] for k in rest], [steps[k] for k in rest])
    em.op("Gather", [x, em.const(idx, hint="indices")], [y], axis=last)
    return em.nodes


def _clamp(v: int, n: int) -> int:
    """ONNX and Python agree on slicing once huge int64 sentinels are brought into range."""
    return max(min(v, n), -n - 1)
