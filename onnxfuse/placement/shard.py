"""Model-axis sharding of a fused array: B models split into per-device sub-arrays, no edge between devices.

A fused array computes B independent models; nothing flows from model b to model b'. Cutting the model axis
gives each device a fused array of its own models,

    device k runs models b_k .. b_(k+1)-1  as one fused graph of B_k = b_(k+1) - b_k models,
    B_k proportional to device k's speed (equal devices: B/D each, the first B mod D devices one more),

and the array's outputs are the sub-arrays' outputs concatenated on the model axis. No tensor crosses devices
during the step (each device receives the batch, as every device reads graph inputs in this package's model).

**How a sub-array is built: by re-fusing, not by slicing.** Slicing the fused weights with the ArraySpec is exact
for the weights (every fused weight is model-major: block b of axis 0) but not enough for the graph, whose
attributes and constants encode B (``group = B*g`` of a grouped Conv, Reshape targets, Tile repeats, ...).
Re-fusing the weightless source graphs of the array folder (``ArrayDir.refuse``) with each model's weights, split
bit-exactly out of the fused model being placed (``onnxfuse.core.split.split_weights``), yields exactly the graph
``onnxfuse fuse`` makes for those models, through the same tested rules.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from onnxfuse.core.array import ArrayDir
from onnxfuse.core.errors import ConfigError, InputFileError, PlacementError
from onnxfuse.core.weights import ArraySpec
from onnxfuse.placement.devices import DeviceSpec
from onnxfuse.placement.graph import PlacementGraph, union_graph
from onnxfuse.placement.partition import Partition, Stage
from onnxfuse.placement.placers import Placement

__all__ = ["ArrayInfo", "find_array", "shard_groups", "sub_array_model", "Sharding", "shard_array",
           "shard_partition"]


@dataclass
class ArrayInfo:
    """A fused array on disk: its folder, spec, and the fused model whose weights are being placed."""

    folder: str
    spec: ArraySpec
    model: onnx.ModelProto
    _per_model: list[dict[str, np.ndarray]] | None = field(default=None, repr=False)

    @property
    def B(self) -> int:
        return self.spec.B

    @property
    def per_model_inputs(self) -> list[str]:
        return [i["name"] for i in self.spec.inputs if i.get("per_model")]

    def weights_of(self, b: int) -> dict[str, np.ndarray]:
        """Model b's original tensors, split exactly out of the fused model's initializers."""
        if self._per_model is None:
            from onnxfuse.core.split import split_weights

            fused = {t.name: numpy_helper.to_array(t) for t in self.model.graph.initializer}
            missing = [n for n in self.spec.weights if n not in fused]
            if missing:
                raise InputFileError(f"'{self.folder}': fused weight '{missing[0]}' is not in the fused model; "
                                     "re-run `onnxfuse fuse`")
            self._per_model = split_weights(self.spec, fused)
        return self._per_model[b]


def find_array(path: str | os.PathLike, model: onnx.ModelProto | None = None) -> ArrayInfo | None:
    """The array a path belongs to: ``ARRAY_DIR`` or ``ARRAY_DIR/fused.onnx`` with ``array.json`` beside it;
    None for any other model."""
    path = os.fspath(path)
    if os.path.isdir(path):
        array = ArrayDir(path)
        if not os.path.exists(array.spec_path):
            raise InputFileError(f"'{path}' is a folder without array.json; give an ONNX file or an array folder")
    else:
        array = ArrayDir.of_fused(path)
        if array is None:
            return None
    return ArrayInfo(array.path, array.load_spec(), model if model is not None else array.load_fused())


def shard_groups(B: int, devices: Sequence[DeviceSpec]) -> list[tuple[int, int, int]]:
    """(device, b0, b1): contiguous groups of models, sizes proportional to device speed (largest remainders
    first, ties to the lower device index); devices left without a model are not listed."""
    speeds = [d.speed for d in devices]
    total = sum(speeds)
    exact = [B * s / total for s in speeds]
    sizes = [math.floor(x) for x in exact]
    for k in sorted(range(len(devices)), key=lambda k: (-(exact[k] - sizes[k]), k))[: B - sum(sizes)]:
        sizes[k] += 1
    groups, b = [], 0
    for d, n in enumerate(sizes):
        if n:
            groups.append((d, b, b + n))
            b += n
    return groups


def sub_array_model(info: ArrayInfo, b0: int, b1: int) -> onnx.ModelProto:
    """The fused model of models b0..b1-1, re-fused from the array's source graphs and their split weights."""
    from onnxfuse.core.passes import fuse_models

    models = list(range(b0, b1))
    model, _ = ArrayDir(info.folder).refuse(models, [info.weights_of(b) for b in models], fuse_models,
                                            why="model-axis sharding re-fuses the array's source graphs")
    return model


