"""Convolution: B Convs are one grouped Conv."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..layout import packed
from ..weights import WeightSlot
from ._registry import rule

if TYPE_CHECKING:
    from ..engine import NodeGroup


@rule("Conv")
def fuse_conv(g: "NodeGroup") -> None:
    """B Convs -> one Conv with group' = B * group.

    Layout: x [N, B*Cin, *S] channel-packed; W [B*Cout, Cin/group, *K] (model b's filters are rows b*Cout...);
    bias [B*Cout]; y [N, B*Cout, *S'] channel-packed.
    Math: model b's `group` groups are contiguous in the fused channels, so y[:, b*Cout:(b+1)*Cout] = conv_b(x_b).
    A shared input with group == 1 is not copied: a plain Conv with the B filter banks stacked reads it once.
    """
    group = int(g.attr("group", 1))
    if g.is_shared(0) and group == 1:
        x, new_group = g.shared(0), 1
    else:
        x, new_group = g.get(0, packed(1)), group * g.B
    w_shape = g.input_shape(1)
    w = g.weight(1, WeightSlot(None, tuple(w_shape))) if g.is_weight(1) else g.get(1, packed(0))
    inputs = [x, w]
    if g.has_input(2):
        inputs.append(g.weight(2, WeightSlot(None, (w_shape[0],))) if g.is_weight(2) else g.get(2, packed(0)))
    g.emit_same(inputs, packed(1), group=new_group)


@rule("ConvTranspose")
def fuse_conv_transpose(g: "NodeGroup") -> None:
    """B ConvTransposes -> one ConvTranspose with group' = B * group.

    Layout: x [N, B*Cin, *S] channel-packed (a shared input is tiled); W [B*Cin, Cout/group, *K] (model b's rows
    b*Cin...); bias [B*Cout]; y [N, B*Cout, *S'] channel-packed. output_shape/output_padding are spatial and
    unchanged. Math: as for Conv, model b's groups are contiguous.
    """
    group = int(g.attr("group", 1))
    w_shape = g.input_shape(1)
    w = g.weight(1, WeightSlot(None, tuple(w_shape))) if g.is_weight(1) else g.get(1, packed(0))
    inputs = [g.get(0, packed(1)), w]
    if g.has_input(2):
        c_out = w_shape[1] * group
        inputs.append(g.weight(2, WeightSlot(None, (c_out,))) if g.is_weight(2) else g.get(2, packed(0)))
    g.emit_same(inputs, packed(1), group=group * g.B)
