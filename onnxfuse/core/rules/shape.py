"""Shape ops: Shape/Size report the original (per-model) shape; Reshape/Flatten keep the model axis outside."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from onnx import numpy_helper

from onnxfuse.core.layout import SHARED, packed, stacked
from onnxfuse.core.weights import WeightSlot
from onnxfuse.core.rules._common import (axes_arg, emit_with_axes, insert_model_entry, model_axis_stacked, norm_axis,
                                         unsqueeze)
from onnxfuse.core.rules._registry import rule

if TYPE_CHECKING:
    from onnxfuse.core.engine import NodeGroup



def _same_dim(a, b) -> bool:
    known = lambda d: isinstance(d, int) or (isinstance(d, str) and not d.startswith("unk__"))  # noqa: E731
    return known(a) and a == b


def _own_layout(g: "NodeGroup"):
    L = g.layout(0)
    return stacked(0) if L is None else L


@rule("Shape")
def fuse_shape(g: "NodeGroup") -> None:
    """Shape of model b's tensor, the same for every model (output shared).

    Static shapes become a constant. Otherwise Shape of the fused tensor, minus the model axis (stacked(a):
    Gather the other axes) or with axis a divided by B (packed(a)).
    """
    shape = g.input_shape(0)
    if shape is None:
        g.fail("the rank of the input is unknown")
    r = len(shape)
    start = norm_axis(int(g.attr("start", 0)), r)
    end = norm_axis(int(g.attr("end", r)), r) if g.attr("end") is not None else r
    dims = list(range(max(0, start), min(r, end)))
    if all(isinstance(shape[d], int) for d in dims):
        value = np.array([shape[d] for d in dims], dtype=np.int64)
        out = g.emit("Constant", [], [g.out_name(0)], value=numpy_helper.from_array(value))[0]
        g.set_output(0, out, SHARED, value=value)
        return
    L = _own_layout(g)
    full = g.emit("Shape", [g.get(0, L)])[0]
    last = L.kind != "packed" or L.axis not in dims
    out = g.emit("Gather", [full, g.new_const([L.fused_axis(d) for d in dims], "axes")],
                 [g.out_name(0)] if last else 1, axis=0)[0]
    if not last:
        div = g.new_const([g.B if d == L.axis else 1 for d in dims], "model_divisor")
        out = g.emit("Div", [out, div], [g.out_name(0)])[0]
    g.set_output(0, out, SHARED)


@rule("Size")
def fuse_size(g: "NodeGroup") -> None:
    """Element count of model b's tensor = Size(fused) / B (shared)."""
    L = _own_layout(g)
    n = g.emit("Size", [g.get(0, L)])[0]
    g.set_output(0, g.emit("Div", [n, g.new_const(g.B, "B")], [g.out_name(0)])[0], SHARED)


@rule("Reshape")
def fuse_reshape(g: "NodeGroup") -> None:
    """Reshape every model's tensor to the (shared) target shape t.

    Layout: stacked(a) input whose first a dims the reshape leaves alone (e.g. the batch dim of
    x.view(x.size(0), -1)) -> target t[:a] + [B] + t[a:], output stacked(a); otherwise stacked(0) with target
    [B] + t. A 0 in t keeps meaning "copy this input dim": with the model axis inserted at a, original dim i >= a
    sits at fused index i + 1 on both sides. packed(a) inputs are viewed as stacked(a) first (free).
    allowzero=1 (torch's dynamo exporter writes it on every Reshape) makes a 0 in t a literal 0: the fused node
    keeps it, and the inserted B is no 0; with no 0 in a known target it means what allowzero=0 does and is dropped.
    """
    allowzero = int(g.attr("allowzero", 0))
    g.shared(1)  # the target must be the same for every model
    L = _own_layout(g)
    in_s, out_s = g.input_shape(0), g.output_shape(0)
    a = L.axis
    keep = (a > 0 and in_s is not None and out_s is not None and len(out_s) >= a
            and all(_same_dim(in_s[k], out_s[k]) for k in range(a)))
    a = a if keep else 0
    x = g.get(0, stacked(a))
    if (g.const(1) is None and out_s is not None and sum(not isinstance(d, int) for d in out_s) <= 1
            and 0 not in out_s):
        # a target computed from the batch size (x.flatten(2) is Reshape(x, Concat(Shape(x)[:2], [-1])) whose
        # output is static but for one dim: a constant target with -1 there, so that the fused graph's shapes stay
        # known to shape inference (some gradient kernels and the legalization need them). An empty output dim
        # would be a 0 in that target, whose meaning depends on allowzero: the original target is kept then.
        target = [d if isinstance(d, int) else -1 for d in out_s]
        new_target = g.new_const(target[:a] + [g.B] + target[a:], "shape")
    else:
        target = g.const(1)
        new_target = insert_model_entry(g, 1, a, g.B)
    # allowzero=1 is kept where the target may hold a 0 (a literal 0 then): a computed target, or a 0 in a known one
    literal_zero = allowzero and (target is None or 0 in [int(d) for d in np.reshape(target, -1)])
    out = g.emit("Reshape", [x, new_target], [g.out_name(0)], **({"allowzero": 1} if literal_zero else {}))[0]
    g.set_output(0, out, stacked(a))


