"""Resize: scale original axes only; the model axis keeps scale 1."""
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
