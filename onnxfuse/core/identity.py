"""Graph identity: are B models the same graph up to weight values and names?

Each model is put in a canonical form that depends on neither node order nor names:

1. every node gets a structural key: a Merkle hash over its inputs (op, attributes, producers' keys, graph-input
   positions, initializer dtype/shape, and values for non-weight constants) combined with a hash over its consumers
   (so two structurally equal branches that feed different consumers are told apart);
2. nodes are ordered topologically, choosing among ready nodes the smallest key, ties broken by file position.

The B canonical node lists are then compared position by position; the first difference raises a
:class:`NotFusibleError` naming the node in both files. On success the aligned node lists are returned:
``aligned[k][b]`` is model b's k-th node.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import onnx

from onnxfuse.core._graph import CycleError, node_label, reads, topological_order
from onnxfuse.core.errors import NotFusibleError
from onnxfuse.core.source import SourceModel

__all__ = ["canonical_order", "check_identical", "AlignedModels"]


def _h(*parts: object) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:20]


def _attr_repr(a: onnx.AttributeProto) -> tuple:
    """A name-independent description of an attribute (subgraphs are described by their serialized form)."""
    v = onnx.helper.get_attribute_value(a)
    if isinstance(v, onnx.TensorProto):
        arr = onnx.numpy_helper.to_array(v)
        return (a.name, "tensor", str(arr.dtype), arr.shape, hashlib.sha1(arr.tobytes()).hexdigest())
    if isinstance(v, onnx.GraphProto):
        return (a.name, "graph", hashlib.sha1(v.SerializeToString()).hexdigest())
    if isinstance(v, bytes):
        v = v.decode(errors="replace")
    if isinstance(v, list):
        v = tuple(x.decode(errors="replace") if isinstance(x, bytes) else x for x in v)
    return (a.name, v)


def attributes(node: onnx.NodeProto) -> dict:
    return {a.name: _attr_repr(a)[1:] for a in node.attribute}


def _is_unknown(d: object) -> bool:
    return d is None or (isinstance(d, str) and d.startswith("unk__"))


def _shape_key(shape: list | None) -> tuple | None:
    if shape is None:
        return None
    return tuple(None if _is_unknown(d) else d for d in shape)


class _Structure:
    """Producer/consumer maps of one model, plus the per-node structural keys."""

    def __init__(self, src: SourceModel):
        self.src = src
        self.nodes = src.nodes
        self.producer: dict[str, tuple[int, int]] = {}
        for i, n in enumerate(self.nodes):
            for j, o in enumerate(n.output):
                if o:
                    self.producer[o] = (i, j)
        self.input_pos = {vi.name: k for k, vi in enumerate(src.inputs)}
        self.output_pos = {vi.name: k for k, vi in enumerate(src.outputs)}
        self.consumers: dict[int, list[tuple[int, int, int]]] = {i: [] for i in range(len(self.nodes))}
        self.deps: dict[int, set[int]] = {i: set() for i in range(len(self.nodes))}
        for i, n in enumerate(self.nodes):
            for k, t in enumerate(reads(n)):  # a subgraph's outer-scope reads are inputs too (after the node's own)
                if t in self.producer:
                    p, j = self.producer[t]
                    self.consumers[p].append((i, k, j))
                    self.deps[i].add(p)
        self._file_topo = self._topo(lambda i: (i,))
        self.up = self._up_keys()
        self.down = self._down_keys()

    def input_signature(self, name: str, keys: dict[int, str] | None = None) -> tuple:
        """How a node input is fed, without names: by a node output, a graph input, an initializer, or nothing."""
        if name == "":
            return ("none",)
        if name in self.producer:
            p, j = self.producer[name]
            return ("node", keys[p] if keys is not None else p, j)
        if name in self.input_pos:
            return ("input", self.input_pos[name])
        if name in self.src.initializers:
            t = self.src.initializers[name]
            if name in self.src.weight_names:
                return ("weight", t.data_type, tuple(t.dims))
            arr = self.src.array(name)
            return ("const", t.data_type, tuple(t.dims), hashlib.sha1(np.ascontiguousarray(arr).tobytes()).hexdigest())
        return ("undefined", name)

    def _topo(self, key) -> list[int]:
        try:
            return topological_order([self.deps[i] for i in range(len(self.nodes))], key,
                                     [node_label(n) for n in self.nodes])
        except CycleError as e:
            raise CycleError(f"{self.src.label}: {e}") from None

    def _up_keys(self) -> dict[int, str]:
        keys: dict[int, str] = {}
        for i in self._file_topo:
            n = self.nodes[i]
            ins = tuple(self.input_signature(t, keys) for t in reads(n))
            keys[i] = _h(n.domain, n.op_type, tuple(sorted(_attr_repr(a) for a in n.attribute)), ins, len(n.output))
        return keys

    def _down_keys(self) -> dict[int, str]:
        keys: dict[int, str] = {}
        for i in reversed(self._file_topo):
            n = self.nodes[i]
            uses = sorted((keys[c], k, j) for c, k, j in self.consumers[i])
            outs = tuple(self.output_pos.get(o, -1) for o in n.output)
            keys[i] = _h(self.up[i], tuple(uses), outs)
        return keys

    def canonical(self) -> list[int]:
        return self._topo(lambda i: (self.up[i], self.down[i], i))


def canonical_order(src: SourceModel) -> list[int]:
    """Indices of ``src``'s nodes in canonical topological order (independent of node order and names)."""
    return _Structure(src).canonical()


@dataclass
class AlignedModels:
    models: list[SourceModel]
    aligned: list[list[onnx.NodeProto]]  # aligned[k][b]: model b's k-th node in canonical order

    @property
    def B(self) -> int:
        return len(self.models)