@rule("Flatten")
def fuse_flatten(g: "NodeGroup") -> None:
    """Flatten at axis k: [d0..] -> [prod(d<k), prod(d>=k)].

    Layout: packed(k) or stacked(k) input -> Flatten(k) gives [prod(d<k), B*prod(d>=k)] = packed(1) (the model is
    the outermost of the flattened dims); stacked(0)/packed(0) (k >= 1) -> [B*prod(d<k), ...] = packed(0);
    anything else is made stacked(0) first.
    """
    r = g.rank(0)
    k = norm_axis(int(g.attr("axis", 1)), r)
    L = _own_layout(g)
    if L.axis == k and k > 0:
        g.emit_same([g.get(0, L)], packed(1), axis=k)
    elif L.axis == 0 and k >= 1:
        g.emit_same([g.get(0, L)], packed(0), axis=k + (1 if L.kind == "stacked" else 0))
    else:
        g.emit_same([g.get(0, stacked(0))], packed(0), axis=k + 1)


@rule("Transpose")
def fuse_transpose(g: "NodeGroup") -> None:
    """Permute every model's axes with the original perm p; the model axis rides along.

    Layout: stacked(a) in (packed(a) is viewed as stacked(a), free) -> stacked(a') out, where the model axis
    follows the output position of original axis a-1 (a' = 0 when a = 0). Fused perm: original axis j sits at
    fused index j + (j >= a), and the model axis (fused index a) is inserted at position a'.
    A weight read only here is packed already transposed ([B, *W.T]): no Transpose runs at all.
    """
    r = g.rank(0)
    perm = [norm_axis(int(p), r) for p in (g.attr("perm") or list(range(r))[::-1])]
    if g.sole_use_of_weight(0):  # W.t() of a Linear on 3-D input: transpose once, while packing, not every step
        shape = g.input_shape(0)
        w = g.weight(0, WeightSlot(tuple(perm), (1, *[shape[p] for p in perm])))
        g.set_output(0, w, stacked(0))
        return
    L = _own_layout(g)
    a = L.axis
    a_out = 0 if a == 0 else perm.index(a - 1) + 1
    fused_perm = [p + (1 if p >= a else 0) for p in perm]
    fused_perm.insert(a_out, a)
    g.emit_same([g.get(0, stacked(a))], stacked(a_out), perm=fused_perm)


@rule("Squeeze")
def fuse_squeeze(g: "NodeGroup") -> None:
    """Remove size-1 original axes; the model axis stays, shifted left by the removed axes before it.

    Layout: stacked(a) -> stacked(a - #{removed axes < a}); fused axes j + (j >= a). Without ``axes`` every
    size-1 original axis is removed (needs static sizes, since the fused tensor may have B = 1 too).
    """
    r = g.rank(0)
    axes = axes_arg(g, 1)
    if axes is None:
        shape = g.input_shape(0)
        if any(not isinstance(d, int) for d in shape):
            g.fail("Squeeze without axes needs static input sizes")
        axes = [k for k, d in enumerate(shape) if d == 1]
    axes = sorted(norm_axis(k, r) for k in axes)
    L = model_axis_stacked(g)
    out = stacked(L.axis - sum(k < L.axis for k in axes))
    emit_with_axes(g, [g.get(0, L)], [L.fused_axis(k) for k in axes], g.opset >= 13, out, 1)


@rule("Unsqueeze")
def fuse_unsqueeze(g: "NodeGroup") -> None:
    """Insert size-1 axes at original output positions ``axes``; the model axis rides along.

    Layout: stacked(a) -> stacked(a') with a' = 0 when a = 0, else just after the output position of input axis
    a-1; fused axes q + (q >= a') for every inserted output position q.
    """
    r_out = g.output_rank(0)
    axes = sorted(norm_axis(k, r_out) for k in axes_arg(g, 1))
    L = model_axis_stacked(g)
    kept = [q for q in range(r_out) if q not in axes]  # output position of each input axis
    a_out = 0 if L.axis == 0 else kept[L.axis - 1] + 1
    emit_with_axes(g, [g.get(0, L)], [q + (1 if q >= a_out else 0) for q in axes], g.opset >= 13, stacked(a_out), 1)


@rule("Expand")
def fuse_expand(g: "NodeGroup") -> None:
    """Broadcast every model's tensor to the (shared) target shape t.

    Layout: an input of the output's rank in stacked(a) keeps it, target t with B inserted at a; otherwise the
    input is made stacked(0) at the output's rank (original size-1 axes prepended) and the target is [B] + t.
    """
    r_in, r_out = g.rank(0), g.output_rank(0)
    L = model_axis_stacked(g)
    a = L.axis if r_in == r_out else 0
    x = g.get(0, stacked(a))
    if r_in < r_out:
        x = unsqueeze(g, x, list(range(1, 1 + r_out - r_in)))
    new_target = insert_model_entry(g, 1, a, g.B, pad_to=r_out)
    g.set_output(0, g.emit("Expand", [x, new_target], [g.out_name(0)])[0], stacked(a))


@rule("Tile")
def fuse_tile(g: "NodeGroup") -> None:
    """Repeat every model's tensor: repeats with a 1 inserted for the model axis (stacked(a) in and out)."""
    L = model_axis_stacked(g)
    g.emit_same([g.get(0, L), insert_model_entry(g, 1, L.axis, 1)], L)
