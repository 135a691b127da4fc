"""The graph a placer sees: ONNX nodes as tasks, tensors as the data on their edges, with sizes, costs and memory.

    task i        one ONNX node; cost w_i = its profiled kernel time, or estimated from FLOPs and bytes
    edge p -> c   the tensors p writes that c reads; bytes(t) = prod(shape(t)) * itemsize(dtype(t))
    memory        on a device d holding the nodes P_d (what every placer enforces, see ``MemoryLedger``):

        M_d = f * sum(bytes(w) for weights w read on d)        f = 1 to run the graph as it is,
            + sum(bytes(x) for graph inputs x read on d)          f = 2 + k to train it: weight, gradient and
            + sum(bytes(t) for tensors t written on d)            k optimizer slots (AdamW 2, momentum 1)
            + sum(bytes(t) for tensors t received by d)

      Every tensor written is counted as kept for the whole step: that is what training keeps for the backward
      pass, and an upper bound of what inference holds at once (the simulator reports the live peak too).

      This is not array sizing's question (``measure/sizing.py``'s ``estimate_step_memory``: the bytes
      of a whole array's training step on one device, from its spec: buffers apart from parameters, the
      optimizer update's temporaries); the two share f, ``sizing.training_weight_factor``, and the optimizer's
      slots k, the registered optimizer's (``optimizer_state_slots``).

Shapes come from ONNX shape inference after the graph inputs' symbolic dimensions are bound (``batch_size`` for
the first axis, ``dims`` by name); tensors it cannot type (e.g. com.microsoft gradient ops in a training graph)
are measured by running the graph once with onnxruntime.
"""
from __future__ import annotations

import importlib
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from onnxfuse.core._facts import GraphFacts
from onnxfuse.core._graph import name_nodes
from onnxfuse.core._graph import reads as graph_reads
from onnxfuse.core._io import read_model
from onnxfuse.core._opset import onnx_opset
from onnxfuse.core.errors import ConfigError
from onnxfuse.core.standard import standard_onnx
from onnxfuse.core.source import check_every_input_defined
from onnxfuse.measure.sizing import training_weight_factor
from onnxfuse.placement.orders import CycleError, Dag, check_acyclic

__all__ = ["TensorInfo", "PlacementGraph", "build_graph", "bind_dims", "example_feeds",
           "estimate_flops", "name_nodes", "union_graph", "MOMENTUM", "optimizer_names", "optimizer_state_slots"]

MOMENTUM = "momentum"  # SGD with momentum: the name placement gives it beside the registered optimizers


def _registered() -> dict:
    """The optimizer registry (onnxfuse/recipe/settings.py), with the built-in optimizers in it: recipe/optim.py
    registers them when imported."""
    importlib.import_module("onnxfuse.recipe.optim")
    from onnxfuse.recipe.settings import OPTIMIZERS

    return OPTIMIZERS


def optimizer_names() -> list[str]:
    """The optimizers whose training memory placement plans: every registered one, and ``momentum``."""
    return list(_registered()) + [MOMENTUM]


def optimizer_state_slots(optimizer: str | int) -> int:
    """State buffers per weight that training with ``optimizer`` keeps: a number as it is; a registered optimizer's
    (``Optimizer.state_slots``: its maths at the default hyper-parameters, onnxfuse/recipe/optim.py); ``momentum``:
    SGD's with momentum."""
    if isinstance(optimizer, int) and not isinstance(optimizer, bool) and optimizer >= 0:
        return optimizer
    registry = _registered()
    if optimizer == MOMENTUM:
        from onnxfuse.recipe.optim import make_optimizer

        return len(make_optimizer("sgd", 1, momentum=0.9).state_names())
    if optimizer not in registry:
        raise ConfigError(f"optimizer: unknown optimizer '{optimizer}'; choose from {', '.join(optimizer_names())}, "
                          "or give its number of state buffers per weight")
    return registry[optimizer].state_slots()

# ops that move or reinterpret data without arithmetic
_MOVES = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose", "Concat", "Split", "Slice",
          "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Pad", "Cast", "CastLike", "ScatterND",
          "ScatterElements", "DepthToSpace", "SpaceToDepth", "ConcatTraining", "SplitTraining", "Dropout"}
