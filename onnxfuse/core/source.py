"""Loading one source model: the graph with what is static at fuse time resolved, its shapes, and which initializers
are per-model weights."""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Collection

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxfuse.core._dynamo_file import DynamoFile, exporter_constants, read_dynamo_file, signature_trainable
from onnxfuse.core._facts import FOLD_LIMIT, GraphFacts
from onnxfuse.core._graph import Names, live_nodes, reads, rename_subgraph_reads
from onnxfuse.core._io import read_model
from onnxfuse.core._opset import onnx_opset
from onnxfuse.core._shapes import complete_shapes, onesided_stft_pass
from onnxfuse.core.errors import InputFileError
from onnxfuse.core.guesses import never_trained
from onnxfuse.core.windows import explicit_windows_pass

__all__ = ["SourceModel", "load_source", "check_every_input_defined", "check_shapes_agree", "resolve_static_pass",
           "weight_names", "METADATA_KEY", "LIKE_KEY", "FLOAT_TYPES", "tensor_shape", "np_dtype"]

# The exporter writes a JSON document under this metadata key: which initializers are trainable parameters,
# which are buffers, and the state_dict entries that are not in the graph (e.g. num_batches_tracked).
METADATA_KEY = "onnxfuse"
# Under it, ``like``: the torch factory the model was built by ({"factory": "MODULE:FACTORY", "args": {...}}), which
# `onnxfuse export` and `fuse --like` record (nothing reads it yet: verification against torch.optim on it is to come).
LIKE_KEY = "like"

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def tensor_shape(type_proto: onnx.TypeProto) -> list | None:
    """Dims of a tensor type: int for static, str for symbolic, None for unknown; None if the rank is unknown."""
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    dims = []
    for d in type_proto.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def np_dtype(elem_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))


@dataclass
class SourceModel:
    label: str
    model: onnx.ModelProto
    opset: int
    initializers: dict[str, onnx.TensorProto]
    inputs: list[onnx.ValueInfoProto]
    outputs: list[onnx.ValueInfoProto]
    shapes: dict[str, list]
    dtypes: dict[str, int]
    meta: dict
    weight_names: set[str] = field(default_factory=set)
    dynamo: DynamoFile | None = None  # torch's dynamo exporter's record of the file as read, if it has one
    _arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def nodes(self) -> list[onnx.NodeProto]:
        return list(self.model.graph.node)

    def array(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self.initializers[name])
        return self._arrays[name]

    @functools.cached_property
    def trainable(self) -> set[str] | None:
        """Names the exporter marked trainable: onnxfuse's metadata, or a dynamo-exported file's graph signature (its
        weights but the module's buffers); None when the file says neither (every weight is trained)."""
        t = self.meta.get("trainable")
        return set(t) if t is not None else signature_trainable(self.dynamo, self.weight_names)

    @functools.cached_property
    def never_trained(self) -> dict[str, str]:
        """Weights no run trains whatever the file says, with why (non-finite values; what the producer writes as
        an initializer that is a constant): :func:`~onnxfuse.core.guesses.never_trained`."""
        return never_trained(self.model, self.weight_names, self.array)


def _metadata(proto: onnx.ModelProto, label: str = "model") -> dict:
    for p in proto.metadata_props:
        if p.key == METADATA_KEY:
            try:
                return json.loads(p.value)
            except json.JSONDecodeError as e:
                raise InputFileError(f"{label}: metadata '{METADATA_KEY}' is not valid JSON") from e
    return {}


def weight_names(proto: onnx.ModelProto, meta: dict | None = None) -> set[str]:
    """The initializers that differ per model: the exporter's trainable parameters and buffers, or, in a file
    without onnxfuse metadata, every floating-point initializer but those a dynamo-exported file's record shows are
    constants of the forward's code (ReLU6's Clip bounds: :func:`~onnxfuse.core._dynamo_file.exporter_constants`)."""
    meta = _metadata(proto) if meta is None else meta
    inits = {t.name: t for t in proto.graph.initializer}
    if "trainable" in meta or "buffers" in meta:
        return (set(meta.get("trainable", [])) | set(meta.get("buffers", []))) & set(inits)
    return {n for n, t in inits.items() if t.data_type in FLOAT_TYPES} - exporter_constants(proto)


_RESOLVE_ROUNDS = 10


