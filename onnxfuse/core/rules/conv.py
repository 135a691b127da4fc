"""Convolution: B Convs are one grouped Conv (or, as a chosen form, B Convs on Split blocks)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from onnxfuse.core.layout import packed
from onnxfuse.core.weights import WeightSlot
from onnxfuse.core.rules._common import split_models
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup


def _per_model(g: "NodeGroup", inputs: list[str], c_in: int | None, c_out: int) -> None:
    """The "per-model" form of a (transposed) convolution, same layouts as the grouped one: Split the packed input
    (a shared input is read as it is) and the packed weights into the B models' blocks, run B ordinary nodes,
    Concat their outputs along channels.
    Math: y[:, b*Cout:(b+1)*Cout] = conv(x[:, b*Cin:(b+1)*Cin], W[b*R:(b+1)*R], bias[b*Cout:(b+1)*Cout]) with R the
    model's weight rows. B small kernels instead of one grouped one: faster where a runtime's grouped kernel is slow
    (torch's CPU grouped convolution in NCHW took 1.6x the time of the same FLOPs as one dense convolution)."""
    B = g.B
    xs = [inputs[0]] * B if g.is_shared(0) else split_models(g, inputs[0], 1, c_in)
    ws = split_models(g, inputs[1], 0, g.input_shape(1)[0])
    bs = split_models(g, inputs[2], 0, c_out) if len(inputs) > 2 else None
    ys = [g.emit(g.op_type, [xs[b], ws[b]] + ([bs[b]] if bs else []), **g.attrs())[0] for b in range(B)]
    g.set_output(0, g.emit("Concat", ys, [g.out_name(0)], axis=1)[0], packed(1))


def _weights(g: "NodeGroup", c_out: int) -> list[str]:
    """W [B*R, ...] (model b's rows b*R...) and bias [B*Cout], packed as they are, or computed packed."""
    w_shape = g.input_shape(1)
    out = [g.weight(1, WeightSlot(None, tuple(w_shape))) if g.is_weight(1) else g.get(1, packed(0))]
    if g.has_input(2):
        out.append(g.weight(2, WeightSlot(None, (c_out,))) if g.is_weight(2) else g.get(2, packed(0)))
    return out


@rule("Conv", forms=("grouped", "per-model"))
def fuse_conv(g: "NodeGroup") -> None:
    """B Convs -> one Conv with group' = B * group (form "grouped"), or B Convs on Split blocks ("per-model").

    Layout: x [N, B*Cin, *S] channel-packed; W [B*Cout, Cin/group, *K] (model b's filters are rows b*Cout...);
    bias [B*Cout]; y [N, B*Cout, *S'] channel-packed.
    Math: model b's `group` groups are contiguous in the fused channels, so y[:, b*Cout:(b+1)*Cout] = conv_b(x_b).
    A shared input with group == 1 is not copied: a plain Conv with the B filter banks stacked reads it once.
    """
    group = int(g.attr("group", 1))
    c_out = g.input_shape(1)[0]
    shared = g.is_shared(0) and (group == 1 or g.form == "per-model")
    inputs = [g.shared(0) if shared else g.get(0, packed(1))] + _weights(g, c_out)
    if g.form == "per-model":
        _per_model(g, inputs, (g.input_shape(0) or [None, None])[1], c_out)
    else:
        g.emit_same(inputs, packed(1), group=1 if shared else group * g.B)


@rule("ConvTranspose", forms=("grouped", "per-model"))
def fuse_conv_transpose(g: "NodeGroup") -> None:
    """B ConvTransposes -> one ConvTranspose with group' = B * group ("grouped"), or B on Split blocks ("per-model").

    Layout: x [N, B*Cin, *S] channel-packed (a shared input is tiled); W [B*Cin, Cout/group, *K] (model b's rows
    b*Cin...); bias [B*Cout]; y [N, B*Cout, *S'] channel-packed. output_shape/output_padding are spatial and
    unchanged. Math: as for Conv, model b's groups are contiguous.
    """
    group = int(g.attr("group", 1))
    w_shape = g.input_shape(1)
    c_out = w_shape[1] * group
    shared = g.is_shared(0) and g.form == "per-model"
    inputs = [g.shared(0) if shared else g.get(0, packed(1))] + _weights(g, c_out)
    if g.form == "per-model":
        _per_model(g, inputs, w_shape[0], c_out)
    else:
        g.emit_same(inputs, packed(1), group=group * g.B)
