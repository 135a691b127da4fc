"""The fusion engine: walk the B aligned graphs node by node and let each op's rule emit the fused nodes.

The engine knows layouts (:mod:`onnxfuse.core.layout`), weights (:mod:`onnxfuse.core.weights`) and how to convert a tensor
between layouts; it never names a specific op. A rule receives a :class:`NodeGroup` (the B aligned nodes plus
access to their fused inputs) and either emits fused nodes and sets the layout of every output, or calls
``g.fail(reason)`` when it cannot fuse this instance.
"""
from __future__ import annotations

import contextlib
import functools

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxfuse.core._graph import Names, node_label, outer_reads, rename_outer
from onnxfuse.core._shapes import complete_shapes
from onnxfuse.core.errors import ConfigError, NotFusibleError, UnsupportedOpError
from onnxfuse.core.identity import AlignedModels
from onnxfuse.core.layout import SHARED, Layout, stacked
from onnxfuse.core.registry import op_key, op_names
from onnxfuse.core.source import SourceModel, tensor_shape
from onnxfuse.core.weights import FusedWeight, WeightSlot, pack_weights, relayout

__all__ = ["NodeGroup", "Rule", "RuleFailed", "FusionResult", "Strategy", "fuse_aligned", "check_layouts"]

# A fusion strategy: given the B aligned nodes and the forms their rule offers (default first), the form to emit.
Strategy = Callable[["NodeGroup", tuple], str]


@dataclass(frozen=True)
class Rule:
    """What the engine calls for one op type: ``fuse`` over the B aligned nodes. The catalog
    (``onnxfuse/core/rules/``) registers one per op type; the engine is handed that table and defines only what an
    entry is, so it imports no rule."""

    op_type: str
    fuse: Callable[[NodeGroup], None]
    domain: str = ""
    # When every input is shared (same in all models), the engine emits the node once, unchanged. Rules for ops
    # whose result must differ per model even then (random ops such as Dropout) turn this off.
    shared_passthrough: bool = True
    # The fused forms the rule can emit, the default first (e.g. Conv: "grouped", "per-model"). A fusion strategy
    # (``passes.fuse_models(strategy=...)``) picks one per node; the rule reads it as ``g.form``. Every form keeps
    # the same weight layout, so array.json, checkpoints and split do not depend on the choice.
    forms: tuple[str, ...] = ()


class RuleFailed(Exception):
    """Raised by a rule (via ``g.fail``) when a node cannot be fused; carries the reason."""


@dataclass
class FusionResult:
    model: onnx.ModelProto
    weights: dict[str, FusedWeight]
    summary: dict = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)  # fused node name -> what emitted it (NODE_ORIGINS)


# What emits each fused node, in the order the summary lists them: a rule fusing a node group, a node run once per
# model (B copies and the slicing), a node every model shares (emitted once), a layout conversion between two
# rules (or a weight viewed in another slot), and an Identity that gives a graph output its original name.
NODE_ORIGINS = ("rules", "per_model", "shared", "layout", "output")


