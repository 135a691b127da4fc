"""Signal processing: the windows and the mel matrix are constants of their size (shared: emitted once); DFT and
STFT transform along original axes, never the model axis."""
from __future__ import annotations

from typing import TYPE_CHECKING

from onnxfuse.core.layout import packed, stacked
from onnxfuse.core.rules._common import norm_axis
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup


@rule("HannWindow", "HammingWindow", "BlackmanWindow", "MelWeightMatrix")
def fuse_window(g: "NodeGroup") -> None:
    """A window or filter bank depends on its sizes alone; sizes that differ per model (never from an exported
    model: they are constants or shape arithmetic) are refused."""
    g.fail("a window size that differs per model is not supported")


@rule("DFT")
def fuse_dft(g: "NodeGroup") -> None:
    """DFT along one original axis (an attribute before opset 20, a constant input from then on), the trailing
    real/imaginary axis kept last: any layout whose model axis is not the transformed one or the last (packed
    there -> stacked(0)), fused axis k + (k >= a)."""
    r = g.rank(0)
    if g.opset >= 20:
        given = g.const(2) if g.has_input(2) else None
        if g.has_input(2) and given is None:
            g.fail("the DFT axis must be a constant")
        k = norm_axis(int(given.reshape(-1)[0]) if given is not None else -2, r)
    else:
        k = norm_axis(int(g.attr("axis", 1)), r)
    if g.has_input(1) and not g.is_shared(1):
        g.fail("dft_length must be the same for every model")
    L = g.layout(0)
    if L is None or L.is_shared or (L.kind == "packed" and L.axis in (k, r - 1)) or \
            (L.kind == "stacked" and L.axis == r):
        L = stacked(0)
    x = g.get(0, L)
    if g.opset >= 20:
        ins = [x, g.shared(1) if g.has_input(1) else "", g.new_const(L.fused_axis(k), "axis")]
        g.emit_same(ins, L)
    else:
        g.emit_same([x] + ([g.shared(1)] if g.has_input(1) else []), L, axis=L.fused_axis(k))


@rule("STFT")
def fuse_stft(g: "NodeGroup") -> None:
    """STFT(signal [N, L, 1|2], step, window, length): the models side by side along the batch, [B*N, ...]
    (packed(0)) in and out; step, window and length shared."""
    if any(g.has_input(i) and not g.is_shared(i) for i in (1, 2, 3)):
        g.fail("a frame step, window or frame length that differs per model is not supported")
    g.emit_same([g.get(0, packed(0))] + [g.shared(i) if g.has_input(i) else "" for i in (1, 2, 3)], packed(0))
