"""Helpers shared by rules: numpy-style broadcasting of per-model operands, axis arithmetic."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from onnxfuse.core.layout import Layout, stacked
from onnxfuse.core.weights import WeightSlot

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup

__all__ = ["broadcast_layout", "broadcast_input", "broadcast_inputs", "norm_axis", "unsqueeze", "const_list", "axes_arg",
           "emit_with_axes", "model_axis_stacked", "insert_model_entry", "split_models"]


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def unsqueeze(g: "NodeGroup", x: str, axes: Sequence[int]) -> str:
    return g.emit("Unsqueeze", [x, g.new_const(list(axes), "axes")])[0]


def _layout_ok(g: "NodeGroup", idx: Sequence[int], L: Layout, r: int) -> bool:
    """Can every input of ``idx`` be brought into output layout ``L`` by broadcasting alone?"""
    out = g.output_shape(0)
    a = L.axis
    for i in idx:
        if not g.has_input(i) or (g.is_shared(i) and L.kind == "stacked"):
            continue
        s = g.input_shape(i)
        off = r - len(s)
        k = a - off  # the input's own axis that lines up with output axis a
        if g.is_shared(i):  # packed: a shared operand covering axis a with size > 1 would need tiling
            if k >= 0 and s[k] != 1:
                return False
            continue
        if L.kind == "packed" and (k < 0 or s[k] != out[a]):
            return False  # a per-model operand that broadcasts along the model axis cannot be packed
        if g.is_weight(i) and k > 0 and any(d != 1 for d in s[:k]):
            return False  # the weight's model blocks would not be contiguous
    return True


def broadcast_layout(g: "NodeGroup", idx: Sequence[int]) -> Layout:
    """Output layout for an elementwise op with numpy broadcasting over inputs ``idx``.

    Keeps the layout of the first full-rank per-model activation when every operand can follow it by plain
    broadcasting; otherwise stacked on the same axis; otherwise stacked(0), which always works.
    """
    r = g.output_rank(0)
    for i in idx:  # every operand's rank is known (else the rule gives up in one line, and the node runs per model)
        if g.has_input(i):
            g.rank(i)
    firsts = [g.layout(i) for i in idx
              if g.has_input(i) and not g.is_weight(i) and not g.is_shared(i) and g.rank(i) == r]
    candidates = ([firsts[0], stacked(firsts[0].axis)] if firsts else []) + [stacked(0)]
    return next(L for L in candidates if _layout_ok(g, idx, L, r))


def broadcast_input(g: "NodeGroup", i: int, L: Layout) -> str:
    """Fused input i, shaped so that numpy broadcasting against an output in layout ``L`` is per model.

    stacked(a): an operand covering output axis a gets the model axis there (weights: [B, ...]).
    packed(a):  an operand covering axis a is concatenated there (weights: [B*d_a, ...]).
    """
    if not g.has_input(i):
        return ""
    r = g.output_rank(0)
    s = g.input_shape(i)
    off, a = r - len(s), L.axis
    if g.is_shared(i):
        x = g.shared(i)
        if L.kind == "stacked" and off < a:  # operand reaches left of the model axis: give it a size-1 model axis
            return unsqueeze(g, x, [a - off])
        return x  # packed: _layout_ok guaranteed size 1 (or absent) at axis a
    if g.is_weight(i):
        span = r - a  # output axes a..r-1 are what the fused weight must cover
        block = [1] * max(0, span - len(s)) + list(s[max(0, len(s) - span):])
        if L.kind == "stacked":
            block = [1] + block
        return g.weight(i, WeightSlot(None, tuple(block)))
    if len(s) < r:  # lower-rank activation: make it full rank in stacked(0), then convert
        x = unsqueeze(g, g.get(i, stacked(0)), list(range(1, off + 1)))
        return g.convert(x, stacked(0), L, [1] * off + list(s))
    return g.get(i, L)


def broadcast_inputs(g: "NodeGroup", idx: Sequence[int]) -> tuple[list[str], Layout]:
    L = broadcast_layout(g, idx)
    return [broadcast_input(g, i, L) for i in idx], L


def const_list(g: "NodeGroup", i: int, what: str) -> list[int] | None:
    """Input i as a list of ints when it is a constant known now; None when the input is absent.

    Shape arithmetic over static dims is a constant by now (``resolve_static_pass`` folded it when loading), so a
    computed value here depends on the batch size or on a weight."""
    if not g.has_input(i):
        return None
    v = g.const(i)
    if v is None:
        g.fail(f"{what} (input {i}) must be a constant to be remapped for the model axis, but it is computed from "
               "the batch size or from a weight; compute it from the other dims (x.shape[1:]) or make it a constant")
    return [int(x) for x in v.reshape(-1)]


def axes_arg(g: "NodeGroup", input_index: int) -> list[int] | None:
    """The ``axes`` of a node: its attribute (older opsets) or its constant input (newer ones)."""
    if g.has_input(input_index):
        return const_list(g, input_index, "axes")
    a = g.attr("axes")
    return None if a is None else [int(x) for x in a]


def emit_with_axes(g: "NodeGroup", inputs: list[str], axes: list[int] | None, as_input: bool, layout: Layout,
                   input_index: int, **attrs) -> list[str]:
    """Emit this node's op on fused ``inputs`` with new ``axes`` as an attribute or as input ``input_index``."""
    ins = list(inputs)
    if axes is not None and as_input:
        while len(ins) <= input_index:
            ins.append("")
        ins[input_index] = g.new_const(axes, "axes")
        attrs = {k: v for k, v in attrs.items() if k != "axes"}
    elif axes is not None:
        attrs["axes"] = axes
    return g.emit_same(ins, layout, **attrs)