def _describe(node: onnx.NodeProto) -> str:
    return f"node '{node_label(node)}' ({node.op_type})"


def check_identical(models: list[SourceModel]) -> AlignedModels:
    """Check the B models are one graph up to weights and names; return their nodes aligned."""
    if not models:
        raise NotFusibleError("no models given: pass at least one ONNX file")
    structs = [_Structure(m) for m in models]
    orders = [s.canonical() for s in structs]
    ref, ref_order = structs[0], orders[0]
    ref_label = models[0].label
    for b in range(1, len(models)):
        s, order, label = structs[b], orders[b], models[b].label
        _compare_interface(models[0], models[b])
        if len(order) != len(ref_order):
            raise NotFusibleError(
                f"{label} has {len(order)} nodes but {ref_label} has {len(ref_order)}: the models are different "
                "architectures; fuse only models exported from the same architecture"
            )
        pos_ref = {i: k for k, i in enumerate(ref_order)}
        pos = {i: k for k, i in enumerate(order)}
        for k, (i0, i1) in enumerate(zip(ref_order, order)):
            n0, n1 = ref.nodes[i0], s.nodes[i1]
            diff = _node_difference(ref, n0, pos_ref, s, n1, pos)
            if diff:
                raise NotFusibleError(
                    f"{label} {_describe(n1)} differs from {ref_label} {_describe(n0)} (canonical position {k}): "
                    f"{diff}; fuse only models that are the same graph up to weight values"
                )
    aligned = [[structs[b].nodes[orders[b][k]] for b in range(len(models))] for k in range(len(ref_order))]
    return AlignedModels(models=models, aligned=aligned)


def _compare_interface(m0: SourceModel, m1: SourceModel) -> None:
    for kind, a, b in (("inputs", m0.inputs, m1.inputs), ("outputs", m0.outputs, m1.outputs)):
        if len(a) != len(b):
            raise NotFusibleError(f"{m1.label} has {len(b)} graph {kind} but {m0.label} has {len(a)}")
        for k, (va, vb) in enumerate(zip(a, b)):
            sa, sb = _shape_key(m0.shapes.get(va.name)), _shape_key(m1.shapes.get(vb.name))
            ta, tb = m0.dtypes.get(va.name), m1.dtypes.get(vb.name)
            if sa != sb or ta != tb:
                raise NotFusibleError(
                    f"{m1.label} graph {kind[:-1]} {k} '{vb.name}' has shape {list(sb or [])} {_dtype(tb)} but "
                    f"{m0.label} '{va.name}' has shape {list(sa or [])} {_dtype(ta)}; fuse only models that are "
                    "the same graph up to weight values"
                )
    if m0.opset != m1.opset:
        raise NotFusibleError(f"{m1.label} uses opset {m1.opset} but {m0.label} uses opset {m0.opset}; export both alike")


def _dtype(elem_type: int | None) -> str:
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name if elem_type else "unknown dtype"


def _canon_input(s: _Structure, name: str, pos: dict[int, int]) -> tuple:
    sig = s.input_signature(name)
    if sig[0] == "node":
        return ("node", pos[sig[1]], sig[2])
    return sig


def _node_difference(s0: _Structure, n0, pos0, s1: _Structure, n1, pos1) -> str | None:
    if (n0.domain, n0.op_type) != (n1.domain, n1.op_type):
        return f"op type {n1.op_type} vs {n0.op_type}"
    a0, a1 = attributes(n0), attributes(n1)
    for key in sorted(set(a0) | set(a1)):
        if a0.get(key) != a1.get(key):
            v0, v1 = a0.get(key, ("absent",)), a1.get(key, ("absent",))
            return f"attribute {key} {v1[0] if len(v1) == 1 else v1} vs {v0[0] if len(v0) == 1 else v0}"
    if len(n0.input) != len(n1.input) or len(n0.output) != len(n1.output):
        return f"{len(n1.input)} inputs/{len(n1.output)} outputs vs {len(n0.input)}/{len(n0.output)}"
    for k, (t0, t1) in enumerate(zip(n0.input, n1.input)):
        c0, c1 = _canon_input(s0, t0, pos0), _canon_input(s1, t1, pos1)
        if c0 != c1:
            if c0[0] == c1[0] and c0[0] in ("weight", "const") and c0[1:3] != c1[1:3]:  # (dtype, shape)
                what = "dtype and shape" if c0[1] != c1[1] and c0[2] != c1[2] else \
                    "dtype" if c0[1] != c1[1] else "shape"
                return (f"input {k} {c0[0].replace('const', 'constant')} '{t1}' differs in {what}: "
                        f"{_dtype(c1[1])} {list(c1[2])} vs '{t0}' {_dtype(c0[1])} {list(c0[2])}")
            if c0[0] == c1[0] == "const":
                return f"input {k} constant '{t1}' has a different value than '{t0}'"
            return f"input {k} '{t1}' is fed differently than '{t0}'"
    for k, (t0, t1) in enumerate(zip(n0.output, n1.output)):
        if bool(t0) != bool(t1):
            return f"output {k} is {'absent' if not t1 else 'present'} vs {'absent' if not t0 else 'present'}"
        sh0, sh1 = _shape_key(s0.src.shapes.get(t0)), _shape_key(s1.src.shapes.get(t1))
        if sh0 != sh1:
            return f"output {k} shape {list(sh1) if sh1 else '?'} vs {list(sh0) if sh0 else '?'}"
        if s0.src.dtypes.get(t0) != s1.src.dtypes.get(t1):
            return f"output {k} dtype {_dtype(s1.src.dtypes.get(t1))} vs {_dtype(s0.src.dtypes.get(t0))}"
    return None
