"""The graph layer's emitter bound to one graph, for the training side's graph surgery (loss, BatchNorm statistics,
optimizer update): constants default to float32 and ``flush()`` appends to that graph."""
from __future__ import annotations

import numpy as np
import onnx

from onnxfuse.core._graph import Emitter, Names

__all__ = ["GraphBuilder"]


class GraphBuilder(Emitter):
    def __init__(self, graph: onnx.GraphProto, opset: int, prefix: str):
        super().__init__(Names.of(graph), opset, prefix)
        self.graph = graph

    def name(self, hint: str) -> str:
        """A fresh tensor name."""
        return self.names.fresh(f"{self.prefix}{hint}")

    def const(self, value, dtype=np.float32, hint: str = "const") -> str:
        return super().const(value, dtype, hint)

    def flush(self) -> None:
        """Append the collected nodes and initializers to the graph."""
        super().flush(self.graph)