def model_axis_stacked(g: "NodeGroup", i: int = 0) -> Layout:
    """Input i's layout as stacked (packed(a) -> stacked(a), a free view; weights and shared -> stacked(0))."""
    L = g.layout(i)
    return stacked(0) if L is None or L.is_shared else stacked(L.axis)


def insert_model_entry(g: "NodeGroup", i: int, position: int, fill: int, pad_to: int | None = None) -> str:
    """Shape-like input i (e.g. a Reshape target, Expand shape, Tile repeats) with ``fill`` inserted at
    ``position`` for the model axis; ``pad_to`` first left-pads a constant with 1s to that length.
    A constant becomes a new constant; a run-time (shared) tensor gets Slice + Concat nodes."""
    value = g.const(i)
    if value is not None:
        v = [int(x) for x in value.reshape(-1)]
        if pad_to is not None:
            v = [1] * (pad_to - len(v)) + v
        return g.new_const(v[:position] + [fill] + v[position:], "shape")
    shape = g.input_shape(i)
    if pad_to is not None and (not shape or shape[0] != pad_to):
        g.fail(f"input {i} is computed at run time and shorter than the output rank")
    t = g.shared(i)
    model = g.new_const([fill], "model_entry")
    if position == 0:
        return g.emit("Concat", [model, t], axis=0)[0]
    lo = g.emit("Slice", [t, g.new_const([0], "start"), g.new_const([position], "end")])[0]
    hi = g.emit("Slice", [t, g.new_const([position], "start"), g.new_const([np.iinfo(np.int64).max], "end")])[0]
    return g.emit("Concat", [lo, model, hi], axis=0)[0]


def split_models(g: "NodeGroup", x: str, axis: int, size: int | None) -> list[str]:
    """A tensor packed along ``axis`` (model b's block is ``size`` wide) as B tensors, model b's block each.

    Split with explicit sizes (an input from opset 13, an attribute before): a view in torch, and its gradient is
    the Concat of the B gradients.
    """
    if not isinstance(size, int):
        g.fail(f"the per-model block of '{x}' along axis {axis} has no static size")
    sizes = [size] * g.B
    if g.opset >= 13:
        return g.emit("Split", [x, g.new_const(sizes, "split")], g.B, axis=axis)
    return g.emit("Split", [x], g.B, axis=axis, split=sizes)
