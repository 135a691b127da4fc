"""Sliding windows (convolution and pooling): output lengths, explicit pads, average-pool divisors, and the pass that
makes every window's padding explicit.

ONNX Runtime 1.19 implements some window attributes differently from the ONNX specification and from torch, which
wrote them: its CPU Conv refuses ``auto_pad`` SAME_* with dilations and its ConvGrad ignores ``auto_pad``; with
``ceil_mode`` its MaxPool and AveragePool produce one more output than the specification (and torch) where the last
window would start in the end padding, and AveragePool divides partial windows by another count. Written with
explicit pads and ``ceil_mode = 0``, every such node computes what torch computes, in every runtime.

Per spatial axis of length L, kernel k, stride s, dilation d (span e = d*(k-1) + 1), pads (pb, pe):

    floor mode   n = floor((L + pb + pe - e) / s) + 1
    ceil mode    n = ceil((L + pb + pe - e) / s) + 1, minus 1 when window n-1 would start at or after L + pb
    window o covers [o*s - pb, o*s - pb + e)
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxfuse.core._graph import Names

__all__ = ["same_pads", "output_length", "floor_mode_end_pad", "average_divisors", "explicit_windows_pass"]


def same_pads(L: int, k: int, s: int, d: int, upper: bool) -> tuple[int, int]:
    """auto_pad SAME_UPPER / SAME_LOWER as (begin, end): the total max(0, (ceil(L/s) - 1)*s + d*(k-1) + 1 - L),
    its odd element at the end (UPPER) or the beginning (LOWER)."""
    total = max(0, (-(-L // s) - 1) * s + d * (k - 1) + 1 - L)
    small, large = total // 2, total - total // 2
    return (small, large) if upper else (large, small)


def output_length(L: int, k: int, s: int, pb: int, pe: int, d: int = 1, ceil: bool = False) -> int:
    span = L + pb + pe - (d * (k - 1) + 1)
    n = (-(-span // s) if ceil else span // s) + 1
    if ceil and (n - 1) * s >= L + pb:
        n -= 1  # a window that would start in the end padding is dropped (ONNX since opset 19, torch)
    return n


def floor_mode_end_pad(L: int, k: int, s: int, pb: int, pe: int, d: int, n: int) -> int:
    """The end pad that gives ``n`` windows in floor mode (at least ``pe``)."""
    return max(pe, (n - 1) * s + d * (k - 1) + 1 - L - pb)


def average_divisors(L: int, k: int, s: int, pb: int, pe: int, n: int, count_include_pad: bool) -> np.ndarray:
    """What torch (and the ONNX specification) divide window o's sum by: the window's elements inside the padded
    axis [-pb, L + pe) when pads count, else those inside the input [0, L)."""
    start = np.arange(n) * s - pb
    if count_include_pad:
        return (np.minimum(start + k, L + pe) - start).astype(np.float64)
    return (np.minimum(start + k, L) - np.maximum(start, 0)).astype(np.float64)


def _attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _set_attrs(node: onnx.NodeProto, attrs: dict) -> None:
    del node.attribute[:]
    node.attribute.extend(helper.make_attribute(k, v) for k, v in sorted(attrs.items()))


def explicit_windows_pass(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every Conv, MaxPool and AveragePool whose input has static spatial dims gets explicit pads and
    ``ceil_mode = 0``, with the output the ONNX specification and torch define:

    - auto_pad SAME_* / VALID  -> pads (:func:`same_pads`);
    - ceil_mode 1              -> ceil_mode 0 and a larger end pad (:func:`floor_mode_end_pad`). MaxPool ignores
                                  padded elements, so that is all. AveragePool then counts only input elements
                                  (count_include_pad 0) and, where torch counts pads, its output is multiplied by
                                  the constant ratio of the two divisors (:func:`average_divisors`).

    ConvTranspose with output_padding >= stride gets output_padding 0 and, where needed, a Pad and its bias added
    after it (:func:`_output_padding_as_pads`).

    A node whose spatial dims are not static is left as it is. Returns ``model`` itself when nothing changed.

    Only the ceil_mode rewrite changes an output's shape (from ONNX's count to torch's): a value folded from that
    shape before this pass would be stale, so :func:`~onnxfuse.core.source.resolve_static_pass` runs it first."""
    if not any(_rewritable(n) for n in model.graph.node):  # the common case, without a shape inference
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    try:
        inferred = onnx.shape_inference.infer_shapes(out, strict_mode=False, data_prop=True).graph
    except Exception:
        return model
    shapes = {vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
              for vi in list(inferred.input) + list(inferred.value_info) + list(inferred.output)
              if vi.type.tensor_type.HasField("shape")}
    shapes.update({t.name: list(t.dims) for t in g.initializer})
    names = Names.of(g)
    nodes: list[onnx.NodeProto] = []
    changed: set[str] = set()  # outputs whose declared shape was the runtime's, not the specification's
    for node in g.node:
        nodes.append(node)
        if node.domain in ("", "ai.onnx") and node.op_type == "ConvTranspose":
            extra = _output_padding_as_pads(node, shapes, names, g)
            if extra is not None:
                nodes.extend(extra)
                changed.add(node.output[0])
            continue
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Conv", "MaxPool", "AveragePool"):
            continue
        y = node.output[0]  # its name before an AveragePool's divisor ratio takes it
        extra = _explicit_window(node, shapes, names, g)
        if extra is not None:
            nodes.extend(extra)
            changed.add(y)
    if not changed:
        return model
    del g.node[:]
    g.node.extend(nodes)
    _infer_changed_shapes(out, changed)
    return out