def resolve_static_pass(model: onnx.ModelProto, weights: Collection[str] | None = None) -> onnx.ModelProto:
    """Resolve what is static at fuse time, so that rules see constants and static shapes instead of arithmetic.

    - Every tensor whose value follows from constants and static dims alone (shape arithmetic such as Shape ->
      Gather -> Div -> Unsqueeze -> Concat, Range, ConstantOfShape; see :class:`GraphFacts`) becomes a Constant
      node, and the nodes that only computed it are dropped.
    - A Reshape whose output ONNX's shape inference leaves unknown next to the symbolic batch (``view(N, T, -1)``)
      gets its output shape recorded as value_info (:meth:`GraphFacts.reshape_shape`).

    Repeats until nothing changes: a folded target makes a Reshape's output static, which makes more Shape entries
    static. What depends on a symbolic dim (the batch N) or on a weight (``weights``, default
    :func:`weight_names`) stays computed, so the model computes the same function for every batch size and B models
    identical up to weights stay identical.

    Every round begins with :func:`~onnxfuse.core.windows.explicit_windows_pass`, because a fold reads inferred shapes
    and a window node's shape is not final until that pass has rewritten it: ONNX's inference of a ceil-mode pool
    counts a last window that starts in the end padding, torch (and the rewritten node) does not. E.g. L = 3, k = s
    = 2, pads (1, 1): ceil((3 + 2 - 2)/2) + 1 = 3 windows, the third covering [2*2 - 1, 5) = [3, 5), all padding,
    so torch has 2; a constant folded from the 3 (``flatten``'s Reshape target ``[N, -1, 4, 3]`` for an output
    ``[N, 4, 4, 4, 2]``) would outlive the rewrite. The pass rewrites a node as soon as its input's spatial dims
    are static, read from the same inference as the facts, and ONNX infers an output's spatial dims only from
    static input dims: so no round folds from a shape the pass will still change. It runs once more after the
    last round, for a window whose input that round made static.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    weights = weight_names(out) if weights is None else set(weights)
    opset = onnx_opset(out)
    for _ in range(_RESOLVE_ROUNDS):
        windowed = explicit_windows_pass(out)
        changed = int(windowed is not out)
        out, g = windowed, windowed.graph
        facts = GraphFacts(out, opset, variable=weights)
        names = Names.of(g)
        nodes = []
        for node in g.node:
            taken = _taken_branch(node, facts, names, g)
            if taken is not None:  # an If whose condition is static: the branch it takes, in its place
                nodes.extend(taken)
                changed += 1
                continue
            values = _static_outputs(node, facts)
            if values is None:
                nodes.append(node)
                shape = facts.reshape_shape(node) if node.op_type == "Reshape" and not node.domain else None
                if shape is not None and _adds_static_dims(shape, facts.shape(node.output[0])):
                    _set_value_info(g, helper.make_tensor_value_info(node.output[0], facts.dtype(node.output[0]),
                                                                     shape))
                    changed += 1
                continue
            changed += 1
            for o, v in values.items():
                nodes.append(helper.make_node("Constant", [], [o], name=f"{node.name or node.op_type}/static",
                                              value=numpy_helper.from_array(np.asarray(v), o)))
        del g.node[:]
        g.node.extend(nodes)
        if not changed:
            break
    out = explicit_windows_pass(out)
    g = out.graph
    keep = live_nodes(g)
    del g.node[:]
    g.node.extend(keep)
    produced = {o for n in keep for o in n.output}
    infos = [vi for vi in g.value_info if vi.name in produced]
    del g.value_info[:]
    g.value_info.extend(infos)
    return out


def _taken_branch(node: onnx.NodeProto, facts: GraphFacts, names: Names, g: onnx.GraphProto
                  ) -> list[onnx.NodeProto] | None:
    """The nodes of the branch an ``If`` takes when its condition is static (torch's export of
    ``scatter_reduce`` at opset 18 branches on the index's static size), renamed into the graph (its
    initializers moved into it) and writing the If's outputs; None for any other node. A fused graph then holds no
    If whose branches only the export needed."""
    if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
        return None
    cond = facts.constant(node.input[0])
    if cond is None or cond.size != 1:
        return None
    branch = next(a.g for a in node.attribute if a.name == ("then_branch" if bool(cond.reshape(-1)[0])
                                                             else "else_branch"))
    local = {t.name for t in branch.initializer} | {o for n in branch.node for o in n.output if o}
    rename = {t: names.fresh(f"{node.name or node.op_type}/{t}") for t in sorted(local)}
    for t in branch.initializer:
        moved = onnx.TensorProto()
        moved.CopyFrom(t)
        moved.name = rename[t.name]
        g.initializer.append(moved)
    out = []
    for n in branch.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        copy.input[:] = [rename.get(t, t) for t in n.input]
        copy.output[:] = [rename.get(t, t) for t in n.output]
        rename_subgraph_reads(copy, rename)  # a nested subgraph reads the branch's names: their new ones
        copy.name = names.fresh(f"{node.name or node.op_type}/{n.name or n.op_type}")
        out.append(copy)
    for result, o in zip(branch.output, node.output):  # the branch's results become the If's outputs
        if o:
            out.append(helper.make_node("Identity", [rename.get(result.name, result.name)], [o],
                                        name=names.fresh(f"{node.name or node.op_type}/result")))
    return out


def _set_value_info(g: onnx.GraphProto, vi: onnx.ValueInfoProto) -> None:
    kept = [v for v in g.value_info if v.name != vi.name]
    del g.value_info[:]
    g.value_info.extend(kept + [vi])


def _adds_static_dims(new: list, old: list | None) -> bool:
    """``new`` knows a dim ``old`` does not, and contradicts none."""
    if old is None:
        return any(isinstance(d, int) for d in new)
    if len(new) != len(old) or any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(new, old)):
        return False
    return any(isinstance(a, int) and not isinstance(b, int) for a, b in zip(new, old))


def _static_outputs(node: onnx.NodeProto, facts: GraphFacts) -> dict[str, np.ndarray] | None:
    """{output: value} when every used output of ``node`` is static (and it is not a Constant already)."""
    if node.op_type == "Constant" or node.domain not in ("", "ai.onnx") or any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return None
    used = [o for o in node.output if facts.is_used(o)]
    if not used:
        return None
    values = {o: facts.constant(o) for o in used}
    if any(v is None or v.size > FOLD_LIMIT for v in values.values()):
        return None
    return values


def check_shapes_agree(source: SourceModel) -> None:
    """``source``'s shapes agree with each other under ONNX's strict shape inference; else one InputFileError
    naming the model and the node inference stopped at. ``load_source`` infers leniently (an op it cannot infer
    is no error), so this is asked only once the fused graph fails onnx's checker: a model whose input shape its
    weights cannot take (a dimension of 10**12 where the weights expect 48) is the user's to fix, not an internal
    error."""
    try:
        onnx.shape_inference.infer_shapes(source.model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:
        first = " ".join(str(e).split())[:300]
        raise InputFileError(f"{source.label}: the model's shapes do not agree ({first}); check its input shapes "
                             "against what its weights take, and re-export it") from e


def check_every_input_defined(proto: onnx.ModelProto, label: str) -> None:
    """Every tensor a node of the main graph reads (its inputs and its subgraphs' outer-scope reads) is a graph
    input, an initializer or some node's output; else one InputFileError naming ``label``, the node and the
    tensor. onnx's checker reports a tensor defined nowhere as "Nodes in a graph must be topologically sorted",
    which sends the user looking for an ordering problem; the usual cause is a file without its weights (an
    array's ``sources/`` graphs, a model saved without its initializers)."""
    g = proto.graph
    defined = {i.name for i in g.input} | {t.name for t in g.initializer} | \
        {t.values.name for t in g.sparse_initializer} | {o for n in g.node for o in n.output} | {""}
    for node in g.node:
        missing = [x for x in reads(node) if x not in defined]
        if missing:
            lacks = "a tensor" if g.initializer else "its weights"
            raise InputFileError(
                f"{label}: node '{node.name or node.op_type}' ({node.op_type}) reads '{missing[0]}', which is neither "
                f"a graph input, an initializer nor any node's output: the file lacks {lacks} (an array's sources/ "
                "hold graphs without their weights); give the model as exported, with its initializers")


def load_source(model: str | os.PathLike | onnx.ModelProto, label: str | None = None) -> SourceModel:
    """Load, check, resolve (:func:`resolve_static_pass`, which also makes window padding explicit:
    :func:`~onnxfuse.core.windows.explicit_windows_pass`) and shape-infer one model. ``label`` names it in error
    messages (default: file name)."""
    proto, label = read_model(model, label)
    check_every_input_defined(proto, label)
    try:
        onnx.checker.check_model(proto)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputFileError(f"{label}: not a valid ONNX model: {first}") from e
    opset = onnx_opset(proto, label)  # one onnxfuse reads: read_model checked it (_opset.MIN_OPSET, MAX_OPSET)
    meta = _metadata(proto, label)
    weights = weight_names(proto, meta)
    dynamo = None if meta else read_dynamo_file(proto)  # read before any pass rewrites a node
    proto = resolve_static_pass(proto, weights)  # window padding made explicit too, before any fold reads it
    proto = onesided_stft_pass(proto)  # a shape onnx's inference gets wrong, made explicit (core/_shapes.py)
    try:
        infer = functools.partial(onnx.shape_inference.infer_shapes, strict_mode=False, data_prop=True)
        inferred = complete_shapes(infer(proto), infer)  # and the shapes inference leaves out (core/_shapes.py)
    except Exception as e:
        raise InputFileError(f"{label}: ONNX shape inference failed ({str(e).splitlines()[0]})") from e
    g = inferred.graph
    inits = {t.name: t for t in proto.graph.initializer}
    shapes: dict[str, list] = {}
    dtypes: dict[str, int] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        s = tensor_shape(vi.type)
        if s is not None:
            shapes[vi.name] = s
        if vi.type.HasField("tensor_type"):
            dtypes[vi.name] = vi.type.tensor_type.elem_type
    for t in proto.graph.initializer:
        shapes[t.name] = [int(d) for d in t.dims]
        dtypes[t.name] = t.data_type
    return SourceModel(
        label=label,
        model=proto,
        opset=opset,
        initializers=inits,
        inputs=[i for i in proto.graph.input if i.name not in inits],
        outputs=list(proto.graph.output),
        shapes=shapes,
        dtypes=dtypes,
        meta=meta,
        weight_names=weights,
        dynamo=dynamo,
    )
