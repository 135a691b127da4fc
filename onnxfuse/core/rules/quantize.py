"""Quantization: QuantizeLinear and DequantizeLinear elementwise, their scale and zero point shared by the models
(what a quantization-aware export writes: constants), so that a fused QuantizeLinear -> DequantizeLinear pair is
still one pair, which the torch runtime trains as fake quantization (``runtime/torch/patterns.py``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from onnxfuse.core.layout import stacked
from onnxfuse.core.rules._common import norm_axis
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup


@rule("QuantizeLinear", "DequantizeLinear")
def fuse_quantize(g: "NodeGroup") -> None:
    """y = saturate(round(x / scale) + zero_point) / y = (x - zero_point) * scale, scale and zero point shared.

    Layout: x's own (shared: stacked(0)); per tensor (scalar scale), any; per axis (a 1-D scale along original
    axis a), one whose model axis is not a (packed there -> stacked), the attribute ``axis`` moved to the fused
    axis. Math: elementwise with the same scale and zero point for every model's element at the same place."""
    if any(g.has_input(i) and not g.is_shared(i) for i in (1, 2)):
        g.fail("a scale or zero point that differs per model is not supported")
    if int(g.attr("block_size", 0) or 0):
        g.fail("blocked quantization is not supported")
    L = g.layout(0)
    L = stacked(0) if L is None or L.is_shared else L
    scale = g.input_shape(1)
    per_axis = scale is not None and len(scale) == 1 and scale[0] != 1
    ins = [g.get(0, L)] + [g.shared(i) if g.has_input(i) else "" for i in range(1, g.num_inputs)]
    if not per_axis:
        g.emit_same(ins, L)
        return
    a = norm_axis(int(g.attr("axis", 1)), g.rank(0))
    if L.kind == "packed" and L.axis == a:
        L = stacked(a)
        ins[0] = g.get(0, L)
    g.emit_same(ins, L, axis=L.fused_axis(a))
