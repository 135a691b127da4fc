"""Forms of the fused graph that torch runs better as one op: rewrites of node chains, applied by ``OnnxModule``
when it builds its programs. The ONNX graph itself (what ONNX Runtime trains, what a folder saves) is unchanged.

Each rule is one small function ``rule(nodes, at, graph) -> (the nodes it replaces, the new node) | None`` over
the node list in graph order; it matches only where every intermediate tensor has a single reader and is not
wanted as an output, so the rewrite computes the same values (up to rounding: one kernel instead of several).

    gelu_erf       x * 0.5 * (1 + erf(x / sqrt(2)))  ->  Gelu(x)        (torch's export of nn.GELU before opset 20)
    fake_quantize  DequantizeLinear(QuantizeLinear(x, s, z), s, z)  ->  FakeQuantize(x, s, z)
                   (quantization-aware training's export: torch's fake-quant, its straight-through gradient)

Gelu is what the source module computed (``F.gelu``): the fused model is then closer to each model trained alone,
and its forward and backward are one kernel each instead of five and about ten (measured on the zoo's Transformer
LM, B = 16: erf, exp, pow, neg and their products were a sixth of the eager step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["torch_forms", "RULES"]


@dataclass
class _Graph:
    """What a rule reads: the producer and readers of each tensor, the scalar constants, the names to keep."""

    producer: dict[str, onnx.NodeProto]
    readers: dict[str, int]
    scalars: dict[str, float]
    keep: set[str]
    dtypes: dict[str, int]  # the element type of each initializer

    def only_reader(self, name: str) -> bool:
        return self.readers.get(name, 0) == 1 and name not in self.keep

    def is_const(self, name: str, value: float, tol: float = 1e-6) -> bool:
        v = self.scalars.get(name)
        return v is not None and abs(v - value) <= tol * max(1.0, abs(value))


def _scalars(graph: onnx.GraphProto) -> dict[str, float]:
    out = {}
    for t in graph.initializer:
        if int(np.prod(t.dims)) == 1:
            out[t.name] = float(numpy_helper.to_array(t).reshape(-1)[0])
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            a = numpy_helper.to_array(n.attribute[0].t)
            if a.size == 1 and a.dtype.kind == "f":
                out[n.output[0]] = float(a.reshape(-1)[0])
    return out


def _other(node: onnx.NodeProto, name: str) -> str | None:
    """The other input of a two-input node that reads ``name``."""
    if len(node.input) != 2 or name not in node.input:
        return None
    return node.input[1] if node.input[0] == name else node.input[0]


def _single_reader(g: _Graph, nodes_by_input: dict[str, list[onnx.NodeProto]], name: str, op: str
                   ) -> onnx.NodeProto | None:
    found = nodes_by_input.get(name, [])
    return found[0] if len(found) == 1 and found[0].op_type == op and g.only_reader(name) else None


def gelu_erf(erf: onnx.NodeProto, g: _Graph, by_input: dict[str, list[onnx.NodeProto]]
             ) -> tuple[list[onnx.NodeProto], onnx.NodeProto] | None:
    """``Div(x, sqrt 2) -> Erf -> Add(1) -> Mul(x) -> Mul(0.5)`` (or ``Mul(x, 0.5)`` first) as ``Gelu(x)``."""
    if erf.op_type != "Erf":
        return None
    div = g.producer.get(erf.input[0])
    if div is None or div.op_type != "Div" or not g.only_reader(erf.input[0]) or not g.is_const(div.input[1],
                                                                                                 math.sqrt(2.0)):
        return None
    x = div.input[0]
    add = _single_reader(g, by_input, erf.output[0], "Add")
    if add is None or not g.is_const(_other(add, erf.output[0]) or "", 1.0):
        return None
    first = _single_reader(g, by_input, add.output[0], "Mul")
    if first is None:
        return None
    partner = _other(first, add.output[0])
    if partner == x:  # (x * (1 + erf)) * 0.5
        last = _single_reader(g, by_input, first.output[0], "Mul")
        if last is None or not g.is_const(_other(last, first.output[0]) or "", 0.5):
            return None
        chain = [div, erf, add, first, last]
    else:  # (x * 0.5) * (1 + erf)
        half = g.producer.get(partner or "")
        if half is None or half.op_type != "Mul" or not g.only_reader(partner) or _other(half, x) is None \
                or not g.is_const(_other(half, x), 0.5):
            return None
        last, chain = first, [div, erf, add, half, first]
    return chain, helper.make_node("Gelu", [x], [last.output[0]], name=f"{last.name or last.output[0]}/gelu")


def fake_quantize(dq: onnx.NodeProto, g: _Graph, by_input: dict[str, list[onnx.NodeProto]]
                  ) -> tuple[list[onnx.NodeProto], onnx.NodeProto] | None:
    """``QuantizeLinear(x, s, z) -> DequantizeLinear(., s, z)`` with the same scale, zero point and axis as one
    ``onnxfuse.torch::FakeQuantize(x, s, z)`` (``qtype``: the quantized element type, from the zero point's
    initializer, uint8 without one). The pair's integer output stops autograd; torch's fake-quant passes the
    gradient straight through where nothing was clamped, as the model's own QAT training does."""
    if dq.op_type != "DequantizeLinear" or not dq.input:
        return None
    q = g.producer.get(dq.input[0])
    if q is None or q.op_type != "QuantizeLinear" or not g.only_reader(dq.input[0]) or \
            list(q.input[1:]) != list(dq.input[1:]) or _attrs(q) != _attrs(dq) or \
            any(a.name in ("block_size", "output_dtype", "saturate") and a.i for a in q.attribute):
        return None
    zero_point = q.input[2] if len(q.input) > 2 and q.input[2] else None
    qtype = g.dtypes.get(zero_point, onnx.TensorProto.UINT8) if zero_point else onnx.TensorProto.UINT8
    axis = _attrs(q).get("axis", 1)
    return [q, dq], helper.make_node("FakeQuantize", list(q.input), [dq.output[0]], domain="onnxfuse.torch",
                                     name=f"{dq.name or dq.output[0]}/fake_quantize", axis=axis, qtype=qtype)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


RULES: Sequence[Callable] = (gelu_erf, fake_quantize)


def torch_forms(graph: onnx.GraphProto, keep: Sequence[str]) -> list[onnx.NodeProto]:
    """The graph's nodes with every rule applied (in graph order: a replacement stands where the last node of its
    chain stood, so the order stays topological). ``keep``: tensors that must stay (the outputs read)."""
    nodes = list(graph.node)
    producer = {o: n for n in nodes for o in n.output if o}
    readers: dict[str, int] = {}
    by_input: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            if i:
                readers[i] = readers.get(i, 0) + 1
                by_input.setdefault(i, []).append(n)
    g = _Graph(producer, readers, _scalars(graph), set(keep) | {o.name for o in graph.output},
               {t.name: t.data_type for t in graph.initializer})
    replaced: dict[int, onnx.NodeProto | None] = {}
    for n in nodes:
        for rule in RULES:
            found = rule(n, g, by_input)
            if found is None or any(id(c) in replaced for c in found[0]):
                continue
            chain, new = found
            for c in chain:
                replaced[id(c)] = None
            replaced[id(chain[-1])] = new
            break
    return [replaced.get(id(n), n) for n in nodes if replaced.get(id(n), n) is not None]