class FusionState:
    """Everything built so far: fused nodes, initializers, and where each original tensor lives."""

    def __init__(self, aligned: AlignedModels, per_model_inputs: set[str] = frozenset(),
                 model_ids: Sequence[int] | None = None):
        self.aligned = aligned
        self.per_model_inputs = set(per_model_inputs)
        self.models: list[SourceModel] = aligned.models
        self.B = aligned.B
        # each model's identity in its array (its original index: the same when the array is re-fused without some
        # models), for what must not depend on a model's position (a random op's own seed)
        self.model_ids = list(model_ids) if model_ids is not None else list(range(self.B))
        self.src = aligned.models[0]
        self.opset = self.src.opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray] = {}
        self.weights: dict[str, FusedWeight] = {}
        self.weight_of: dict[tuple[int, str], str] = {}  # (model b, its initializer name) -> fused weight name
        self.weight_views: dict[tuple[str, WeightSlot], str] = {}  # (fused weight, another slot) -> computed view
        self.tensors: dict[str, tuple[str, Layout]] = {}  # model-0 tensor name -> (fused name, layout)
        self.consts: dict[str, np.ndarray] = {}  # model-0 tensor name -> value, for shared constants
        self.conversions: dict[tuple[str, Layout], str] = {}
        self.output_names = {o.name for o in self.src.outputs}
        self.consumers: dict[str, int] = {}
        for n in self.src.nodes:
            for t in set(n.input):
                self.consumers[t] = self.consumers.get(t, 0) + 1
        self.names = Names()
        self.layout_changes = 0
        self.origin = "rules"  # what the nodes emitted now are for (NODE_ORIGINS)
        self.origins: dict[str, str] = {}
        for vi in self.src.inputs:  # a per-model input carries one slice per model: [B, ...] = stacked(0)
            self.tensors[vi.name] = (vi.name, stacked(0) if vi.name in self.per_model_inputs else SHARED)
            self.names.taken.add(vi.name)
        for name in self.src.initializers:
            self.names.taken.add(name)
            if name not in self.src.weight_names:
                self.inits[name] = self.src.array(name)
                self.consts[name] = self.inits[name]
                self.tensors[name] = (name, SHARED)

    # ---- undo (a rule that fails half-way leaves no trace)
    def checkpoint(self) -> tuple:
        return (len(self.nodes), dict(self.tensors), dict(self.conversions), dict(self.consts), dict(self.inits),
                dict(self.weights), dict(self.weight_of), dict(self.weight_views), self.layout_changes)

    def rollback(self, mark: tuple) -> None:
        del self.nodes[mark[0]:]
        (self.tensors, self.conversions, self.consts, self.inits, self.weights, self.weight_of, self.weight_views,
         self.layout_changes) = mark[1:]

    # ---- names
    def fresh(self, hint: str) -> str:
        return self.names.fresh(hint)

    def fused_name_for(self, orig: str) -> str:
        # Graph outputs get their original name back at the very end, in stacked(0) layout.
        return self.fresh(orig + "__fused" if orig in self.output_names else orig)

    # ---- emitting
    def emit(self, op: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "",
             name: str | None = None, **attrs) -> list[str]:
        outs = [self.fresh(f"{name or op}_out{k}") for k in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(helper.make_node(op, inputs, outs, name=self.fresh(name or op), domain=domain, **attrs))
        self.origins[self.nodes[-1].name] = self.origin
        return outs

    @contextlib.contextmanager
    def emitting(self, origin: str):
        """Nodes emitted inside are counted as ``origin``'s (the summary's breakdown of the fused nodes)."""
        outer, self.origin = self.origin, origin
        try:
            yield
        finally:
            self.origin = outer

    def const(self, value, hint: str = "const", dtype=np.int64) -> str:
        arr = np.asarray(value, dtype=dtype)
        name = self.fresh(hint)
        self.inits[name] = arr
        return name

    # ---- layout conversion
    def convert(self, orig: str, dst: Layout) -> str:
        """The fused name of original tensor ``orig`` in layout ``dst``, inserting conversion nodes once."""
        name, src = self.tensors[orig]
        return self.convert_tensor(name, src, dst, self.src.shapes.get(orig), orig)

    def convert_tensor(self, name: str, src: Layout, dst: Layout, shape: list | None, orig: str) -> str:
        """Convert fused tensor ``name`` (original shape ``shape``) from layout ``src`` to ``dst``."""
        with self.emitting("layout"):
            return self._convert_tensor(name, src, dst, shape, orig)

    def _convert_tensor(self, name: str, src: Layout, dst: Layout, shape: list | None, orig: str) -> str:
        if src == dst:
            return name
        if (name, dst) in self.conversions:
            return self.conversions[(name, dst)]
        if shape is None:
            raise RuleFailed(f"the rank of tensor '{orig}' is unknown, so its layout {src} cannot be changed to {dst}")
        r, B = len(shape), self.B
        if dst.is_shared:
            raise RuleFailed(f"tensor '{orig}' differs per model but is used where one shared value is required")
        self.layout_changes += 1
        cur, cl = name, src
        if cl.is_shared:
            a = dst.axis
            if dst.kind == "packed":
                reps = self.const([B if k == a else 1 for k in range(r)], "tile_reps")
                out = self.emit("Tile", [cur, reps], [self.fresh(f"{orig}__{dst.kind}{a}")])[0]
            else:
                u = self.emit("Unsqueeze", [cur, self.const([a], "axes")])[0]
                to = self.const([B if k == a else 1 for k in range(r + 1)], "expand_shape")
                out = self.emit("Expand", [u, to], [self.fresh(f"{orig}__{dst.kind}{a}")])[0]
            self.conversions[(name, dst)] = out
            return out
        if cl.kind == "packed":
            cur = self._reshape_packed_stacked(cur, shape, cl.axis, to_stacked=True)
            cl = stacked(cl.axis)
        if cl.axis != dst.axis:
            perm = list(range(r + 1))
            perm.remove(cl.axis)
            perm.insert(dst.axis, cl.axis)
            cur = self.emit("Transpose", [cur], perm=perm)[0]
            cl = stacked(dst.axis)
        if dst.kind == "packed":
            cur = self._reshape_packed_stacked(cur, shape, dst.axis, to_stacked=False)
        self.conversions[(name, dst)] = cur
        return cur

    def _reshape_packed_stacked(self, x: str, shape: list, a: int, to_stacked: bool) -> str:
        """packed(a) <-> stacked(a): same bytes, so a Reshape. Leading dims are copied with 0, the model block
        size is B (stacked) or inferred (-1); trailing dims must be static, else they come from Shape at run time."""
        r, B = len(shape), self.B
        trailing = shape[a + 1 :]
        if all(isinstance(d, int) for d in trailing):
            mid = [B, -1] if to_stacked else [-1]
            target = self.const([0] * a + mid + list(trailing), "shape")
        else:
            sh = self.emit("Shape", [x])[0]
            lo = self.emit("Slice", [sh, self.const([0], "start"), self.const([a], "end")])[0]
            # trailing dims sit after the model block: from a+1 in the packed tensor, a+2 in the stacked one
            start, end = (a + 1, r) if to_stacked else (a + 2, r + 1)
            hi = self.emit("Slice", [sh, self.const([start], "start"), self.const([end], "end")])[0]
            mid = self.const([B, -1] if to_stacked else [-1], "shape")
            target = self.emit("Concat", [lo, mid, hi], axis=0)[0]
        return self.emit("Reshape", [x, target])[0]

    # ---- weights
    def pack_weight(self, sources: list[str], slot: WeightSlot, role: str, extra: dict | None = None) -> str:
        """The fused weight holding model b's initializer ``sources[b]`` laid out by ``slot``.

        The first request packs the B tensors into one model-major initializer in its slot: the parameter, trained
        once, and the one entry array.json keeps for it. A later request for the same tensors (a tied weight: one
        parameter read by several nodes, e.g. GPT-2's embedding table and LM head) gets that initializer when the
        slot is the same, and otherwise a view computed from it in the graph (:func:`~onnxfuse.core.weights.relayout`:
        Reshape/Transpose, made once per slot). Every use then reads the same parameter, and the backward pass sums
        the gradients of all uses into it, as torch does for a tied parameter.
        """
        key = sources[0]
        owners = [self.weight_of.get((b, s)) for b, s in enumerate(sources)]
        if len(set(owners)) > 1:  # the identity check compares initializers by shape, not by which node shares one
            b = next(b for b, o in enumerate(owners) if o != owners[0])
            read = ["is also read by another node" if o else "is read by no other node so far" for o in owners]
            raise RuleFailed(
                f"the models tie weights differently: model 0's '{key}' {read[0]}, model {b}'s '{sources[b]}' "
                f"{read[b]}; tie (or untie) the weight the same way in every model"
            )
        if owners[0] is not None:
            fw = self.weights[owners[0]]
            if fw.slot == slot:
                return fw.name
            if "buffer" in (fw.role, role):
                raise RuleFailed(
                    f"buffer '{key}' is read in two layouts, but the training step writes a buffer in place (e.g. "
                    "BatchNorm running statistics), so every reader must use the initializer itself; give each use "
                    "its own buffer"
                )
            return self._weight_view(fw, slot)
        arrays = [m.array(s) for m, s in zip(self.models, sources)]
        trainable = self.src.trainable
        if role == "param" and ((trainable is not None and key not in trainable) or key in self.src.never_trained):
            role = "frozen"
        name = key  # the fused weight keeps model 0's initializer name (each is packed once)
        self.inits[name] = pack_weights(slot, arrays)
        self.weights[name] = FusedWeight(
            name=name, slot=slot, orig_shape=tuple(arrays[0].shape), dtype=str(arrays[0].dtype), role=role,
            sources=list(sources), extra=dict(extra or {}),
        )
        for b, s in enumerate(sources):
            self.weight_of[(b, s)] = name
        return name

    def _weight_view(self, fw: FusedWeight, slot: WeightSlot) -> str:
        """Fused weight ``fw`` as packed in ``slot`` instead of its own, computed in the graph (made once)."""
        if (fw.name, slot) not in self.weight_views:
            cur = fw.name
            for op, arg in relayout(fw.slot, slot, fw.orig_shape, self.B):
                with self.emitting("layout"):
                    if op == "Transpose":
                        cur = self.emit("Transpose", [cur], name=f"{fw.name}__view", perm=arg)[0]
                    else:
                        cur = self.emit("Reshape", [cur, self.const(arg, "shape")], name=f"{fw.name}__view")[0]
            self.weight_views[(fw.name, slot)] = cur
            self.layout_changes += 1
        return self.weight_views[(fw.name, slot)]


class NodeGroup:
    """The B aligned nodes a rule fuses, and the tools to read their inputs and emit the fused nodes."""

    def __init__(self, st: FusionState, nodes: list[onnx.NodeProto]):
        self._st = st
        self.nodes = nodes
        self.node = nodes[0]
        self.B = st.B
        self.opset = st.opset
        self._outputs_set: set[int] = set()
        # the fused form the strategy chose for a rule that offers several (``Rule.forms``); None otherwise
        self.form: str | None = None

    # ---- reading
    @property
    def op_type(self) -> str:
        return self.node.op_type

    @property
    def name(self) -> str:
        return node_label(self.node)

    @property
    def model_ids(self) -> list[int]:
        """Model b's identity in its array at b (its original index; range(B) for a newly fused array)."""
        return self._st.model_ids

    @property
    def model_label(self) -> str:
        """The name of model 0 (its file), for a message about the model itself."""
        return self._st.src.label

    def attr(self, name: str, default=None):
        for a in self.node.attribute:
            if a.name == name:
                v = helper.get_attribute_value(a)
                return v.decode() if isinstance(v, bytes) else v
        return default

    def attrs(self) -> dict:
        return {a.name: helper.get_attribute_value(a) for a in self.node.attribute}

    def has_input(self, i: int) -> bool:
        return i < len(self.node.input) and self.node.input[i] != ""

    @property
    def num_inputs(self) -> int:
        return len(self.node.input)

    def input_shape(self, i: int) -> list | None:
        return self._st.src.shapes.get(self.node.input[i])

    def output_shape(self, j: int = 0) -> list | None:
        return self._st.src.shapes.get(self.node.output[j])

    def input_dtype(self, i: int) -> int | None:
        """Input i's element type (``onnx.TensorProto`` enum), or None when inference leaves it unknown."""
        return self._st.src.dtypes.get(self.node.input[i])

    def rank(self, i: int) -> int:
        s = self.input_shape(i)
        if s is None:
            self.fail(f"the rank of input {i} ('{self.node.input[i]}') is unknown")
        return len(s)

    def output_rank(self, j: int = 0) -> int:
        s = self.output_shape(j)
        if s is None:
            self.fail(f"the rank of output {j} ('{self.node.output[j]}') is unknown")
        return len(s)

    def is_weight(self, i: int) -> bool:
        t = self.node.input[i] if i < len(self.node.input) else ""
        return t in self._st.src.weight_names

    def is_shared(self, i: int) -> bool:
        """True when input i holds the same value for every model (absent inputs count as shared)."""
        if not self.has_input(i):
            return True
        if self.is_weight(i):
            return False
        return self._st.tensors[self.node.input[i]][1].is_shared

    def layout(self, i: int) -> Layout | None:
        """Input i's layout, or None for a per-model weight (an initializer not yet packed)."""
        if self.is_weight(i):
            return None
        return self._st.tensors[self.node.input[i]][1]

    def const(self, i: int) -> np.ndarray | None:
        """Input i's value when it is a constant known now (shared initializer or Constant node output)."""
        return self._st.consts.get(self.node.input[i]) if self.has_input(i) else None

    @property
    def batch_dims(self) -> set[str]:
        """The symbolic names of the graph inputs' first dims (the batch, e.g. {"N"}), for a strategy that runs the
        node alone and must set them wherever they appear (an LSTM's X [T, N, I] has its batch second)."""
        shapes = (self._st.src.shapes.get(vi.name) for vi in self._st.src.inputs)
        return {s[0] for s in shapes if s and isinstance(s[0], str)}

    def weight_sources(self, i: int) -> list[str]:
        return [n.input[i] for n in self.nodes]

    def weight_arrays(self, i: int) -> list[np.ndarray]:
        """Input i's B per-model initializers, model b's at b (for a strategy that measures the node alone)."""
        return [m.array(s) for m, s in zip(self._st.models, self.weight_sources(i))]

    def sole_use_of_weight(self, i: int) -> bool:
        """Input i is a weight that no other node reads and that is not packed yet: the rule may choose its slot
        freely (e.g. fold a Transpose into the packing)."""
        t = self.node.input[i]
        return self.is_weight(i) and (0, t) not in self._st.weight_of and self._st.consumers.get(t, 0) == 1

    # ---- getting fused inputs
    def get(self, i: int, layout: Layout) -> str:
        """Fused name of input i in ``layout`` (a per-model weight is first packed as stacked(0))."""
        t = self.node.input[i]
        if self.is_weight(i):
            if t not in self._st.tensors:
                shape = self._st.src.shapes[t]
                self.weight(i, WeightSlot(None, (1, *shape)))  # registers it as a stacked(0) tensor
            return self._st.convert(t, layout)
        return self._st.convert(t, layout)

    def shared(self, i: int) -> str:
        if not self.is_shared(i):
            self.fail(f"input {i} ('{self.node.input[i]}') must be the same for all models")
        return self._st.tensors[self.node.input[i]][0]

    def weight(self, i: int, slot: WeightSlot, role: str = "param", extra: dict | None = None) -> str:
        """Input i's B per-model initializers as one model-major fused weight laid out by ``slot``.

        The name returned is the fused initializer, unless another node already packed the same (tied) weight in
        another slot: then it is a view computed from that initializer (see ``FusionState.pack_weight``). A rule
        that needs the initializer itself asks first whether it may pick the slot (``sole_use_of_weight``)."""
        if not self.is_weight(i):
            self.fail(f"input {i} ('{self.node.input[i]}') must be an initializer (a weight), not a computed tensor")
        name = self._st.pack_weight(self.weight_sources(i), slot, role, extra)
        t = self.node.input[i]
        if slot.perm is None and slot.block_shape == (1, *self._st.src.shapes[t]):
            self._st.tensors.setdefault(t, (name, stacked(0)))
        return name

    # ---- emitting
    def emit(self, op: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", **attrs) -> list[str]:
        return self._st.emit(op, inputs, outputs, domain=domain, name=self.node.name or op, **attrs)

    def convert(self, name: str, src: Layout, dst: Layout, orig_shape: list) -> str:
        """Convert an intermediate fused tensor the rule made itself (original shape ``orig_shape``)."""
        return self._st.convert_tensor(name, src, dst, orig_shape, name)

    def new_const(self, value, hint: str = "const", dtype=np.int64) -> str:
        return self._st.const(value, hint, dtype)

    def temp_name(self, hint: str) -> str:
        """A fresh name for an intermediate tensor the rule makes."""
        return self._st.fresh(f"{hint}__tmp")

    def out_name(self, j: int = 0) -> str:
        return self._st.fused_name_for(self.node.output[j])

    def set_output(self, j: int, name: str, layout: Layout, value: np.ndarray | None = None) -> None:
        self._st.tensors[self.node.output[j]] = (name, layout)
        if value is not None:
            self._st.consts[self.node.output[j]] = value
        self._outputs_set.add(j)

    def emit_same(self, inputs: list[str], layout: Layout, **override_attrs) -> list[str]:
        """Emit this node's op with its own attributes on fused ``inputs``; every output gets ``layout``."""
        attrs = self.attrs()
        attrs.update(override_attrs)
        outs = [self.out_name(j) if o else "" for j, o in enumerate(self.node.output)]
        self.emit(self.op_type, inputs, outs, domain=self.node.domain, **attrs)
        for j, o in enumerate(outs):
            if o:
                self.set_output(j, o, layout)
        return outs

    def fail(self, reason: str):
        raise RuleFailed(reason)

    # ---- used by the engine
    def per_model(self, attrs: Callable[[int], dict] | None = None) -> None:
        """The fallback for a node without a rule: run it once per model on model b's slices and stack the results.

        Layout: every per-model input as stacked(0) [B, ...], model b's slice taken with Gather(index b) (a weight
        is packed [B, ...] and sliced the same way, so its gradient flows); outputs Unsqueeze + Concat -> stacked(0).
        Correct for any op, but B copies of the node instead of one fused node. ``attrs(b)``: attributes that model
        b's node has in place of the original's (a random op's own seed).
        """
        B = self.B
        sliced: dict[int, list[str]] = {}
        for i in range(len(self.node.input)):
            if self.has_input(i) and not self.is_shared(i):
                x = self.get(i, stacked(0))
                sliced[i] = [self.emit("Gather", [x, self.new_const(b, "model_index")], axis=0)[0] for b in range(B)]
        # what its subgraphs (If branches, Loop and Scan bodies) read from outside: model b's copy reads b's
        outer = {t: self._model_slices(k) for k, t in enumerate(outer_reads(self.node))}
        outs: list[list[str]] = []
        for b in range(B):
            ins = [sliced[i][b] if i in sliced else (self._st.tensors[t][0] if t else "")
                   for i, t in enumerate(self.node.input)]
            node_attrs = {**self.attrs(), **(attrs(b) if attrs else {})}
            if outer:
                node_attrs = {k: rename_outer(v, {t: names[b] for t, names in outer.items()})
                              if isinstance(v, onnx.GraphProto) else v for k, v in node_attrs.items()}
            outs.append(self.emit(self.op_type, ins, [self._st.fresh(f"{o}__model{b}") if o else ""
                                                      for o in self.node.output], domain=self.node.domain,
                                  **node_attrs))
        axis0 = self.new_const([0], "axes")
        for j, o in enumerate(self.node.output):
            if o:
                parts = [self.emit("Unsqueeze", [outs[b][j], axis0])[0] for b in range(B)]
                self.set_output(j, self.emit("Concat", parts, [self.out_name(j)], axis=0)[0], stacked(0))

    def _model_slices(self, k: int) -> list[str]:
        """The k-th outer-scope tensor the node's subgraphs read, as B names, model b's at b: the fused name when
        shared, else model b's slice of it in stacked(0) (Gather of index b; a weight, named by each model as its
        own subgraph names it, is packed first, so its gradient flows)."""
        names = [outer_reads(n)[k] for n in self.nodes]
        t = names[0]
        if t in self._st.src.weight_names and t not in self._st.tensors:
            shape = self._st.src.shapes[t]
            fused = self._st.pack_weight(names, WeightSlot(None, (1, *shape)), "param", None)
            self._st.tensors.setdefault(t, (fused, stacked(0)))
        name, layout = self._st.tensors[t]
        if layout.is_shared:
            return [name] * self.B
        x = self._st.convert(t, stacked(0))
        return [self.emit("Gather", [x, self.new_const(b, "model_index")], axis=0)[0] for b in range(self.B)]

    def outer_reads_shared(self) -> bool:
        """Whether everything the node's subgraphs (If branches, Loop and Scan bodies) read from outside is shared
        (a weight never is)."""
        return all(t not in self._st.src.weight_names and t in self._st.tensors and self._st.tensors[t][1].is_shared
                   for t in outer_reads(self.node))

    def passthrough(self) -> None:
        """Emit the node once, unchanged: every input is shared, so every model computes the same value (its
        subgraphs' outer reads, shared too, renamed to their fused names)."""
        ins = [self._st.tensors[t][0] if t else "" for t in self.node.input]
        outer = {t: self._st.tensors[t][0] for t in outer_reads(self.node)}
        attrs = {k: rename_outer(v, outer) if outer and isinstance(v, onnx.GraphProto) else v
                 for k, v in self.attrs().items()}
        outs = [self.out_name(j) if o else "" for j, o in enumerate(self.node.output)]
        self.emit(self.op_type, ins, outs, domain=self.node.domain, **attrs)
        for j, o in enumerate(outs):
            if o:
                self.set_output(j, o, SHARED)
        if self.op_type == "Constant" and not self.node.domain:
            value = _constant_value(self.node)
            if value is not None:
                self._st.consts[self.node.output[0]] = value

    def unset_outputs(self) -> list[int]:
        return [j for j, o in enumerate(self.node.output) if o and j not in self._outputs_set]


def fuse_aligned(aligned: AlignedModels, rules: Mapping[tuple[str, str], Rule], strict: bool = False,
                 per_model_inputs: set[str] = frozenset(), strategy: Strategy | None = None,
                 model_ids: Sequence[int] | None = None) -> FusionResult:
    """Run every node group through its rule in ``rules`` ((domain, op type) -> rule: the catalogue
    ``onnxfuse.core.rules.RULES``, or a test's own table); return the fused model (graph outputs in stacked(0)).

    A node whose op has no rule, or whose rule cannot fuse it, runs once per model (``NodeGroup.per_model``) unless
    ``strict``, which raises instead. The summary lists those nodes and the fused fraction. The engine knows no op:
    it only looks rules up in the table it is given.

    Where a rule offers several fused forms (``Rule.forms``), ``strategy`` picks one per node (default: each rule's
    first); the summary's ``forms`` lists every choice by node name (its first output's where it has none).
    """
    st = FusionState(aligned, per_model_inputs, model_ids)
    label = aligned.models[0].label
    counts = {"fused": 0, "shared": 0, "per_model": 0}
    unfused: list[dict] = []
    forms: dict[str, str] = {}
    for nodes in aligned.aligned:
        g = NodeGroup(st, nodes)
        node = g.node
        rule = rules.get(op_key(node))
        all_shared = all(g.is_shared(i) for i in range(len(node.input))) and g.outer_reads_shared()
        if all_shared and (rule is None or rule.shared_passthrough):
            with st.emitting("shared"):
                g.passthrough()
            counts["shared"] += 1
            continue
        reason = f"op type '{node.op_type}' has no fusion rule"
        if rule is not None:
            if rule.forms:
                g.form = rule.forms[0] if strategy is None else strategy(g, rule.forms)
                if g.form not in rule.forms:
                    raise ConfigError(f"the fusion strategy chose form '{g.form}' for node '{g.name}' "
                                      f"({node.op_type}), whose rule offers: {', '.join(rule.forms)}")
                forms[g.name] = g.form
            mark = st.checkpoint()
            try:
                rule.fuse(g)
                counts["fused"] += 1
                reason = None
            except RuleFailed as e:
                st.rollback(mark)  # forget whatever the rule emitted or packed before it gave up
                g = NodeGroup(st, nodes)
                forms.pop(g.name, None)
                reason = str(e)
        if reason is not None:
            if strict:
                if rule is None:
                    raise UnsupportedOpError(g.name, node.op_type, label, op_names(rules))
                raise NotFusibleError(f"{label}: node '{g.name}' ({node.op_type}) cannot be fused: {reason}")
            try:
                with st.emitting("per_model"):
                    g.per_model()
            except RuleFailed as e:
                raise NotFusibleError(f"{label}: node '{g.name}' ({node.op_type}) cannot be fused ({reason}) "
                                      f"nor run per model: {e}") from e
            counts["per_model"] += 1
            unfused.append({"node": g.name, "op_type": node.op_type, "reason": reason})
        missing = g.unset_outputs()
        if missing:
            raise NotFusibleError(
                f"internal error: the {node.op_type} rule left output(s) {missing} of node '{g.name}' unset"
            )
    per_model_work = counts["fused"] + counts["per_model"]
    model = _assemble(st)
    check_layouts(st, model)
    return FusionResult(model=model, weights=st.weights,
                        summary={"B": st.B, "nodes": len(aligned.aligned), **counts, "unfused": unfused,
                                 "fused_fraction": counts["fused"] / per_model_work if per_model_work else 1.0,
                                 "layout_changes": st.layout_changes, "fused_nodes": len(st.nodes),
                                 "forms": forms},
                        origins=dict(st.origins))


def check_layouts(st: FusionState, model: onnx.ModelProto) -> None:
    """Every fused tensor has the shape its layout promises: ``layout.fused_shape(original shape, B)``, checked
    against ONNX shape inference of the fused graph wherever both dims are known.

    A rule that emits an op whose output shape is not what the rule assumed (PRelu broadcasts its slope to x's
    shape only: a shared x made the output declared [N, ...] for a per-model value) makes ONNX Runtime compute
    with wrong buffer sizes or shapes at run time; this turns it into an error at fuse time naming the node."""
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    del bare.graph.value_info[:]  # what the nodes compute, not what the engine declared
    try:
        infer = functools.partial(onnx.shape_inference.infer_shapes, strict_mode=False)
        inferred = complete_shapes(infer(bare), infer).graph  # as the sources' shapes were (core/_shapes.py)
    except Exception:  # check_pass reports an invalid graph with its own message
        return
    shapes = {vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
              for vi in inferred.value_info if vi.type.tensor_type.HasField("shape")}
    producer = {o: n for n in st.src.nodes for o in n.output}
    for orig, (name, layout) in st.tensors.items():
        orig_shape = st.src.shapes.get(orig)
        got = shapes.get(name)
        if orig_shape is None or got is None:
            continue
        want = layout.fused_shape([d if isinstance(d, int) else None for d in orig_shape], st.B)
        if len(want) != len(got) or any(isinstance(w, int) and isinstance(g, int) and w != g
                                         for w, g in zip(want, got)):
            node = producer.get(orig)
            where = f"node '{node_label(node)}' ({node.op_type})" if node is not None else f"tensor '{orig}'"
            raise NotFusibleError(f"internal error: {where}: fused tensor '{name}' should be {layout} {want} but "
                                  f"has shape {got}; report it with the model; strict=True names the rule")


def _assemble(st: FusionState) -> onnx.ModelProto:
    """Graph outputs -> stacked(0) under their original names; build the ModelProto."""
    renames: dict[str, str] = {}
    outputs = []
    for vi in st.src.outputs:
        try:
            name = st.convert(vi.name, stacked(0))
        except RuleFailed as e:
            raise NotFusibleError(f"graph output '{vi.name}': {e}") from e
        producers = {o: n for n in st.nodes for o in n.output}
        if name in producers and name not in renames and name not in {v.name for v in st.src.inputs}:
            renames[name] = vi.name
        else:
            with st.emitting("output"):
                st.emit("Identity", [name], [vi.name])
        shape = st.src.shapes.get(vi.name) or tensor_shape(vi.type)  # inferred, else as the file declares it
        outputs.append(helper.make_tensor_value_info(
            vi.name, st.src.dtypes.get(vi.name, onnx.TensorProto.FLOAT),
            None if shape is None else [st.B] + [d if not (isinstance(d, str) and d.startswith("unk__")) else None
                                                 for d in shape]))
    for n in st.nodes:
        for k, t in enumerate(n.input):
            if t in renames:
                n.input[k] = renames[t]
        for k, t in enumerate(n.output):
            if t in renames:
                n.output[k] = renames[t]
    used = {t for n in st.nodes for t in n.input}
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in st.inits.items() if k in used]
    inputs = []
    for vi in st.src.inputs:
        if vi.name in st.per_model_inputs:
            shape = st.src.shapes.get(vi.name)
            vi = helper.make_tensor_value_info(vi.name, st.src.dtypes[vi.name], None if shape is None else [st.B] + shape)
        inputs.append(vi)
    graph = helper.make_graph(st.nodes, f"fused_{st.B}x_{st.src.model.graph.name or 'model'}", inputs, outputs, inits,
                              value_info=_fused_value_info(st, {o.name for o in outputs} | {i.name for i in inputs}))
    opsets = list(st.src.model.opset_import)
    imported = {"" if o.domain == "ai.onnx" else o.domain for o in opsets}
    for domain in dict.fromkeys(n.domain for n in st.nodes if n.domain not in imported | {"ai.onnx"}):
        opsets.append(helper.make_opsetid(domain, 1))  # a rule's own ops (e.g. the torch runtime's), version 1
    model = helper.make_model(graph, opset_imports=opsets, producer_name="onnxfuse")
    model.ir_version = min(st.src.model.ir_version, 10)
    return model


def _fused_value_info(st: FusionState, io: set[str]) -> list[onnx.ValueInfoProto]:
    """The shape of every fused tensor the graph computes, from its original's (which the static-value pass resolved
    where ONNX's inference cannot, e.g. a Reshape to [N, -1, 12]) and its layout, so that the fused graph knows
    what each source knew: the legalization and ONNX Runtime's gradient kernels need static shapes."""
    produced = {o for n in st.nodes for o in n.output if o}
    infos = []
    for orig, (name, layout) in st.tensors.items():
        shape, dtype = st.src.shapes.get(orig), st.src.dtypes.get(orig)
        if name in io or name not in produced or shape is None or dtype is None:
            continue
        dims = [d if isinstance(d, (int, str)) and not (isinstance(d, str) and d.startswith("unk__")) else None
                for d in shape]
        infos.append(helper.make_tensor_value_info(name, dtype, layout.fused_shape(dims, st.B)))
    return infos


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The value of a Constant node (any of its attribute forms), or None for sparse values."""
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if a.name == "value":
            return numpy_helper.to_array(v)
        if a.name in ("value_float", "value_floats"):
            return np.asarray(v, dtype=np.float32)
        if a.name in ("value_int", "value_ints"):
            return np.asarray(v, dtype=np.int64)
    return None
