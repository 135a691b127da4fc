"""Output shapes ONNX's shape inference leaves out (onnx 1.17 infers no shape for a GroupNormalization, whose
schema is a function without an inference rule, nor for CenterCropPad), so that every tensor after such a node
keeps a known rank and the fusion rules can lay it out. Each rule reads the shapes inference did give. And a
rewrite for a shape it gets wrong (``onesided_stft_pass``)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["complete_shapes", "onesided_stft_pass"]

Shape = list  # dims: ints, or strings for symbolic ones, None for unknown


def _same_as_input(node: onnx.NodeProto, shapes: dict[str, Shape], consts: dict) -> Shape | None:
    return shapes.get(node.input[0])


def _center_crop_pad(node: onnx.NodeProto, shapes: dict[str, Shape], consts: dict) -> Shape | None:
    x, target = shapes.get(node.input[0]), consts.get(node.input[1])
    if x is None or target is None:
        return None
    axes = next((list(helper.get_attribute_value(a)) for a in node.attribute if a.name == "axes"),
                list(range(len(x))))
    out = list(x)
    for a, n in zip(axes, target.reshape(-1).tolist()):
        out[a % len(x)] = int(n)
    return out


RULES: dict[str, Callable] = {"GroupNormalization": _same_as_input, "CenterCropPad": _center_crop_pad}



def complete_shapes(inferred: onnx.ModelProto, infer: Callable[[onnx.ModelProto], onnx.ModelProto]
                    ) -> onnx.ModelProto:
    """``inferred`` (a model after ``infer``) with the outputs of the nodes :data:`RULES` covers declared where
    inference left them unknown, inferred again from those so that their readers' shapes follow, until nothing
    changes; unchanged when nothing was missing."""
    if not any(n.op_type in RULES and not n.domain for n in inferred.graph.node):
        return inferred
    fixed: dict[str, onnx.ValueInfoProto] = {}
    for _ in range(len(inferred.graph.node)):
        added = _missing(inferred.graph, fixed)
        if not added:
            return inferred
        fixed.update(added)
        again = onnx.ModelProto()
        again.CopyFrom(inferred)
        del again.graph.value_info[:]  # inferred anew from the filled-in shapes
        again.graph.value_info.extend(vi for name, vi in fixed.items() if not any(o.name == name
                                                                                  for o in again.graph.output))
        inferred = infer(again)
    return inferred


def _missing(g: onnx.GraphProto, fixed: dict) -> dict[str, onnx.ValueInfoProto]:
    """The value infos :data:`RULES` gives that ``g`` lacks (not yet in ``fixed``)."""
    known = {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)

    def shape_of(name: str) -> Shape | None:
        vi = known.get(name)
        if vi is None or not vi.type.tensor_type.HasField("shape"):
            return None
        return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in vi.type.tensor_type.shape.dim]

    out = {}
    for n in g.node:
        rule = RULES.get(n.op_type) if not n.domain else None
        if rule is None or n.output[0] in fixed or shape_of(n.output[0]) is not None:
            continue
        shape = rule(n, {i: shape_of(i) for i in n.input if i}, consts)
        source = known.get(n.input[0])
        if shape is None or source is None or shape == shape_of(n.output[0]):
            continue
        out[n.output[0]] = helper.make_tensor_value_info(n.output[0], source.type.tensor_type.elem_type, shape)
    return out


def onesided_stft_pass(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every ``STFT(onesided=1)`` as ``STFT(onesided=0)`` then a Slice of its first frame_length // 2 + 1 bins: the
    same values (a real signal's spectrum is conjugate-symmetric; onesided keeps its first half), and a graph whose
    shapes onnx infers right (onnx 1.17 infers frame_length bins for a onesided STFT, where runtimes compute
    frame_length // 2 + 1; conversions sized from that would fail at run time). In place; returns the model."""
    g = model.graph
    nodes = list(g.node)
    if not any(n.op_type == "STFT" and not n.domain for n in nodes):
        return model
    del g.node[:]
    for n in nodes:
        onesided = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "onesided"), 1)
        if n.op_type != "STFT" or n.domain or not onesided:
            g.node.append(n)
            continue
        full, out = f"{n.output[0]}__twosided", n.output[0]
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute if a.name != "onesided"}
        g.node.append(helper.make_node("STFT", list(n.input), [full], name=n.name, onesided=0, **attrs))
        # bins = frame_length // 2 + 1, frame_length: input 3, or the window's length
        length = n.input[3] if len(n.input) > 3 and n.input[3] else None
        p = f"{out}__onesided"
        if length is None:
            g.node.append(helper.make_node("Shape", [n.input[2]], [f"{p}_len"], start=0, end=1))
            length = f"{p}_len"
        g.node.extend([
            helper.make_node("Reshape", [length, f"{p}_one"], [f"{p}_n"]),
            helper.make_node("Div", [f"{p}_n", f"{p}_two"], [f"{p}_half"]),
            helper.make_node("Add", [f"{p}_half", f"{p}_one"], [f"{p}_bins"]),
            helper.make_node("Slice", [full, f"{p}_zero", f"{p}_bins", f"{p}_axis"], [out], name=f"{n.name}/onesided"),
        ])
        g.initializer.extend([numpy_helper.from_array(np.array(v, np.int64).reshape(1), f"{p}_{k}")
                              for k, v in (("one", 1), ("two", 2), ("zero", 0), ("axis", 2))])
    return model
