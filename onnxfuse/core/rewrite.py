"""The node-rewrite engine: the context a rewrite reads, the emitter it builds its replacement with, and the pass that
applies a catalog of rewrites (a :class:`~onnxfuse.core.registry.Registry` keyed by op type). The engine knows no op
and holds no catalog: the standard forms of onnxfuse's own ops (``core/standard.py``: ``STANDARD_FORMS``) and ONNX
Runtime's trainability legalization (``runtime/ort/legalize/``: ``REWRITES``, one module per op family) are each
handed to :func:`apply_rewrites`.

A rewrite is ``fn(node, ctx) -> list[NodeProto] | None``: None when the node is trainable as it is, otherwise the
nodes that replace it. The replacement reads only the node's inputs and constants it creates, writes the node's
outputs under their original names, and is listed in topological order, so putting it where the node was keeps
the whole graph in topological order and every downstream shape valid.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import numpy as np
import onnx
from onnx import helper

from onnxfuse.core.errors import OnnxFuseError, UntrainableOpError
from onnxfuse.core._facts import Dim, GraphFacts, Shape, SymDim
from onnxfuse.core._graph import Emitter as GraphEmitter
from onnxfuse.core._graph import Names, node_label
from onnxfuse.core._opset import onnx_opset
from onnxfuse.core.registry import Registry

__all__ = ["FINAL", "Rewrite", "Context", "Emitter", "COPY", "Dims", "apply_rewrites", "Dim", "Shape", "SymDim"]

# Marks a node a rewrite emitted of its own op type: legalization runs to a fixed point, and that node is already in
# the form the rewrite wants (the ReduceMax inside ReduceMax's mask, a LayerNormalization with all its outputs).
FINAL = "onnxfuse: legalized"

Rewrite = Callable[[onnx.NodeProto, "Context"], "list[onnx.NodeProto] | None"]


class Context:
    """What a rewrite may ask about the graph (shapes, dtypes, constants, uses), and where it gets unique names and
    new constant initializers."""

    def __init__(self, model: onnx.ModelProto, parameters: set[str] | None = None):
        self.opset = onnx_opset(model)
        # the initializers that are trained (None: every initializer may be one); the others are constants
        self.parameters = parameters
        self.facts = GraphFacts(model, self.opset)
        self.names = Names.of(model.graph)
        self.new_initializers: list[onnx.TensorProto] = []

    # -- facts ------------------------------------------------------------------------------------------------------
    def shape(self, name: str) -> Shape | None:
        return self.facts.shape(name)

    def dtype(self, name: str) -> int:
        return self.facts.dtype(name)

    def np_dtype(self, name: str) -> np.dtype:
        return helper.tensor_dtype_to_np_dtype(self.dtype(name))

    def is_float(self, name: str) -> bool:
        return self.dtype(name) in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                                    onnx.TensorProto.BFLOAT16)

    def constant(self, name: str) -> np.ndarray | None:
        return self.facts.constant(name)

    def is_fixed_constant(self, name: str) -> bool:
        """A constant that is not trained: a Constant node's output or folded value, or an initializer that is not a
        parameter (when the parameters are known)."""
        if self.constant(name) is None:
            return False
        if name in self.facts.initializers:
            return self.parameters is not None and name not in self.parameters
        return True

    def int_values(self, name: str) -> list[SymDim] | None:
        return self.facts.int_values(name)

    def is_used(self, name: str) -> bool:
        return self.facts.is_used(name)

    def rank(self, node: onnx.NodeProto, name: str) -> int:
        shape = self.shape(name)
        if shape is None:
            raise self.error(node, f"the rank of its input '{name}' is unknown after shape inference",
                             "export the model with static input ranks (every torch export has them)")
        return len(shape)

    def static_dim(self, node: onnx.NodeProto, name: str, axis: int, why: str) -> int:
        """Dim ``axis`` of ``name``, which must be static (``why`` says what needs it)."""
        shape = self.shape(name)
        d = shape[axis] if shape is not None and -len(shape) <= axis < len(shape) else None
        if not isinstance(d, int):
            raise self.error(node, f"dim {axis} of '{name}' is {d if d else 'unknown'}, but {why} needs it static",
                             "export the model with a fixed size along that axis (only the batch may be dynamic)")
        return d

    def attrs(self, node: onnx.NodeProto) -> dict:
        """The node's attributes as Python values (strings decoded)."""
        values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}

    def error(self, node: onnx.NodeProto, problem: str, fix: str) -> UntrainableOpError:
        return UntrainableOpError(
            f"node '{node_label(node)}' ({node.op_type}): {problem}, so onnxruntime-training 1.19 cannot train it "
            f"and onnxfuse cannot rewrite it into a trainable form. To fix this, {fix}.")

    # -- names and constants ----------------------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        return self.names.fresh(hint)


class _Copy:
    """Reshape's 0: copy the input dim at the same position."""

    def __repr__(self) -> str:
        return "COPY"


COPY = _Copy()


@dataclass(frozen=True)
class Dims:
    """The product of ``tensor``'s dims at ``axes``, whose values (int, or symbolic/None) are ``dims``."""

    tensor: str
    axes: tuple
    dims: tuple

    @property
    def static(self) -> int | None:
        return int(np.prod(self.dims, dtype=np.int64)) if all(isinstance(d, int) for d in self.dims) else None


ShapePart = Union[int, _Copy, Dims]