def _explicit_window(node: onnx.NodeProto, shapes: dict, names: Names, g: onnx.GraphProto
                     ) -> list[onnx.NodeProto] | None:
    """Rewrite one Conv / MaxPool / AveragePool in place to explicit pads and ``ceil_mode = 0`` (see
    :func:`explicit_windows_pass`); the nodes to add after it (AveragePool's divisor ratio), or None when it is
    left as it is (its spatial dims or kernel unknown, nothing implicit)."""
    x_shape = shapes.get(node.input[0])
    if not x_shape or len(x_shape) < 3 or not all(isinstance(d, int) and d > 0 for d in x_shape[2:]):
        return None
    attrs = _attrs(node)
    S = len(x_shape) - 2
    kernel = attrs.get("kernel_shape")
    if kernel is None and node.op_type == "Conv":
        w = shapes.get(node.input[1])
        kernel = list(w[2:]) if w and all(isinstance(d, int) for d in w[2:]) else None
    if kernel is None:
        return None
    strides = attrs.get("strides", [1] * S)
    dil = attrs.get("dilations", [1] * S)
    auto_pad, ceil = attrs.get("auto_pad", "NOTSET"), int(attrs.get("ceil_mode", 0))
    if auto_pad == "NOTSET" and not ceil:
        return None
    pads = list(attrs.get("pads", [0] * (2 * S)))
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        sp = [same_pads(x_shape[2 + a], kernel[a], strides[a], dil[a], auto_pad == "SAME_UPPER") for a in range(S)]
        pads = [p[0] for p in sp] + [p[1] for p in sp]
    elif auto_pad == "VALID":
        pads = [0] * (2 * S)
    attrs.pop("auto_pad", None)
    divisor_ratio = None
    if ceil:
        L = x_shape[2:]
        n = [output_length(L[a], kernel[a], strides[a], pads[a], pads[S + a], dil[a], True) for a in range(S)]
        new_end = [floor_mode_end_pad(L[a], kernel[a], strides[a], pads[a], pads[S + a], dil[a], n[a])
                   for a in range(S)]
        if node.op_type == "AveragePool" and int(attrs.get("count_include_pad", 0)):
            torch_div = _outer([average_divisors(L[a], kernel[a], strides[a], pads[a], pads[S + a], n[a], True)
                                for a in range(S)])
            valid = _outer([average_divisors(L[a], kernel[a], strides[a], pads[a], new_end[a], n[a], False)
                            for a in range(S)])
            attrs["count_include_pad"] = 0
            if not np.array_equal(valid, torch_div):
                divisor_ratio = (valid / torch_div).astype(np.float32)
        pads = pads[:S] + new_end
        attrs["ceil_mode"] = 0
    attrs["pads"] = pads
    _set_attrs(node, attrs)
    if divisor_ratio is None:
        return []
    # y = AveragePool(x) * ratio, under the node's original output name
    y = node.output[0]
    node.output[0] = names.fresh(f"{y}/valid_mean")
    ratio = names.fresh(f"{node.name or y}/divisor_ratio")
    g.initializer.append(numpy_helper.from_array(divisor_ratio.reshape(1, 1, *divisor_ratio.shape), ratio))
    return [helper.make_node("Mul", [node.output[0], ratio], [y], name=names.fresh(f"{node.name}/divisor"))]