# ops whose output is metadata or a view: neither FLOPs nor real traffic
_FREE = {"Shape", "Size", "Constant", "ConstantOfShape", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"}
_TRANSCENDENTAL = {"Exp", "Log", "Tanh", "Sigmoid", "Erf", "Gelu", "FastGelu", "Softplus", "Softsign", "Mish", "Sin",
                   "Cos", "Pow", "Sqrt", "Reciprocal", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish",
                   "BiasGelu", "GeluGrad", "BiasGeluGrad_dX", "FastGeluGrad", "TanhGrad", "SigmoidGrad"}
_NORMS = {"BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization",
          "SimplifiedLayerNormalization", "LayerNormalizationGrad", "BatchNormalizationGrad",
          "InstanceNormalizationGrad", "SimplifiedLayerNormalizationGrad", "SkipLayerNormalization"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the graph: its size and who writes and reads it."""

    name: str
    nbytes: int
    shape: tuple[int, ...] | None
    dtype: str                 # numpy dtype name
    kind: str                  # "input" (fed each step), "weight" (initializer) or "activation" (a node writes it)
    producer: int | None
    consumers: tuple[int, ...]


@dataclass
class PlacementGraph:
    """An ONNX graph as tasks and data, ready for placers and the simulator.

    ``model`` is the ONNX model with unique node names and bound input shapes (None for a union of graphs).
    ``measured_s[i]``, when present, is node i's profiled kernel time on the reference machine.
    """

    model: onnx.ModelProto | None
    label: str
    names: list[str]
    op_types: list[str]
    inputs: list[list[str]]        # tensors each node reads (unique, in first-use order)
    outputs: list[list[str]]       # tensors each node writes
    tensors: dict[str, TensorInfo]
    graph_inputs: list[str]
    graph_outputs: list[str]
    flops: list[float]
    bytes_accessed: list[float]
    training: bool = False         # plan memory for training this (forward) graph
    optimizer_slots: int = 2
    kind: str = "forward"          # "forward" or "training graph" (it already holds its backward pass)
    measured_s: list[float] | None = None
    dag: Dag = field(init=False, repr=False)

    def __post_init__(self) -> None:
        edges = []
        for c, ins in enumerate(self.inputs):
            for t in ins:
                p = self.tensors[t].producer
                if p is not None and p != c:
                    edges.append((p, c))
        self.dag = Dag.from_edges(self.names, edges)
        check_acyclic(self.dag)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def weight_factor(self) -> float:
        """Bytes held per weight byte: 1 to run the graph; to train it, the weight, its gradient and the optimizer
        slots (:func:`~onnxfuse.measure.sizing.training_weight_factor`, the rule array sizing counts by)."""
        return float(training_weight_factor(self.optimizer_slots)) if self.training else 1.0

    def edge_tensors(self, p: int, c: int) -> list[str]:
        """Tensors node p writes that node c reads."""
        return [t for t in self.outputs[p] if t in self.tensors and c in self.tensors[t].consumers]

    def edge_bytes(self, p: int, c: int) -> int:
        return sum(self.tensors[t].nbytes for t in self.edge_tensors(p, c))

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values() if t.kind == "weight")

    def summary(self) -> dict:
        return {"label": self.label, "kind": self.kind, "nodes": len(self), "edges": sum(map(len, self.dag.succs)),
                "weight_bytes": self.weight_bytes, "flops": sum(self.flops),
                "measured_s": None if self.measured_s is None else sum(self.measured_s),
                "training": self.training}


def bind_dims(model: onnx.ModelProto, batch_size: int | None = None,
              dims: Mapping[str, int] | None = None) -> onnx.ModelProto:
    """Fix every symbolic dimension of the graph inputs, in place: a named one from ``dims``, else the first free
    one of each input (the batch: axis 0, or axis 1 of a per-model input [B, N, ...]) from ``batch_size``."""
    dims = dict(dims or {})
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        first_free = True
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                continue
            param = d.dim_param if d.HasField("dim_param") else ""
            if param and param in dims:
                value = dims[param]
            elif first_free and batch_size is not None:  # [N, ...], or [B, N, ...] for a per-model input
                value = batch_size
            else:
                hint = f"dims={{{param!r}: VALUE}}" if param else "batch_size=N" if first_free else "dims="
                raise ConfigError(f"graph input '{vi.name}' has a free dimension "
                                  f"{repr(param) if param else '(unnamed)'} on axis {axis}; give its size with {hint}")
            first_free = False
            d.Clear()
            d.dim_value = int(value)
    # value_info stays: onnxruntime 1.19 crashes on a training graph whose contrib-op outputs lost their types,
    # and shape inference replaces its symbolic dims where it can
    return model


def _static_shape(type_proto: onnx.TypeProto) -> tuple[int, ...] | None:
    if not type_proto.HasField("tensor_type") or not type_proto.tensor_type.HasField("shape"):
        return None
    out = []
    for d in type_proto.tensor_type.shape.dim:
        if not d.HasField("dim_value"):
            return None
        out.append(int(d.dim_value))
    return tuple(out)


def _inferred_types(model: onnx.ModelProto, label: str = "the model"
                    ) -> dict[str, tuple[int, tuple[int, ...] | None]]:
    """{tensor: (elem_type, static shape or None)} from the graph's facts (ONNX shape inference, partial results
    kept)."""
    facts = GraphFacts(model, onnx_opset(model, label))
    if facts.inference_error:  # a custom-domain op can stop inference; the runtime fills the rest
        warnings.warn(f"ONNX shape inference failed ({facts.inference_error}); sizes come from a run")
    out: dict[str, tuple[int, tuple[int, ...] | None]] = {}
    for name, elem in facts.dtypes.items():
        shape = facts.shapes.get(name)
        out[name] = (elem, tuple(shape) if shape is not None and all(isinstance(d, int) for d in shape) else None)
    return out


def example_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """One array per graph input of a model with bound shapes: floats ~ N(0, 1), integers 0 (a valid index and
    class label), booleans False."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        shape = _static_shape(vi.type)
        if shape is None:
            raise ConfigError(f"graph input '{vi.name}' has no static shape; bind it with batch_size= or dims=")
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
        if dtype.kind == "f":
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[vi.name] = np.zeros(shape, dtype=bool)
        else:
            feeds[vi.name] = np.zeros(shape, dtype=dtype)
    return feeds


_PROFILE_DTYPES = {"float": "float32", "double": "float64", "float16": "float16", "bfloat16": "float32",
                   "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8",
                   "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "bool": "bool"}


def _runtime_types(model: onnx.ModelProto, names: Sequence[str], feeds: Mapping[str, np.ndarray]
                   ) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Types of ``names`` from one profiled onnxruntime run: its node events list every output's dtype and shape
    (the graph is run as it is; adding untyped graph outputs instead can crash onnxruntime 1.19)."""
    import json
    import tempfile

    from onnxfuse.placement.session import make_session

    wanted = set(names)
    by_node = {n.name: [t for t in n.output if t] for n in model.graph.node}
    found: dict[str, tuple[int, tuple[int, ...]]] = {}
    with tempfile.TemporaryDirectory(prefix="onnxfuse-shapes-") as tmp:
        sess = make_session(model, profile_prefix=os.path.join(tmp, "shapes"))
        sess.run([o.name for o in sess.get_outputs()], {k: np.array(v, copy=True) for k, v in feeds.items()})
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        outs = by_node.get(e["name"][: -len("_kernel_time")], [])
        shapes = e.get("args", {}).get("output_type_shape", [])
        if len(shapes) != len(outs):
            continue
        for t, ts in zip(outs, shapes):
            (kind, dims), = ts.items()
            if t in wanted and kind in _PROFILE_DTYPES:
                elem = helper.np_dtype_to_tensor_dtype(np.dtype(_PROFILE_DTYPES[kind]))
                found[t] = (elem, tuple(int(d) for d in dims))
    return found


def _numel(shape: tuple[int, ...] | None) -> float:
    return float(math.prod(shape)) if shape is not None else 0.0


def estimate_flops(op_type: str, in_shapes: Sequence[tuple[int, ...] | None],
                   out_shapes: Sequence[tuple[int, ...] | None], attrs: Mapping[str, object]) -> float:
    """Floating-point operations of one node (multiply-add = 2), from its shapes:

        Conv          2 * |Y| * Cin/g * prod(kernel)       (W = [Cout, Cin/g, k...])
        ConvTranspose 2 * |X| * Cout/g * prod(kernel)      (W = [Cin, Cout/g, k...])
        ConvGrad      2 * Conv(dY, W)                       (dX and dW)
        MatMul, Gemm  2 * |Y| * K
        pooling       |Y| * prod(kernel);  norms 5 * |X|;  softmax, reductions 3 * |X|
        exp/tanh/...  4 * |Y|;  other elementwise |Y|;  data movement 0
    """
    ins = list(in_shapes) + [None] * 3
    y = out_shapes[0] if out_shapes else None
    if op_type in _MOVES or op_type in _FREE:
        return 0.0
    if op_type == "Conv" and ins[1] is not None:
        return 2.0 * _numel(y) * _numel(ins[1][1:])
    if op_type == "ConvTranspose" and ins[1] is not None:
        return 2.0 * _numel(ins[0]) * _numel(ins[1][1:])
    if op_type == "ConvGrad" and ins[2] is not None:  # inputs dY, X, W
        return 2.0 * 2.0 * _numel(ins[0]) * _numel(ins[2][1:])
    if op_type in ("MatMul", "FusedMatMul", "MatMulInteger") and ins[0] is not None and ins[0]:
        return 2.0 * _numel(y) * ins[0][-1]
    if op_type == "Gemm" and ins[0] is not None and len(ins[0]) == 2:
        k = ins[0][0] if attrs.get("transA") else ins[0][1]
        return 2.0 * _numel(y) * k + _numel(y)
    if op_type in ("MaxPool", "AveragePool", "LpPool", "MaxPoolGrad", "AveragePoolGrad"):
        kernel = attrs.get("kernel_shape") or []
        return _numel(y if op_type.endswith("Pool") else ins[0]) * float(math.prod(kernel) if kernel else 1)
    if op_type in _NORMS:
        return 5.0 * _numel(ins[0])
    if op_type.startswith(("Reduce", "Global", "Softmax", "LogSoftmax", "ArgM")) or "CrossEntropy" in op_type:
        return 3.0 * _numel(ins[0])
    if op_type in _TRANSCENDENTAL:
        return 4.0 * _numel(y)
    return max(_numel(y), max((_numel(s) for s in in_shapes), default=0.0))


def _attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        if a.type in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS, onnx.AttributeProto.FLOAT,
                      onnx.AttributeProto.STRING):
            out[a.name] = helper.get_attribute_value(a)
    return out


def _is_training_graph(model: onnx.ModelProto) -> bool:
    return any(n.op_type.endswith("Grad") or n.op_type.startswith("InPlaceAccumulator") for n in model.graph.node)


def build_graph(model: str | os.PathLike | onnx.ModelProto, *, label: str | None = None,
                batch_size: int | None = None, dims: Mapping[str, int] | None = None,
                feeds: Mapping[str, np.ndarray] | None = None, training: bool = False,
                optimizer: str | int = "adamw", run_for_shapes: bool = True) -> PlacementGraph:
    """The placement graph of an ONNX model (single, fused, or a training graph with its backward pass).

    ``training`` plans memory for training a forward graph (weights x (2 + optimizer slots); ``optimizer``: a
    number of state buffers per weight, or an optimizer's name: ``optimizer_names``). Tensors whose
    shape inference cannot give are measured by one onnxruntime run with ``feeds`` (random ones by default)
    unless ``run_for_shapes`` is False (they then count 0 bytes, with a warning).
    """
    source, label = read_model(model, label)  # the loader and the labels of fusing (core/source.py)
    check_every_input_defined(source, label)
    slots = optimizer_state_slots(optimizer)
    proto = standard_onnx(source)  # a fused array's torch-runtime nodes (a batched recurrence) as onnxruntime runs them
    name_nodes(proto)
    bind_dims(proto, batch_size, dims)
    g = proto.graph
    names, ops, ins, outs = [], [], [], []
    producer: dict[str, int] = {}
    for i, node in enumerate(g.node):
        names.append(node.name)
        ops.append(node.op_type)
        reads: list[str] = []
        for t in graph_reads(node):
            if t and t not in reads:
                reads.append(t)
        ins.append(reads)
        outs.append([t for t in node.output if t])
        for t in outs[-1]:
            producer[t] = i
    # a cycle first (one line naming it): shape inference and onnxruntime would only say "not acyclic"
    try:
        check_acyclic(Dag.from_edges(names, [(producer[t], c) for c, reads in enumerate(ins) for t in reads
                                             if t in producer and producer[t] != c]))
    except CycleError as e:
        raise CycleError(f"{label}: {e}") from None
    types = _inferred_types(proto, label)
    init_names = {t.name for t in g.initializer}
    graph_inputs = [vi.name for vi in g.input if vi.name not in init_names]
    produced = [t for n in g.node for t in n.output if t]
    missing = [t for t in produced if t not in types or types[t][1] is None]
    if missing:
        if run_for_shapes:
            try:
                types.update(_runtime_types(proto, missing, feeds if feeds is not None else example_feeds(proto)))
            except ImportError:
                warnings.warn(f"{label}: onnxruntime is not installed; {len(missing)} tensors without a static "
                              "shape count as 0 bytes")
        else:
            warnings.warn(f"{label}: {len(missing)} tensors have no static shape and count as 0 bytes")

    consumers: dict[str, list[int]] = {}
    for i, reads in enumerate(ins):
        for t in reads:
            consumers.setdefault(t, []).append(i)
    tensors: dict[str, TensorInfo] = {}
    for t in set(consumers) | set(producer) | set(graph_inputs):
        elem, shape = types.get(t, (onnx.TensorProto.FLOAT, None))
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem)) if elem else np.dtype("float32")
        kind = "weight" if t in init_names else "activation" if t in producer else "input"
        nbytes = int(_numel(shape) * dtype.itemsize) if shape is not None else 0
        tensors[t] = TensorInfo(t, nbytes, shape, dtype.name, kind, producer.get(t), tuple(consumers.get(t, ())))
    flops, traffic = [], []
    for i, node in enumerate(g.node):
        in_shapes = [tensors[t].shape if t in tensors else None for t in node.input]
        out_shapes = [tensors[t].shape if t in tensors else None for t in node.output]
        flops.append(estimate_flops(node.op_type, in_shapes, out_shapes, _attrs(node)))
        moved = 0.0 if node.op_type in _FREE else float(
            sum(tensors[t].nbytes for t in ins[i]) + sum(tensors[t].nbytes for t in outs[i]))
        traffic.append(moved)
    kind = "training graph" if _is_training_graph(proto) else "forward"
    return PlacementGraph(
        model=proto, label=label, names=names, op_types=ops, inputs=ins, outputs=outs, tensors=tensors,
        graph_inputs=graph_inputs, graph_outputs=[o.name for o in g.output], flops=flops, bytes_accessed=traffic,
        training=training and kind == "forward", optimizer_slots=slots, kind=kind,
    )


def union_graph(graphs: Sequence[PlacementGraph], prefixes: Sequence[str], label: str) -> PlacementGraph:
    """Independent graphs side by side (no edges between them), names prefixed: how sharded sub-arrays are
    simulated together."""
    names, ops, ins, outs, tensors, gin, gout, flops, traffic, measured = [], [], [], [], {}, [], [], [], [], []
    for g, pre in zip(graphs, prefixes):
        base = len(names)
        names += [pre + n for n in g.names]
        ops += g.op_types
        ins += [[pre + t for t in r] for r in g.inputs]
        outs += [[pre + t for t in w] for w in g.outputs]
        for t in g.tensors.values():
            tensors[pre + t.name] = TensorInfo(pre + t.name, t.nbytes, t.shape, t.dtype, t.kind,
                                               None if t.producer is None else base + t.producer,
                                               tuple(base + c for c in t.consumers))
        gin += [pre + t for t in g.graph_inputs]
        gout += [pre + t for t in g.graph_outputs]
        flops += g.flops
        traffic += g.bytes_accessed
        measured += g.measured_s if g.measured_s is not None else [math.nan] * len(g)
    first = graphs[0]
    return PlacementGraph(
        model=None, label=label, names=names, op_types=ops, inputs=ins, outputs=outs, tensors=tensors,
        graph_inputs=gin, graph_outputs=gout, flops=flops, bytes_accessed=traffic, training=first.training,
        optimizer_slots=first.optimizer_slots, kind=first.kind,
        measured_s=None if any(g.measured_s is None for g in graphs) else measured,
    )
