"""What the legalizer knows about a tensor before running the graph: its inferred shape and dtype, its value when it
is a constant (an initializer, a Constant node, or a small deterministic node over constants), and the values of
1-D int64 "shape arithmetic" tensors whose entries may be symbolic dims (``Concat(Shape(x)[0:2], [7, 9])``).
"""
from __future__ import annotations

from typing import Union

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["Dim", "Shape", "SymDim", "GraphFacts"]

# A dim is an int when static, a str (the dim_param) when symbolic, None when unknown.
Dim = Union[int, str, None]
Shape = list  # list[Dim]
# An entry of a shape-arithmetic value: an int, or (tensor, axis) for "dim `axis` of `tensor`" when not static.
SymDim = Union[int, tuple]

# Nodes that are pure functions of their inputs: folded when every input is a constant. Random ops are not here.
_FOLDABLE = {
    "Identity", "Cast", "Concat", "Unsqueeze", "Squeeze", "Reshape", "Gather", "Slice", "Mul", "Add", "Sub", "Div",
    "Neg", "Floor", "Ceil", "Range", "ConstantOfShape", "Flatten", "Transpose", "Expand", "Tile", "Abs",
}
_MAX_FOLD_ELEMENTS = 1 << 16


class GraphFacts:
    """Shapes, dtypes, producers, consumers and constant values of the tensors of one graph (read-only)."""

    def __init__(self, model: onnx.ModelProto, opset: int):
        self.opset = opset
        g = model.graph
        try:
            inferred = onnx.shape_inference.infer_shapes(model, data_prop=True).graph
        except Exception:  # an invalid or unusual model: fall back to what the graph declares
            inferred = g
        self.shapes: dict[str, Shape | None] = {}
        self.dtypes: dict[str, int] = {}
        for vi in list(inferred.input) + list(inferred.value_info) + list(inferred.output):
            t = vi.type.tensor_type
            if t.elem_type:
                self.dtypes[vi.name] = t.elem_type
            if t.HasField("shape"):
                self.shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                        for d in t.shape.dim]
        self.initializers = {t.name: t for t in g.initializer}
        for t in g.initializer:
            self.shapes[t.name] = list(t.dims)
            self.dtypes[t.name] = t.data_type
        self.producer = {o: n for n in g.node for o in n.output if o}
        self.consumers: dict[str, int] = {}
        for n in g.node:
            for name in list(n.input) + _subgraph_inputs(n):
                if name:
                    self.consumers[name] = self.consumers.get(name, 0) + 1
        self.graph_outputs = {o.name for o in g.output}
        self._constants: dict[str, np.ndarray | None] = {}

    # -- shapes -----------------------------------------------------------------------------------------------------
    def shape(self, name: str) -> Shape | None:
        return self.shapes.get(name)

    def dtype(self, name: str) -> int:
        return self.dtypes.get(name, onnx.TensorProto.FLOAT)

    def is_used(self, name: str) -> bool:
        return bool(name) and (name in self.graph_outputs or self.consumers.get(name, 0) > 0)

    # -- constants --------------------------------------------------------------------------------------------------
    def constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` when it is an initializer, a Constant node, the Shape of a static tensor or a
        foldable node over those; otherwise None. Initializers include parameters: rewrites read this only for
        attribute-like inputs (axes, scales, split sizes), never to bake in a weight."""
        if not name:
            return None
        if name not in self._constants:
            self._constants[name] = None  # guards against cycles
            self._constants[name] = self._compute_constant(name)
        return self._constants[name]

    def _compute_constant(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "Constant":
            return _constant_node_value(node)
        if node.op_type == "Shape":
            shape = self.shape(node.input[0])
            if shape is None or not all(isinstance(d, int) for d in shape):
                return None
            start, end = _shape_range(node, len(shape))
            return np.array(shape[start:end], np.int64)
        if node.op_type not in _FOLDABLE:
            return None
        values = [self.constant(i) if i else None for i in node.input]
        if any(v is None for v, i in zip(values, node.input) if i):
            return None
        if any(v.size > _MAX_FOLD_ELEMENTS for v in values if v is not None):
            return None
        from onnx.reference import ReferenceEvaluator

        try:
            evaluator = ReferenceEvaluator(node, opsets={"": self.opset})
            feeds = {i: v for i, v in zip(node.input, values) if i}
            outputs = evaluator.run(None, feeds)
        except Exception:
            return None
        return np.asarray(outputs[list(node.output).index(name)])

    # -- shape arithmetic -------------------------------------------------------------------------------------------
    def int_values(self, name: str) -> list[SymDim] | None:
        """Entries of a small 1-D (or scalar) integer tensor: ints, or (tensor, axis) for a symbolic input dim.

        Follows Shape, Slice, Gather, Concat, Cast, Identity, Squeeze and Unsqueeze over constants; None otherwise.
        """
        value = self.constant(name)
        if value is not None:
            if value.dtype.kind not in "iu" or value.ndim > 1:
                return None
            return [int(v) for v in value.reshape(-1)]
        node = self.producer.get(name)
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        op = node.op_type
        if op == "Shape":
            shape = self.shape(node.input[0])
            if shape is None:
                return None
            start, end = _shape_range(node, len(shape))
            return [d if isinstance(d, int) else (node.input[0], k) for k, d in enumerate(shape)][start:end]
        if op in ("Cast", "Identity", "Squeeze", "Unsqueeze"):
            return self.int_values(node.input[0])
        if op == "Concat":
            parts = [self.int_values(i) for i in node.input]
            return None if any(p is None for p in parts) else [e for p in parts for e in p]
        if op == "Gather":
            data, idx = self.int_values(node.input[0]), self.constant(node.input[1])
            if data is None or idx is None:
                return None
            return [data[int(i)] for i in idx.reshape(-1)]
        if op == "Slice":
            data = self.int_values(node.input[0])
            args = [self.constant(i) if i else None for i in list(node.input[1:]) + [""] * (5 - len(node.input))]
            starts, ends, _, steps = args[0], args[1], args[2], args[3]
            if data is None or starts is None or ends is None:
                return None
            step = int(steps[0]) if steps is not None else 1
            n = len(data)
            clamp = lambda v: max(min(int(v), n), -n - 1)  # noqa: E731  (python slicing clamps the same way)
            return data[clamp(starts[0]):clamp(ends[0]):step]
        return None


def _subgraph_inputs(node: onnx.NodeProto) -> list[str]:
    """Names read by the subgraphs (If/Loop/Scan bodies) of ``node``, so that they count as used."""
    names: list[str] = []
    for a in node.attribute:
        graphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
        for sub in graphs:
            for n in sub.node:
                names.extend(n.input)
                names.extend(_subgraph_inputs(n))
    return names


def _shape_range(node: onnx.NodeProto, rank: int) -> tuple[int, int]:
    attrs = {a.name: a.i for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    start = max(0, min(rank, start + rank if start < 0 else start))
    end = max(0, min(rank, end + rank if end < 0 else end))
    return start, end


def _constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name == "value_float":
            return np.array(a.f, np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), np.float32)
        if a.name == "value_int":
            return np.array(a.i, np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), np.int64)
    return None
