"""Normalization: B BatchNorms are one BatchNorm over B*C channels."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..layout import packed
from ..weights import WeightSlot
from ._registry import rule

if TYPE_CHECKING:
    from ..engine import NodeGroup


@rule("BatchNormalization")
def fuse_batchnorm(g: "NodeGroup") -> None:
    """B BatchNorms -> one BatchNorm over B*C channels (inference or training mode).

    Layout: x, y [N, B*C, *S] channel-packed; scale, bias, running mean, running var [B*C] (model b's at b*C...);
    training-mode outputs running_mean/running_var [B*C].
    Math: statistics and the affine transform are per channel and channels never mix, so each model's
    channels see exactly its own BatchNorm.
    """
    x = g.get(0, packed(1))
    C = g.input_shape(0)[1]
    if not isinstance(C, int):
        g.fail("the channel count of the input is not static")
    inputs = [x]
    for i, role in ((1, "param"), (2, "param"), (3, "buffer"), (4, "buffer")):
        inputs.append(g.weight(i, WeightSlot(None, (C,)), role) if g.is_weight(i) else g.get(i, packed(0)))
    outs = g.emit_same(inputs, packed(1))
    for j in (1, 2):
        if j < len(outs) and outs[j]:
            g.set_output(j, outs[j], packed(0))
