"""Resize has a gradient op without a CPU kernel in ORT 1.19 (ResizeGrad): rewrite F.interpolate's forms as
Expand (nearest, integer factors), Gather (other nearest maps) or MatMul with constant interpolation matrices
(linear)."""
from __future__ import annotations

import math

import numpy as np
import onnx

from onnxfuse.core._resize import nearest_index, source_coords
from onnxfuse.core.rewrite import COPY, Context, Dims, Emitter
from onnxfuse.runtime.ort.legalize._registry import rewrite

__all__ = ["resize"]

_COORDINATE_MODES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric")
_SAMPLE_LENGTHS = (5, 6, 7)  # for a symbolic length: a nearest map that repeats for these repeats for all


@rewrite("Resize")
def resize(node: onnx.NodeProto, ctx: Context) -> list[onnx.NodeProto] | None:
    """Resize(X, roi, scales | sizes; mode, coordinate_transformation_mode, nearest_mode), one axis at a time.

    Layout: X [d0..dr-1]; per resized axis a (scale != 1): length L -> L' = floor(L * scale), or sizes[a]
    (then scale = L'/L). Axes left alone keep any (symbolic) size; a resized axis needs a static L except for
    nearest with an integer factor.
    nearest, integer factor f with map i -> i // f (torch's 'nearest'): Unsqueeze a unit axis after each resized
        axis, Expand it to f, Reshape [.., L*f, ..]. Any other nearest map: Gather(X, idx, axis=a), idx[i] the
        source index the ONNX formula gives. Gradient: the sum over the copies, like torch.
    linear: Y = X x_a M_a with M_a [L, L'] = the two-tap weights of each output i at source coordinate
        x(i) (half_pixel: (i + 1/2)/scale - 1/2; align_corners: i (L-1)/(L'-1); asymmetric: i/scale; ...) clamped
        to [0, L-1]: MatMul(X, M) on the last axis, MatMul(M^T, X) on the second to last, else Transpose around.
    Math: resizing is linear in X and separable per axis; the gradient is M^T applied to Y', torch's upsample
    backward. cubic, tf_crop_and_resize and antialias are not supported.
    """
    x, y = node.input[0], node.output[0]
    attrs = ctx.attrs(node)
    mode = attrs.get("mode", "nearest")
    coord = attrs.get("coordinate_transformation_mode", "half_pixel")
    nearest_mode = attrs.get("nearest_mode", "round_prefer_floor")
    if mode not in ("nearest", "linear"):
        raise ctx.error(node, f"its mode is '{mode}'",
                        "use mode='nearest', 'bilinear' or 'linear' in F.interpolate")
    if coord not in _COORDINATE_MODES:
        raise ctx.error(node, f"its coordinate_transformation_mode is '{coord}'",
                        f"use one of {', '.join(_COORDINATE_MODES)}")
    if int(attrs.get("antialias", 0)):
        raise ctx.error(node, "it sets antialias=1", "resize without antialias")
    rank = ctx.rank(node, x)
    axes = [int(a) + rank if int(a) < 0 else int(a) for a in attrs.get("axes", range(rank))]
    resized = _resized_axes(node, ctx, x, rank, axes, attrs.get("keep_aspect_ratio_policy", "stretch"))
    em = Emitter(node, ctx)
    if not resized:
        em.finish(x, y)
        return em.nodes
    if mode == "nearest":
        out = _nearest(node, ctx, em, x, rank, resized, coord, nearest_mode)
    else:
        out = _linear(em, x, rank, resized, coord)
    em.finish(out, y)
    return em.nodes