def _infer_changed_shapes(out: onnx.ModelProto, changed: set[str]) -> None:
    """The exporter declared the shapes its runtime computes, downstream of every changed node too: forget them
    and infer them again from the new attributes."""
    g = out.graph
    stale = set(changed)
    for node in g.node:  # topological order: a consumer comes after its producers
        if any(i in stale for i in node.input):
            stale.update(o for o in node.output if o)
    infos = [vi for vi in g.value_info if vi.name not in stale]
    del g.value_info[:]
    g.value_info.extend(infos)
    outs = [o for o in g.output if o.name in stale]
    declared = {o.name: onnx.TypeProto.FromString(o.type.SerializeToString()) for o in outs}
    for o in outs:
        o.type.tensor_type.ClearField("shape")
    if outs:
        again = {o.name: o for o in onnx.shape_inference.infer_shapes(out, strict_mode=False).graph.output}
        for o in outs:  # as inferred now; where inference cannot say (after an If), as the file declared it
            inferred = again[o.name].type
            o.type.CopyFrom(inferred if inferred.tensor_type.HasField("shape") else declared[o.name])


def _rewritable(node: onnx.NodeProto) -> bool:
    """``node`` has an attribute :func:`explicit_windows_pass` rewrites (whether its shapes allow it or not)."""
    if node.domain not in ("", "ai.onnx"):
        return False
    attrs = _attrs(node)
    if node.op_type == "ConvTranspose":
        strides = attrs.get("strides", [1] * len(attrs.get("output_padding", [])))
        return any(o >= st for o, st in zip(attrs.get("output_padding", []), strides))
    return node.op_type in ("Conv", "MaxPool", "AveragePool") and (
        attrs.get("auto_pad", "NOTSET") != "NOTSET" or bool(int(attrs.get("ceil_mode", 0))))


def _output_padding_as_pads(node: onnx.NodeProto, shapes: dict, names: Names, g: onnx.GraphProto
                            ) -> list[onnx.NodeProto] | None:
    """ConvTranspose with output_padding op >= stride s on some axis (torch allows op < max(s, dilation); ONNX
    Runtime then reads memory it never wrote: outputs of 1e22) -> output_padding 0, the same output:

        the first min(op, pe) extra positions are cut from the end padding instead (pe -= min(op, pe)); the
        q = op - min(op, pe) others lie beyond every input's footprint, so they are 0 + bias: a Pad of q at the
        end, with the bias added after it.

    Returns the nodes that follow ``node`` (changed in place), [] when none are needed, or None when the node is
    left as it is."""
    attrs = _attrs(node)
    op = list(attrs.get("output_padding", []))
    S = len(op)
    strides = list(attrs.get("strides", [1] * S))
    if not op or all(o < st for o, st in zip(op, strides)) or "output_shape" in attrs or \
            attrs.get("auto_pad", "NOTSET") != "NOTSET":
        return None
    pads = list(attrs.get("pads", [0] * (2 * S)))
    moved = [min(o, pads[S + a]) for a, o in enumerate(op)]
    q = [o - m for o, m in zip(op, moved)]
    attrs["pads"] = pads[:S] + [pads[S + a] - moved[a] for a in range(S)]
    attrs["output_padding"] = [0] * S
    _set_attrs(node, attrs)
    if not any(q):
        return []
    y = node.output[0]
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    node.output[0] = names.fresh(f"{y}/unpadded")
    if bias:
        del node.input[2:]
    out = []
    pad_value = names.fresh(f"{node.name or y}/output_padding")
    g.initializer.append(numpy_helper.from_array(np.array([0] * (2 + S) + [0, 0] + q, np.int64), pad_value))
    padded = names.fresh(f"{y}/padded") if bias else y
    out.append(helper.make_node("Pad", [node.output[0], pad_value], [padded], name=names.fresh(f"{node.name}/pad")))
    if bias:
        shape = names.fresh(f"{node.name or y}/bias_shape")
        g.initializer.append(numpy_helper.from_array(np.array([-1] + [1] * S, np.int64), shape))
        column = names.fresh(f"{bias}/column")
        out.append(helper.make_node("Reshape", [bias, shape], [column], name=names.fresh(f"{node.name}/bias")))
        out.append(helper.make_node("Add", [padded, column], [y], name=names.fresh(f"{node.name}/add_bias")))
    return out


def _outer(per_axis: list[np.ndarray]) -> np.ndarray:
    out = per_axis[0]
    for v in per_axis[1:]:
        out = np.multiply.outer(out, v)
    return out