class Emitter(GraphEmitter):
    """Builds one node's replacement: ``op`` appends a node and returns its output name(s); names derive from the
    node's, constants become initializers of the pass (the graph layer's :class:`~onnxfuse.core._graph.Emitter` chooses
    the opset-dependent forms)."""

    def __init__(self, node: onnx.NodeProto, ctx: Context):
        super().__init__(ctx.names, ctx.opset, f"{node_label(node)}/", ctx.new_initializers)
        self.node, self.ctx = node, ctx

    def op(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str] | int = 1, **attrs) -> str | list[str]:
        outs = self.emit(op_type, inputs, outputs, **attrs)
        return outs[0] if len(outs) == 1 else outs

    def const(self, value, dtype=np.int64, hint: str = "const") -> str:
        return super().const(value, dtype, hint)

    def like(self, value, name: str, hint: str = "const") -> str:
        """A constant with the dtype of tensor ``name`` (scalars broadcast)."""
        return self.const(value, self.ctx.np_dtype(name), hint)

    def transpose(self, x: str, perm: Sequence[int], output: str | None = None) -> str:
        if list(perm) == list(range(len(perm))) and output is None:
            return x
        return self.op("Transpose", [x], [output] if output else 1, perm=[int(p) for p in perm])

    def slice(self, x: str, starts, ends, axes, steps=None, output: str | None = None) -> str:
        ins = [x, self.const(starts, hint="starts"), self.const(ends, hint="ends"), self.const(axes, hint="axes")]
        if steps is not None:
            ins.append(self.const(steps, hint="steps"))
        return self.op("Slice", ins, [output] if output else 1)

    def shape_tensor(self, parts: Sequence[ShapePart]) -> str:
        """A 1-D int64 shape for Reshape: ints as they are, COPY as 0, Dims as the product of those dims.

        Static when at most one Dims is not static (it becomes -1); otherwise computed in the graph from Shape.
        """
        unknown = [p for p in parts if isinstance(p, Dims) and p.static is None]
        if len(unknown) <= 1:
            values = [p if isinstance(p, int) else 0 if p is COPY else (-1 if p.static is None else p.static)
                      for p in parts]
            return self.const(values, hint="shape")
        pieces = []
        shapes: dict[str, str] = {}
        for p in parts:
            if isinstance(p, Dims) and p.static is None:
                if p.tensor not in shapes:
                    shapes[p.tensor] = self.op("Shape", [p.tensor])
                picked = self.op("Gather", [shapes[p.tensor], self.const(list(p.axes), hint="dims")], axis=0)
                if len(p.axes) > 1:
                    picked = self.reduce("ReduceProd", picked, [0], keepdims=1)
                elif len(p.axes) == 0:
                    picked = self.const([1], hint="one")
                pieces.append(picked)
            else:
                value = p if isinstance(p, int) else 0 if p is COPY else p.static
                pieces.append(self.const([value], hint="dim"))
        return self.op("Concat", pieces, axis=0)

    def reshape(self, x: str, parts: Sequence[ShapePart], output: str | None = None) -> str:
        return self.op("Reshape", [x, self.shape_tensor(parts)], [output] if output else 1)

    def finish(self, value: str, output: str) -> None:
        """Make ``value`` the node's ``output``: rename the last node's output when it made ``value``, otherwise
        (``value`` is the node's input or an earlier result) copy it with Identity."""
        if self.nodes and list(self.nodes[-1].output) == [value]:
            self.nodes[-1].output[0] = output
        else:
            self.op("Identity", [value], [output])


def apply_rewrites(model: onnx.ModelProto, catalogs: Sequence[Registry[Rewrite]], parameters: set[str] | None = None,
                   only: Callable[[onnx.NodeProto], bool] | None = None) -> tuple[onnx.ModelProto, list[str]]:
    """Replace every node whose rewrite in ``catalogs`` (the first that has its op type) returns nodes (``only``: of
    the nodes it accepts); returns the new model and one line per rewrite applied."""
    out = copy.deepcopy(model)
    ctx = Context(out, parameters)
    g = out.graph
    new_nodes: list[onnx.NodeProto] = []
    applied: list[str] = []
    for node in g.node:
        fn = next((found for found in (catalog.lookup(node) for catalog in catalogs) if found is not None), None)
        if fn is None or node.doc_string == FINAL or (only is not None and not only(node)):
            new_nodes.append(node)
            continue
        try:
            replacement = fn(node, ctx)
        except OnnxFuseError:
            raise
        except Exception as e:  # a bug or an input this rewrite did not foresee: name the node
            raise UntrainableOpError(
                f"node '{node_label(node)}' ({node.op_type}): legalizing it for training failed ({type(e).__name__}: "
                f"{e}). To fix this, report it with the model, or replace the layer that exports to "
                f"{node.op_type}.") from e
        if replacement is None:
            new_nodes.append(node)
            continue
        for n in replacement:  # a rewrite's own op in its replacement is its final form (ReduceMax in the mask)
            if (n.op_type, n.domain) == (node.op_type, node.domain):
                n.doc_string = FINAL
        new_nodes.extend(replacement)
        applied.append(_describe(node, replacement))
    del g.node[:]
    g.node.extend(new_nodes)
    g.initializer.extend(ctx.new_initializers)
    return out, applied


def _describe(node: onnx.NodeProto, replacement: list[onnx.NodeProto]) -> str:
    if len(replacement) == 1 and replacement[0].op_type == node.op_type:
        n_old = sum(1 for o in node.output if o)
        n_new = sum(1 for o in replacement[0].output if o)
        return f"{node.op_type} '{node_label(node)}' -> {node.op_type} with {n_new} outputs (was {n_old})"
    ops = list(dict.fromkeys(n.op_type for n in replacement))
    return f"{node.op_type} '{node_label(node)}' -> {' + '.join(ops)}"