@dataclass
class Sharding:
    """Sub-arrays, their placement graphs, and the union graph the simulator runs."""

    groups: list[tuple[int, int, int]]
    graphs: list[PlacementGraph]
    union: PlacementGraph
    placement: Placement
    per_model_inputs: list[str]
    label: str = "sharded"

    def distinct_graphs(self) -> list[PlacementGraph]:
        """One sub-array per size: sub-arrays of the same size are the same graph up to weights, so one profile
        serves them all (the same costs, rather than two noisy samples of them)."""
        seen: dict[int, PlacementGraph] = {}
        for (_, b0, b1), g in zip(self.groups, self.graphs):
            seen.setdefault(b1 - b0, g)
        return list(seen.values())

    def share_profiles(self) -> None:
        """Copy the profiled costs of ``distinct_graphs`` to their same-size twins and rebuild the union."""
        first: dict[int, PlacementGraph] = {}
        for (_, b0, b1), g in zip(self.groups, self.graphs):
            twin = first.setdefault(b1 - b0, g)
            if twin is not g and twin.measured_s is not None and twin.names == g.names:
                g.measured_s = list(twin.measured_s)
        self.union = union_graph(self.graphs, [f"shard{k}/" for k in range(len(self.graphs))], self.label)


def shard_array(info: ArrayInfo, devices: Sequence[DeviceSpec],
                build: Callable[[onnx.ModelProto, str, int, int], PlacementGraph]) -> Sharding:
    """Split the array over ``devices``; ``build(model, label, b0, b1)`` turns each sub-array into a placement
    graph (binding shapes the way the caller does for the whole array). To simulate with profiled costs,
    profile ``sharding.distinct_graphs()`` (best together with the whole array) and call
    ``sharding.share_profiles()``."""
    if info.B < 1:
        raise PlacementError(f"'{info.folder}': the array holds no model")
    groups = shard_groups(info.B, devices)
    graphs = [build(sub_array_model(info, b0, b1), f"models {b0}..{b1 - 1}", b0, b1) for _, b0, b1 in groups]
    label = f"{os.path.basename(info.folder)} sharded"
    union = union_graph(graphs, [f"shard{k}/" for k in range(len(groups))], label)
    device_of = [d for (d, _, _), g in zip(groups, graphs) for _ in range(len(g))]
    sizes = ", ".join(f"{devices[d].name}: {b1 - b0}" for d, b0, b1 in groups)
    placement = Placement(device_of, "shard", None, extra={"groups": [list(g) for g in groups], "models": sizes})
    return Sharding(groups, graphs, union, placement, info.per_model_inputs, label)


def shard_partition(sharding: Sharding, n_devices: int) -> Partition:
    """One stage per sub-array; per-model inputs sliced on the model axis, outputs concatenated on it."""
    stages, slices = [], {}
    outputs = sharding.graphs[0].graph_outputs
    for k, ((d, b0, b1), g) in enumerate(zip(sharding.groups, sharding.graphs)):
        inputs = {}
        for name in g.graph_inputs:
            if name in sharding.per_model_inputs:
                key = f"{name}[{b0}:{b1}]"
                slices[key] = (name, b0, b1)
                inputs[name] = key
            else:
                inputs[name] = name
        stages.append(Stage(d, 0, g.model, inputs, {o: f"shard{k}/{o}" for o in g.graph_outputs},
                            list(range(len(g)))))
    if any(g.graph_outputs != outputs for g in sharding.graphs):
        raise ConfigError("the sub-arrays have different outputs (internal error)")
    return Partition(stages, list(sharding.graphs[0].graph_inputs), list(outputs), n_devices, slices,
                     {o: [f"shard{k}/{o}" for k in range(len(stages))] for o in outputs})
