"""Softmax family: normalize along one axis, which must not be the model axis of a packed tensor."""
from __future__ import annotations

from typing import TYPE_CHECKING

from onnxfuse.core.layout import stacked
from onnxfuse.core.rules._common import norm_axis
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup


@rule("Softmax", "LogSoftmax", "Hardmax")
def fuse_softmax(g: "NodeGroup") -> None:
    """Softmax along original axis k.

    Layout: stacked(a) -> axis k + (k >= a); packed(a) with a != k -> axis k; packed(k) would normalize across
    models, so it becomes stacked(k) first. Output keeps the input's layout.
    Math: every softmax row lies inside one model's tensor.
    """
    r = g.rank(0)
    L = g.layout(0)
    L = stacked(0) if L is None or L.is_shared else L
    if g.opset < 13:  # old semantics: coerce to 2-D at `axis`; with the model axis first each row stays in a model
        L = stacked(0)
        g.emit_same([g.get(0, L)], L, axis=norm_axis(int(g.attr("axis", 1)), r) + 1)
        return
    k = norm_axis(int(g.attr("axis", -1)), r)
    if L.kind == "packed" and L.axis == k:
        L = stacked(k)
    g.emit_same([g.get(0, L)], L, axis=L.fused_axis(k))