def _resized_axes(node, ctx: Context, x: str, rank: int, axes: list[int], policy: str) -> list[tuple]:
    """[(axis, L, L', scale)] for the axes that change (L may be symbolic for an integer nearest factor)."""
    shape, out_shape = ctx.shape(x), ctx.shape(node.output[0])
    scales = ctx.constant(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    resized = []
    if scales is not None and scales.size > 0:
        if scales.size != len(axes):
            raise ctx.error(node, f"it has {scales.size} scales for {len(axes)} axes", "fix the scales")
        for a, scale in zip(axes, scales.astype(np.float64)):
            scale = float(np.float32(scale))
            if scale == 1.0:
                continue
            L, L2 = shape[a], out_shape[a] if out_shape is not None and len(out_shape) == rank else None
            if not isinstance(L2, int):
                L2 = int(math.floor(L * scale)) if isinstance(L, int) else None
            resized.append((a, L, L2, scale))
        return resized
    if len(node.input) < 4 or not node.input[3]:
        raise ctx.error(node, "it has neither constant scales nor sizes", "resize with a constant scale_factor")
    if policy != "stretch":
        raise ctx.error(node, f"keep_aspect_ratio_policy is '{policy}'", "use 'stretch' (torch's behaviour)")
    sizes = ctx.int_values(node.input[3])
    if sizes is None or len(sizes) != len(axes):
        raise ctx.error(node, f"its sizes input '{node.input[3]}' is not a constant",
                        "resize to constant sizes (or with scale_factor)")
    for a, size in zip(axes, sizes):
        L = shape[a]
        if size == (x, a) or (isinstance(size, int) and size == L):
            continue  # this axis keeps its length: scale 1
        if not isinstance(size, int) or not isinstance(L, int):
            raise ctx.error(node, f"the size of axis {a} ({L} -> {size}) is not static",
                            "resize to constant sizes along axes of static size")
        resized.append((a, L, size, size / L))
    return resized


def _nearest_index(out_len: int, in_len: int, scale: float, coord: str, nearest_mode: str) -> np.ndarray:
    return nearest_index(source_coords(out_len, in_len, scale, coord), nearest_mode, in_len)


def _is_repeat(L, scale: float, coord: str, nearest_mode: str) -> bool:
    """Whether nearest resizing by ``scale`` along a length-L axis is 'repeat each element f times'."""
    f = int(round(scale))
    if f != scale or f < 1:
        return False
    lengths = [L] if isinstance(L, int) else _SAMPLE_LENGTHS
    return all(np.array_equal(_nearest_index(n * f, n, scale, coord, nearest_mode), np.arange(n * f) // f)
               for n in lengths)


def _nearest(node, ctx: Context, em: Emitter, x: str, rank: int, resized, coord: str, nearest_mode: str) -> str:
    repeat = [p for p in resized if _is_repeat(p[1], p[3], coord, nearest_mode)]
    gather = [p for p in resized if p not in repeat]
    for a, L, L2, scale in gather:
        if not isinstance(L, int):
            raise ctx.error(node, f"nearest resizing of axis {a} by {scale} needs a static length (it is {L})",
                            "use an integer scale_factor, or a fixed size along that axis")
        idx = _nearest_index(L2, L, scale, coord, nearest_mode)
        x = em.op("Gather", [x, em.const(idx, hint="nearest_index")], axis=a)
    if not repeat:
        return x
    shape = list(ctx.shape(node.input[0]))
    for a, L, L2, scale in gather:
        shape[a] = L2
    factors = {a: int(round(scale)) for a, _, _, scale in repeat}
    # [.., La, 1, ..] -Expand-> [.., La, fa, ..] -Reshape-> [.., La*fa, ..]
    positions, expanded_dims, pos = {}, [], 0
    for a in range(rank):
        positions[a] = pos
        expanded_dims.append(shape[a])
        pos += 1
        if a in factors:
            expanded_dims.append(factors[a])
            pos += 1
    unit = [positions[a] + 1 for a in sorted(factors)]
    x = em.unsqueeze(x, unit)
    target = [1] * len(expanded_dims)
    for a in factors:
        target[positions[a] + 1] = factors[a]
    x = em.op("Expand", [x, em.const(target, hint="repeat")])
    parts, first = [], min(factors)
    for a in range(rank):
        if a < first:
            parts.append(COPY)  # positions before the first inserted axis are unchanged
        elif a in factors:
            parts.append(Dims(x, (positions[a], positions[a] + 1), (shape[a], factors[a])))
        else:
            parts.append(Dims(x, (positions[a],), (shape[a],)))
    return em.reshape(x, parts)


def _interpolation_matrix(in_len: int, out_len: int, scale: float, coord: str) -> np.ndarray:
    """M [in_len, out_len]: output i = sum_j X[j] M[j, i], two taps at the clamped source coordinate."""
    xs = np.clip(source_coords(out_len, in_len, scale, coord), 0, in_len - 1)
    lo = np.floor(xs).astype(np.int64)
    hi = np.minimum(lo + 1, in_len - 1)
    frac = xs - lo
    m = np.zeros((in_len, out_len), np.float64)
    cols = np.arange(out_len)
    np.add.at(m, (lo, cols), 1 - frac)
    np.add.at(m, (hi, cols), frac)
    return m


def _linear(em: Emitter, x: str, rank: int, resized, coord: str) -> str:
    dtype = em.ctx.np_dtype(em.node.input[0])
    for a, L, L2, scale in resized:
        if not isinstance(L, int):
            raise em.ctx.error(em.node, f"linear resizing of axis {a} needs a static length (it is {L})",
                               "export the model with a fixed size along that axis")
        m = _interpolation_matrix(L, L2, scale, coord)
        if a == rank - 1:
            x = em.op("MatMul", [x, em.const(m, dtype, "interpolation")])
        elif a == rank - 2:
            x = em.op("MatMul", [em.const(m.T, dtype, "interpolation"), x])
        else:
            perm = [b for b in range(rank) if b != a] + [a]
            x = em.op("MatMul", [em.transpose(x, perm), em.const(m, dtype, "interpolation")])
            x = em.transpose(x, [int(p) for p in np.argsort(perm)])
    return x
