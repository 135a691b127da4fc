"""A small helper to append nodes and constants to a graph with unique names (training-side graph surgery)."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["GraphBuilder"]


class GraphBuilder:
    def __init__(self, graph: onnx.GraphProto, opset: int, prefix: str):
        self.graph, self.opset, self.prefix = graph, opset, prefix
        self._ids = itertools.count()
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def name(self, hint: str) -> str:
        return f"{self.prefix}{hint}__{next(self._ids)}"

    def node(self, op: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", **attrs) -> list[str]:
        outs = [self.name(op.lower()) for _ in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(helper.make_node(op, inputs, outs, name=self.name(op), domain=domain, **attrs))
        return outs

    def one(self, op: str, inputs: list[str], output: str | None = None, domain: str = "", **attrs) -> str:
        return self.node(op, inputs, [output] if output else 1, domain=domain, **attrs)[0]

    def const(self, value, dtype=np.float32, hint: str = "const") -> str:
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def reduce(self, op: str, x: str, axes: list[int] | None, keepdims: int = 0, output: str | None = None) -> str:
        """ReduceMean/ReduceSum/...: axes moved from an attribute to an input in opset 18 (ReduceSum: 13)."""
        as_input = self.opset >= (13 if op == "ReduceSum" else 18)
        if axes is None:
            return self.one(op, [x], output, keepdims=keepdims)
        if as_input:
            return self.one(op, [x, self.const(axes, np.int64, "axes")], output, keepdims=keepdims)
        return self.one(op, [x], output, axes=axes, keepdims=keepdims)

    def flush(self) -> None:
        """Append the collected nodes and initializers to the graph."""
        self.graph.node.extend(self.nodes)
        self.graph.initializer.extend(self.inits)
        self.nodes, self.inits = [], []
