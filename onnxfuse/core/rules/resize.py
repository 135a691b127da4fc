"""Resampling: Resize (original axes only; the model axis keeps scale 1), GridSample and AffineGrid (the models side
by side along the batch)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from onnxfuse.core.layout import packed, stacked
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup


@rule("Resize")
def fuse_resize(g: "NodeGroup") -> None:
    """Resize(X, roi, scales, sizes) with constant scales or sizes (roi unused, i.e. not tf_crop_and_resize).

    Layout: channel-packed x [N, B*C, *S] when the channel axis keeps its size (sizes[1] *= B); otherwise
    stacked(0) with scale 1 / size B inserted for the model axis. Math: interpolation runs within each channel.
    """
    if g.attr("coordinate_transformation_mode") == "tf_crop_and_resize":
        g.fail("tf_crop_and_resize is not supported")
    r = g.rank(0)
    scales = g.const(2) if g.has_input(2) else None
    sizes = g.const(3) if g.has_input(3) else None
    if (g.has_input(2) and scales is None) or (g.has_input(3) and sizes is None):
        g.fail("scales and sizes must be constants")
    in_shape = g.input_shape(0)
    channel_kept = (scales is not None and scales.size and scales[1] == 1) or \
                   (sizes is not None and sizes.size and sizes[1] == in_shape[1])
    L = packed(1) if r >= 2 and channel_kept else stacked(0)
    ins = [g.get(0, L), g.shared(1) if g.has_input(1) else ""]
    if L == packed(1):
        ins.append(g.shared(2) if g.has_input(2) else "")
        if sizes is not None:
            s = sizes.astype(np.int64).copy()
            s[1] *= g.B
            ins.append(g.new_const(s, "sizes"))
    else:
        ins.append(g.new_const(np.insert(scales.astype(np.float32), 0, 1.0), "scales", np.float32)
                   if scales is not None and scales.size else "")
        if sizes is not None:
            ins.append(g.new_const(np.insert(sizes.astype(np.int64), 0, g.B), "sizes"))
    g.emit_same(ins, L)


@rule("GridSample")
def fuse_grid_sample(g: "NodeGroup") -> None:
    """GridSample(X [N, C, *S], grid [N, *S_out, k]): the models side by side along the batch.

    Layout: X, grid and the output [B*N, ...] (packed(0)): model b's samples are rows [bN, (b+1)N) of each.
    Math: sample n of the output reads only sample n of X at sample n's grid, so model b's rows see only its own
    image and its own grid (a spatial transformer's sampler; a shared X is copied per model).
    """
    g.emit_same([g.get(0, packed(0)), g.get(1, packed(0))], packed(0))


@rule("AffineGrid")
def fuse_affine_grid(g: "NodeGroup") -> None:
    """AffineGrid(theta [N, 2|3, 3|4], size [N, C, *S]): theta [B*N, ...] (packed(0)), size's N times B, the
    grid [B*N, *S, 2|3] (packed(0)). Math: each row of theta maps its own sample's grid."""
    if not g.is_shared(1):
        g.fail("the output size must be the same for every model")
    r = g.input_shape(1)[0] if g.input_shape(1) else None
    if not isinstance(r, int):
        g.fail("the size input's length is not static")
    size = g.emit("Mul", [g.shared(1), g.new_const(np.array([g.B] + [1] * (r - 1), np.int64), "model_rows")])[0]
    g.emit_same([g.get(0, packed(0)), size], packed(0))
