"""Concat, Split, Slice, Pad, Trilu: data movement along original axes, never along the model axis."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from onnxfuse.core.layout import Layout, stacked
from onnxfuse.core.rules._common import const_list, norm_axis
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup


def _along(g: "NodeGroup", i: int, axes: list[int]) -> Layout:
    """Input i's layout if its model axis can stay put while ``axes`` are cut or joined, else stacked there.

    packed(a) with a in ``axes`` would cut or join across the model blocks (e.g. Concat along the channel axis of
    a channel-packed tensor interleaves models wrongly), so it becomes stacked(a), a free view.
    """
    L = g.layout(i)
    if L is None or L.is_shared:
        return stacked(0)
    return stacked(L.axis) if L.kind == "packed" and L.axis in axes else L


@rule("Concat")
def fuse_concat(g: "NodeGroup") -> None:
    """Concatenate along original axis k.

    Layout: the first per-model input's layout (packed(k) -> stacked(k)); every other input, shared ones and
    weights included, is converted to it. Fused axis: k + (k >= a) for stacked(a), k for packed(a != k).
    Math: models never meet, since the model axis is not the concatenation axis.
    """
    r = g.output_rank(0)
    k = norm_axis(int(g.attr("axis")), r)
    first = next(i for i in range(g.num_inputs) if not g.is_shared(i))
    L = _along(g, first, [k])
    g.emit_same([g.get(i, L) for i in range(g.num_inputs)], L, axis=L.fused_axis(k))


@rule("Split")
def fuse_split(g: "NodeGroup") -> None:
    """Split along original axis k into pieces of the original sizes (the shared ``split`` input or attribute
    is unchanged). Layout: the input's (packed(k) -> stacked(k)) for every output."""
    r = g.rank(0)
    k = norm_axis(int(g.attr("axis", 0)), r)
    L = _along(g, 0, [k])
    ins = [g.get(0, L)] + [g.shared(i) if g.has_input(i) else "" for i in range(1, g.num_inputs)]
    g.emit_same(ins, L, axis=L.fused_axis(k))


@rule("Slice")
def fuse_slice(g: "NodeGroup") -> None:
    """Slice original axes (constant ``axes``; starts/ends/steps shared, possibly computed at run time).

    Layout: the input's (packed(a) with a sliced -> stacked(a)); axes remapped to fused axes, so the model axis
    is never sliced.
    """
    r = g.rank(0)
    axes = const_list(g, 3, "axes")
    if axes is None:
        n = g.input_shape(1)
        if not n or not isinstance(n[0], int):
            g.fail("Slice without axes needs a static number of starts")
        axes = list(range(n[0]))
    axes = [norm_axis(k, r) for k in axes]
    L = _along(g, 0, axes)
    ins = [g.get(0, L), g.shared(1), g.shared(2), g.new_const([L.fused_axis(k) for k in axes], "axes")]
    if g.has_input(4):
        ins.append(g.shared(4))
    g.emit_same(ins, L)


@rule("Pad")
def fuse_pad(g: "NodeGroup") -> None:
    """Pad original axes (constant ``pads``, shared constant value): zero padding is added for the model axis.

    Layout: the input's (packed(a) with axis a padded -> stacked(a)); pads [begins..., ends...] get a 0 begin and
    end at the model axis position (or the model axis is simply absent from an explicit ``axes`` input).
    """
    r = g.rank(0)
    pads = const_list(g, 1, "pads")
    if pads is None:
        g.fail("Pad needs pads as an input (opset >= 11)")
    axes = const_list(g, 3, "axes")
    axes = list(range(r)) if axes is None else [norm_axis(k, r) for k in axes]
    padded = [k for n, k in enumerate(axes) if pads[n] or pads[n + len(axes)]]
    L = _along(g, 0, padded)
    x = g.get(0, L)
    value = g.shared(2) if g.has_input(2) else ""
    if g.has_input(3):  # explicit axes: remap them, pads unchanged
        g.emit_same([x, g.shared(1), value, g.new_const([L.fused_axis(k) for k in axes], "axes")], L)
        return
    begins, ends = pads[:r], pads[r:]
    m = L.axis if L.kind == "stacked" else None
    if m is not None:
        begins, ends = begins[:m] + [0] + begins[m:], ends[:m] + [0] + ends[m:]
    g.emit_same([x, g.new_const(np.array(begins + ends, np.int64), "pads"), value], L)



@rule("Trilu")
def fuse_trilu(g: "NodeGroup") -> None:
    """The upper or lower triangle of the last two original axes, k shared: any layout whose model axis is before
    them (else stacked(0)); a causal mask's triangle, per model."""
    r = g.rank(0)
    if g.has_input(1) and not g.is_shared(1):
        g.fail("a diagonal k that differs per model is not supported")
    L = _along(g, 0, [r - 2, r - 1])
    if L.kind == "stacked" and L.axis > r - 2:
        L = stacked(0)
    g.emit_same([g.get(0, L)] + ([g.shared(1)] if g.has_input(1) else []), L)
