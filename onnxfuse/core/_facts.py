"""What is known about a graph's tensors before it runs: inferred shapes and dtypes, the value of every tensor that
is a constant (an initializer, a Constant node, the Shape of static dims, or a deterministic node over constants),
and the entries of 1-D integer "shape arithmetic" tensors, which may name symbolic dims
(``Concat(Shape(x)[0:2], [7, 9])`` with x ``[N, 5, ...]`` -> ``[("x", 0), 5, 7, 9]``).

The core reads these facts to resolve what is static at fuse time (:func:`onnxfuse.core.source.resolve_static_pass`), the
legalizer to read constant axes, scales and sizes. Initializers named ``variable`` (per-model weights) are inputs,
not facts: their shapes are known, their values are not.
"""
from __future__ import annotations

from collections import Counter
from typing import Collection, Union

import numpy as np
import onnx
from onnx import numpy_helper

from onnxfuse.core._graph import reads

__all__ = ["Dim", "Shape", "SymDim", "GraphFacts", "FOLD_LIMIT"]

# A dim is an int when static, a str (the dim_param) when symbolic, None when unknown.
Dim = Union[int, str, None]
Shape = list  # list[Dim]
# An entry of a shape-arithmetic value: an int, or (tensor, axis) for "dim `axis` of `tensor`" when not static.
SymDim = Union[int, tuple]

# Deterministic ops folded when every input is a constant. Each is exact in IEEE arithmetic (integer ops, data
# movement, comparisons, + - * / sqrt, which are correctly rounded), so a folded value is bit for bit what ONNX
# Runtime would compute. Transcendental ops (Sin, Exp, Pow ...) and random ops are not here.
_FOLDABLE = {
    "Identity", "Cast", "CastLike", "Concat", "Unsqueeze", "Squeeze", "Reshape", "Gather", "GatherElements", "Slice",
    "Split", "Flatten", "Transpose", "Expand", "Tile", "ConstantOfShape", "Range", "Where", "Mul", "Add", "Sub",
    "Div", "Mod", "Neg", "Abs", "Sign", "Floor", "Ceil", "Sqrt", "Max", "Min", "Clip", "Equal", "Less",
    "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "ReduceProd", "ReduceSum", "ReduceMax",
    "ReduceMin", "Trilu", "ScatterND", "ScatterElements",
}
# A float sum depends on its order, and ONNX Runtime's Range accumulates start + delta + ... where numpy multiplies:
# these fold only over integer values (integer-valued floats below 2**24 are exact either way).
_INTEGER_ONLY = {"ReduceProd", "ReduceSum", "Range"}
# Largest tensor (elements) read or produced by a fold: shape arithmetic, index tables, small masks.
FOLD_LIMIT = 1 << 16


