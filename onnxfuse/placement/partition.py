"""Split a placed graph into ONNX sub-models that onnxruntime sessions can run one after another.

One session call cannot pause half-way to wait for another device, so a device whose nodes alternate with
another device's (d0 -> d1 -> d0) needs more than one sub-model. Nodes are grouped into *stages*:

    stage(i) = max over predecessors p of  stage(p) + [dev(p) != dev(i)]        (0 for a node without any)

and one sub-model holds the nodes of one (device, stage). Every edge between two sub-models goes from a lower
stage to a higher one, or stays on one device with stage(p) <= stage(c); so sub-models sorted by (stage, device)
are a valid execution order, and each device runs its own in increasing stage order without deadlock. A
placement that never comes back to a device has one stage per device: one sub-model per device.

A sub-model reads the tensors it needs from other stages as graph inputs, copies the weights it reads (a weight
read on two devices lives on both), and writes as graph outputs the tensors other stages or the caller need.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import onnx
from onnx import helper

from onnxfuse.core.errors import PlacementError
from onnxfuse.placement.graph import PlacementGraph
from onnxfuse.placement.orders import Dag, topological
from onnxfuse.placement.placers import Placement

__all__ = ["Stage", "Partition", "assign_stages", "partition_graph", "device_model", "save_partition"]


@dataclass
class Stage:
    """One sub-model: runs on ``device`` as its ``index``-th session call of a step.

    ``inputs`` maps the sub-model's input names to the keys of the values it reads (a tensor name, or a slice
    key of a sharded input); ``outputs`` maps its output names to the keys it publishes.
    """

    device: int
    index: int
    model: onnx.ModelProto
    inputs: dict[str, str]
    outputs: dict[str, str]
    nodes: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"device_{self.device}_stage_{self.index}"


@dataclass
class Partition:
    """Stages in a valid execution order, plus how graph inputs feed them and how graph outputs are formed.

    ``input_slices[key] = (graph input, b0, b1)`` feeds ``key`` with rows b0..b1 of a graph input (per-model
    inputs of a sharded array); ``output_concat[name] = [keys]`` forms a graph output by concatenating values
    along axis 0 (a sharded array's outputs); any other graph output is the value of the same key.
    """

    stages: list[Stage]
    graph_inputs: list[str]
    graph_outputs: list[str]
    n_devices: int
    input_slices: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    output_concat: dict[str, list[str]] = field(default_factory=dict)

    def stages_of(self, device: int) -> list[Stage]:
        return sorted((s for s in self.stages if s.device == device), key=lambda s: s.index)

    def to_json(self) -> list[dict]:
        return [{"device": s.device, "stage": s.index, "file": f"{s.label}.onnx", "nodes": len(s.nodes),
                 "inputs": sorted(s.inputs.values()), "outputs": sorted(s.outputs.values())} for s in self.stages]


def assign_stages(dag: Dag, device_of: Sequence[int]) -> list[int]:
    """stage(i) = max over predecessors p of stage(p) + [dev(p) != dev(i)]."""
    stage = [0] * len(dag)
    for i in topological(dag):
        stage[i] = max((stage[p] + (device_of[p] != device_of[i]) for p in dag.preds[i]), default=0)
    return stage


def _value_info(graph: PlacementGraph, name: str, key: str | None = None) -> onnx.ValueInfoProto:
    info = graph.tensors[name]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype))
    return helper.make_tensor_value_info(key or name, elem, list(info.shape) if info.shape is not None else None)


def _sub_model(graph: PlacementGraph, nodes: Sequence[int], needed_outside: set[str], title: str
               ) -> tuple[onnx.ModelProto, list[str], list[str]]:
    """The nodes as a model: reads what they do not write (weights become initializers), writes what is
    needed outside. Returns (model, input tensor names, output tensor names)."""
    src = graph.model
    if src is None:
        raise PlacementError(f"{graph.label}: this graph has no ONNX model to partition")
    written = {t for i in nodes for t in graph.outputs[i]}
    reads: list[str] = []
    for i in nodes:
        for t in graph.inputs[i]:
            if t not in written and t not in reads:
                reads.append(t)
    weights = {t for t in reads if graph.tensors[t].kind == "weight"}
    inputs = [t for t in reads if t not in weights]
    outputs = [t for i in nodes for t in graph.outputs[i] if t in needed_outside]
    inits = [t for t in src.graph.initializer if t.name in weights]
    protos = [src.graph.node[i] for i in sorted(nodes)]
    g = helper.make_graph(protos, title, [_value_info(graph, t) for t in inputs],
                          [_value_info(graph, t) for t in outputs], inits)
    # every internal tensor typed: onnxruntime 1.19 crashes on contrib ops (a training graph's gradients) whose
    # output types it has to infer itself
    g.value_info.extend(_value_info(graph, t) for t in sorted(written - set(outputs)) if t in graph.tensors)
    model = helper.make_model(g, opset_imports=list(src.opset_import), producer_name="onnxfuse.placement")
    model.ir_version = src.ir_version
    model.functions.extend(src.functions)
    return model, inputs, outputs


def partition_graph(graph: PlacementGraph, placement: Placement | Sequence[int], n_devices: int | None = None
                    ) -> Partition:
    """One sub-model per (device, stage) of a placement of ``graph`` (see the module docstring)."""
    device_of = list(placement.device_of if isinstance(placement, Placement) else placement)
    if len(device_of) != len(graph):
        raise PlacementError(f"{graph.label}: the placement has {len(device_of)} entries for {len(graph)} nodes")
    n_devices = n_devices or (max(device_of) + 1 if device_of else 1)
    stage = assign_stages(graph.dag, device_of)
    blocks: dict[tuple[int, int], list[int]] = {}
    for i in range(len(graph)):
        blocks.setdefault((stage[i], device_of[i]), []).append(i)
    outputs = set(graph.graph_outputs)
    block_of = {i: key for key, members in blocks.items() for i in members}
    stages: list[Stage] = []
    position: dict[int, int] = {}
    for (s, d), members in sorted(blocks.items()):
        needed = set(outputs)
        for i in members:
            for t in graph.outputs[i]:
                if any(block_of[c] != (s, d) for c in graph.tensors[t].consumers):
                    needed.add(t)
        index = position.get(d, 0)
        position[d] = index + 1
        model, ins, outs = _sub_model(graph, members, needed, f"device_{d}_stage_{index}")
        if not outs:  # nodes whose results nobody reads: nothing to run
            position[d] = index
            continue
        stages.append(Stage(d, index, model, {t: t for t in ins}, {t: t for t in outs}, members))
    return Partition(stages, list(graph.graph_inputs), list(graph.graph_outputs), n_devices)


def device_model(graph: PlacementGraph, device_of: Sequence[int], device: int) -> onnx.ModelProto | None:
    """All of one device's nodes as one ONNX model (inputs: what it receives; outputs: what it sends or the graph
    returns); None when the device holds no node. With one stage per device this is exactly what runs."""
    members = [i for i in range(len(graph)) if device_of[i] == device]
    if not members:
        return None
    needed = set(graph.graph_outputs)
    for i in members:
        for t in graph.outputs[i]:
            if any(device_of[c] != device for c in graph.tensors[t].consumers):
                needed.add(t)
    return _sub_model(graph, members, needed, f"device_{device}")[0]


def save_partition(partition: Partition, folder: str) -> list[str]:
    """Write every stage as ``device_{d}_stage_{k}.onnx``; returns the file names."""
    names = []
    for s in partition.stages:
        onnx.save(s.model, os.path.join(folder, f"{s.label}.onnx"))
        names.append(f"{s.label}.onnx")
    return names