class GraphFacts:
    """Shapes, dtypes, producers, consumers and constant values of the tensors of one graph (read-only).

    ``variable``: initializers whose values are not facts (per-model weights: a value folded from one model's
    weight would be wrong for the others).
    """

    def __init__(self, model: onnx.ModelProto, opset: int, variable: Collection[str] = ()):
        self.opset = opset
        self.variable = frozenset(variable)
        g = model.graph
        self.inference_error: str | None = None
        try:
            inferred = onnx.shape_inference.infer_shapes(model, data_prop=True).graph
        except Exception as e:  # an invalid or unusual model: fall back to what the graph declares
            self.inference_error = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
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
            for name in reads(n):
                if name:
                    self.consumers[name] = self.consumers.get(name, 0) + 1
        self.graph_outputs = {o.name for o in g.output}
        # the graph inputs' symbolic dims (the batch N): one unknown each, the same wherever it occurs
        self.input_symbols = {d for vi in g.input if vi.name not in self.initializers
                              for d in (self.shapes.get(vi.name) or []) if isinstance(d, str)}
        self._constants: dict[str, np.ndarray | None] = {}
        self._int_values: dict[str, list[SymDim] | None] = {}

    # -- shapes -----------------------------------------------------------------------------------------------------
    def shape(self, name: str) -> Shape | None:
        return self.shapes.get(name)

    def reshape_shape(self, node: onnx.NodeProto) -> Shape | None:
        """The output shape of Reshape ``node`` from its shape-arithmetic target, where ONNX's inference gives up:
        a -1 next to a symbolic dim (``x.view(x.size(0), T, -1)`` with x ``[N, T, H, d]`` is ``[N, T, H*d]``).

        Entries: an int, a 0 (copy the input dim), or a dim of another tensor; the -1 is the input's element count
        over the others', the graph inputs' symbols (N) cancelling. Symbols other than those are unknown (None).
        """
        x, target = self.shape(node.input[0]), self.int_values(node.input[1])
        if x is None or target is None or any(a.name == "allowzero" and a.i for a in node.attribute):
            return None
        out: Shape = []
        for k, e in enumerate(target):
            if isinstance(e, tuple):
                src = self.shape(e[0])
                d = src[e[1]] if src is not None and e[1] < len(src) else None
            elif e == 0:
                d = x[k] if k < len(x) else None
            else:
                d = e
            out.append(d if isinstance(d, int) or d in self.input_symbols else None)
        if out.count(-1) == 1:
            known = [d for d in out if d != -1]
            if None in known or any(d is None or (isinstance(d, str) and d not in self.input_symbols) for d in x):
                out[out.index(-1)] = None
            else:
                num, den = _product(x), _product(known)
                left = num[1] - den[1]  # symbols of the input not matched by a target entry
                ok = not (den[1] - num[1]) and not left and den[0] > 0 and num[0] % den[0] == 0
                out[out.index(-1)] = num[0] // den[0] if ok else None
        return None if -1 in out else out

    def dtype(self, name: str) -> int:
        return self.dtypes.get(name, onnx.TensorProto.FLOAT)

    def is_used(self, name: str) -> bool:
        return bool(name) and (name in self.graph_outputs or self.consumers.get(name, 0) > 0)

    # -- constants --------------------------------------------------------------------------------------------------
    def constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` when it follows from constants and static dims alone: an initializer that is not
        ``variable``, a Constant node, Shape/Size of static dims, a node of ``_FOLDABLE`` over constants, or a small
        integer tensor whose every entry resolves to a static dim (``Gather(Shape(x), 2)`` with x ``[N, 5, 8]`` is
        8). Otherwise None; in particular anything that depends on a symbolic dim (the batch) is None."""
        if not name:
            return None
        if name not in self._constants:
            self._constants[name] = None  # guards against cycles
            self._constants[name] = self._compute_constant(name)
        return self._constants[name]

    def _compute_constant(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return None if name in self.variable else numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "Constant":
            return _constant_node_value(node)
        if node.op_type == "Size":
            shape = self.shape(node.input[0])
            if shape is None or not all(isinstance(d, int) for d in shape):
                return None
            return np.array(int(np.prod(shape, dtype=np.int64)), np.int64)
        value = self._evaluate(node, name)
        if value is None:  # e.g. Gather(Shape(x), 2): not every input is a constant, but the entries picked are
            value = self._static_entries(name)
        return value

    def _evaluate(self, node: onnx.NodeProto, name: str) -> np.ndarray | None:
        if node.op_type not in _FOLDABLE:
            return None
        values = [self.constant(i) if i else None for i in node.input]
        if any(v is None for v, i in zip(values, node.input) if i):
            return None
        if any(v.size > FOLD_LIMIT for v in values if v is not None):
            return None
        if node.op_type in _INTEGER_ONLY and not all(_exact_integers(v) for v in values if v is not None):
            return None
        if self._output_size(node, name, values) > FOLD_LIMIT:  # decided before numpy allocates it
            return None
        from onnx.reference import ReferenceEvaluator

        try:
            evaluator = ReferenceEvaluator(node, opsets={"": self.opset})
            feeds = {i: v for i, v in zip(node.input, values) if i}
            outputs = evaluator.run(None, feeds)
        except Exception:
            return None
        value = np.asarray(outputs[list(node.output).index(name)])
        return value if value.size <= FOLD_LIMIT else None

    def _output_size(self, node: onnx.NodeProto, name: str, values: list) -> float:
        """Elements of output ``name`` of ``node`` over constant ``values``: from its inferred shape, or for the ops
        that make large tensors from small inputs, from those inputs (inf when unknown)."""
        shape = self.shape(name)
        if shape is not None and all(isinstance(d, int) for d in shape):
            return float(np.prod(shape, dtype=np.float64))
        try:
            if node.op_type == "ConstantOfShape":
                return float(np.prod(values[0], dtype=np.float64))
            if node.op_type == "Expand":
                return float(np.prod(np.broadcast_shapes(values[0].shape, tuple(int(d) for d in values[1])),
                                     dtype=np.float64))
            if node.op_type == "Tile":
                return float(values[0].size * np.prod(values[1], dtype=np.float64))
            if node.op_type == "Range":
                start, limit, delta = (float(v) for v in values)
                return max(0.0, np.ceil((limit - start) / delta))
            if node.op_type == "Gather":
                data, idx = values[0], values[1]
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                return float(idx.size) * data.size / max(1, data.shape[axis]) if data.ndim else float("inf")
            arrays = [v for v in values if v is not None]
            total = float(sum(v.size for v in arrays))  # data movement (Concat, Gather ...) makes no more than this
            try:  # elementwise ops broadcast
                return max(total, float(np.prod(np.broadcast_shapes(*(v.shape for v in arrays)), dtype=np.float64)))
            except ValueError:
                return total
        except (ValueError, TypeError, ZeroDivisionError):
            return float("inf")

    def _static_entries(self, name: str) -> np.ndarray | None:
        """A small integer tensor all of whose entries are static dims, as an array of its inferred shape."""
        shape, dtype = self.shape(name), self.dtype(name)
        if shape is None or len(shape) > 1 or not all(isinstance(d, int) for d in shape):
            return None
        np_type = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dtype))
        if np_type.kind not in "iu":
            return None
        entries = self._symbolic(name)
        if entries is None or len(entries) != int(np.prod(shape)) or not all(isinstance(e, int) for e in entries):
            return None
        return np.array(entries, np_type).reshape(shape)

    # -- shape arithmetic -------------------------------------------------------------------------------------------
    def int_values(self, name: str) -> list[SymDim] | None:
        """Entries of a small 1-D (or scalar) integer tensor: ints, or (tensor, axis) for a symbolic input dim.

        Follows Shape, Slice, Gather, Concat, Cast, Identity, Squeeze, Unsqueeze and Reshape over constants; None
        otherwise.
        """
        value = self.constant(name)
        if value is not None:
            if value.dtype.kind not in "iu" or value.ndim > 1:
                return None
            return [int(v) for v in value.reshape(-1)]
        return self._symbolic(name)

    def _symbolic(self, name: str) -> list[SymDim] | None:
        if name not in self._int_values:
            self._int_values[name] = None  # guards against cycles
            self._int_values[name] = self._compute_symbolic(name)
        return self._int_values[name]

    def _compute_symbolic(self, name: str) -> list[SymDim] | None:
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
        if op in ("Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape"):
            out = self.shape(name)  # at most 1-D: the entries are the input's, in order
            return self.int_values(node.input[0]) if out is not None and len(out) <= 1 else None
        if op == "Concat":
            parts = [self.int_values(i) for i in node.input]
            return None if any(p is None for p in parts) else [e for p in parts for e in p]
        if op == "Gather":
            data, idx = self.int_values(node.input[0]), self.constant(node.input[1])
            if data is None or idx is None or not all(-len(data) <= int(i) < len(data) for i in idx.reshape(-1)):
                return None
            return [data[int(i)] for i in idx.reshape(-1)]
        if op == "Slice":
            data = self.int_values(node.input[0])
            args = [self.constant(i) if i else None for i in list(node.input[1:]) + [""] * (5 - len(node.input))]
            starts, ends, _, steps = args[0], args[1], args[2], args[3]
            if data is None or starts is None or ends is None or starts.size != 1 or ends.size != 1:
                return None
            step = int(steps.reshape(-1)[0]) if steps is not None else 1
            n = len(data)
            clamp = lambda v: max(min(int(v), n), -n - 1)  # noqa: E731  (python slicing clamps the same way)
            return data[clamp(starts.reshape(-1)[0]):clamp(ends.reshape(-1)[0]):step]
        return None


def _product(dims: Shape) -> tuple[int, "Counter[str]"]:
    """A shape's element count as (product of the static dims, multiset of the symbolic ones)."""
    return int(np.prod([d for d in dims if isinstance(d, int)], dtype=np.int64)), Counter(
        d for d in dims if isinstance(d, str))


def _exact_integers(v: np.ndarray) -> bool:
    if v.dtype.kind in "iub":
        return True
    return v.dtype.kind == "f" and bool(np.all(np.isfinite(v)) and np.all(v == np.round(v))
                                        and np.all(np.abs(v) < 2 ** 24))


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
