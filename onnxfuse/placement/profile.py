"""Measured costs: profile every node with onnxruntime, and calibrate the simulator's overheads on this machine.

``profile_graphs`` runs models with onnxruntime's profiler (optimizations off, so every ONNX node is one kernel)
and keeps each node's median kernel time. Several models are profiled *in alternation*, a few runs each per
round: a shared machine's speed drifts by tens of percent over seconds, and graphs whose costs are compared
(a fused array and its sub-arrays) must see the same mixture of fast and slow moments.

``calibrate`` fits what a kernel profile does not see, timing steps through the pipeline executor itself (thread
hand-off included) with the sessions it uses, every measurement alternating with the others in rounds:

    call_overhead   c   one stage (hand-off + session call):    wall(1-node model)  = c + o
    op_overhead     o   per node, outside its kernel:            wall(64-node chain) = c + 64 o
    kernel scale    s   profiled kernels vs. unprofiled runs:    wall(model) = c + sum_i (s k_i + o)
    link            latency + bytes / bandwidth, from a 2-stage chain (one value handed from one device's
                    thread to the other's) against the same chain on one device, at two sizes:
                    wall(split) - wall(one stage) = c + latency + bytes / bandwidth
    contention      the model on two devices at once against one alone: wall(two) = (1 + contention) wall(one)

and applies them to the devices: ``op_overhead = o``, ``call_overhead = c``, ``speed = 1 / s`` (so a node costs
``s * k_i + o``), ``latency``, ``bandwidth``, ``contention`` (host "local": they share this machine). Every wall
time is a median.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxfuse.placement.devices import DeviceSpec
from onnxfuse.placement.execute import PipelineRunner
from onnxfuse.placement.session import make_session
from onnxfuse.placement.graph import PlacementGraph, build_graph, example_feeds
from onnxfuse.placement.partition import Partition, Stage, partition_graph

__all__ = ["profile_graph", "profile_graphs", "Calibration", "calibrate", "fit_calibration", "chain_model",
           "interleaved_medians", "pair_partition"]


def profile_graphs(graphs: Sequence[PlacementGraph], feeds: Sequence[Mapping[str, np.ndarray] | None] | None = None,
                   device: DeviceSpec | None = None, runs: int = 20, warmup: int = 5, rounds: int = 4
                   ) -> list[PlacementGraph]:
    """Set every graph's ``measured_s``: median kernel seconds per node over ``runs`` profiled runs, the graphs
    taking turns in ``rounds`` rounds. Nodes onnxruntime never runs (e.g. Constants it folds at load) cost 0."""
    feeds = list(feeds) if feeds is not None else [None] * len(graphs)
    feeds = [f if f is not None else example_feeds(g.model) for g, f in zip(graphs, feeds)]
    per_round = max(1, -(-runs // rounds))
    with tempfile.TemporaryDirectory(prefix="onnxfuse-profile-") as tmp:
        sessions = [make_session(g.model, device, profile_prefix=os.path.join(tmp, f"g{k}"))
                    for k, g in enumerate(graphs)]
        names = [[o.name for o in s.get_outputs()] for s in sessions]
        for r in range(rounds):
            for s, out, f in zip(sessions, names, feeds):
                for _ in range(per_round + (warmup if r == 0 else 0)):
                    s.run(out, {n: np.array(v, copy=True) for n, v in f.items()})
        for g, s in zip(graphs, sessions):
            with open(s.end_profiling()) as fh:
                events = json.load(fh)
            durations: dict[str, list[float]] = {}
            for e in events:
                if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
                    durations.setdefault(e["name"][: -len("_kernel_time")], []).append(e["dur"] * 1e-6)
            times = {n: statistics.median(d[warmup:] or d) for n, d in durations.items()}
            g.measured_s = [times.get(n, 0.0) for n in g.names]
    return list(graphs)


def profile_graph(graph: PlacementGraph, feeds: Mapping[str, np.ndarray] | None = None,
                  device: DeviceSpec | None = None, runs: int = 20, warmup: int = 5) -> PlacementGraph:
    """``profile_graphs`` for one graph; returns it."""
    return profile_graphs([graph], [feeds], device, runs, warmup)[0]


def chain_model(length: int, numel: int = 1) -> onnx.ModelProto:
    """x -> Identity -> ... (``length`` nodes) -> y on a float32 vector of ``numel`` elements."""
    nodes = [helper.make_node("Identity", ["x" if k == 0 else f"t{k}"], [f"t{k + 1}" if k < length - 1 else "y"],
                              name=f"id{k}") for k in range(length)]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [numel])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [numel])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


@dataclass
class Calibration:
    """Fitted overheads of this machine (module docstring); ``apply`` puts them on devices."""

    call_overhead: float
    op_overhead: float
    kernel_scale: float
    latency: float
    bandwidth: float
    whole_s: float | None = None   # measured step of the whole model on one device
    contention: float = 0.0        # slowdown - 1 of two devices of this machine computing at once

    def apply(self, devices: Sequence[DeviceSpec]) -> list[DeviceSpec]:
        """The devices with these overheads; they all share this machine ('local' host) and its contention."""
        return [dataclasses.replace(d, call_overhead=self.call_overhead, op_overhead=self.op_overhead,
                                    speed=1.0 / self.kernel_scale, latency=self.latency, bandwidth=self.bandwidth,
                                    host="local", contention=self.contention)
                for d in devices]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def fit_calibration(one_node: float, chain: float, chain_length: int, whole: float, kernels: float, nodes: int,
                    handoff: Sequence[tuple[float, float]] = (), contention: float = 0.0) -> Calibration:
    """Solve the module docstring's equations for measured wall times (seconds).

    ``one_node`` = c + o, ``chain`` = c + L o (L = ``chain_length``), ``whole`` = c + s * kernels + nodes * o, and
    ``handoff`` = [(bytes, extra seconds of the split chain)] at two sizes: extra = c + latency + bytes / bandwidth.
    ``contention`` is the measured relative slowdown of two devices computing at once.
    Noise can make a fitted value negative or absurd: overheads and contention are clamped at 0 (contention at
    most 1: two devices never slower than one after the other) and the kernel scale to [0.5, 2].
    """
    op = max(0.0, (chain - one_node) / (chain_length - 1))
    call = max(0.0, one_node - op)
    scale = (whole - call - op * nodes) / kernels if kernels > 0 else 1.0
    scale = min(max(scale, 0.5), 2.0)
    latency, bandwidth = 0.0, 1e12
    if len(handoff) >= 2:
        (b0, e0), (b1, e1) = sorted(handoff)[0], sorted(handoff)[-1]
        slope = (e1 - e0) / (b1 - b0) if b1 > b0 else 0.0
        bandwidth = 1.0 / slope if slope > 1e-15 else 1e12
        latency = max(0.0, e0 - call - b0 / bandwidth)
    return Calibration(call, op, scale, latency, bandwidth, whole, min(max(contention, 0.0), 1.0))


def interleaved_medians(steps: Mapping[str, Callable[[], float]], rounds: int = 8, per_round: int = 5,
                        warmup: int = 2) -> dict[str, float]:
    """Median of each timed step function, the functions taking turns (``per_round`` calls each per round)."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(rounds):
        for key, step in steps.items():
            for k in range(per_round + (warmup if r == 0 else 0)):
                t = step()
                if r > 0 or k >= warmup:
                    times[key].append(t)
    return {k: statistics.median(v) for k, v in times.items()}


def pair_partition(graph: PlacementGraph) -> Partition:
    """The whole model once on device 0 and once on device 1, at the same time: what two devices of one
    machine do to each other (``contention``)."""
    def copy_on(d: int) -> Stage:
        return Stage(d, 0, graph.model, {n: n for n in graph.graph_inputs},
                     {o: f"d{d}/{o}" for o in graph.graph_outputs})

    return Partition([copy_on(0), copy_on(1)], list(graph.graph_inputs), [], 2)


def _stepper(runner: PipelineRunner, feeds: Mapping[str, np.ndarray]) -> Callable[[], float]:
    return lambda: runner.step(feeds)[1]


def calibrate(graph: PlacementGraph, devices: Sequence[DeviceSpec], feeds: Mapping[str, np.ndarray] | None = None,
              repeats: int = 40, progress: bool = False) -> Calibration:
    """Fit call/op overheads, the kernel scale, the link and the contention on this machine (module docstring);
    ``graph`` must be profiled. ``repeats`` steps of each measurement, spread over alternating rounds."""
    if graph.measured_s is None:
        raise ValueError("calibrate needs a profiled graph: call profile_graph first")
    if progress:
        print("calibrating session, op, link and contention overheads ...", file=sys.stderr, flush=True)
    feeds = feeds if feeds is not None else example_feeds(graph.model)
    one_dev = list(devices[:1])
    x = {"x": np.ones(1, np.float32)}
    small, large = 256, 1 << 20  # float32 elements: 1 KiB and 4 MiB
    chains = {n: build_graph(chain_model(2, n), label="chain") for n in (small, large)}
    runners: dict[str, tuple[PipelineRunner, Mapping[str, np.ndarray]]] = {
        "one": (PipelineRunner(partition_graph(build_graph(chain_model(1)), [0], 1), one_dev), x),
        "chain": (PipelineRunner(partition_graph(build_graph(chain_model(64)), [0] * 64, 1), one_dev), x),
        "whole": (PipelineRunner(partition_graph(graph, [0] * len(graph), 1), one_dev), feeds),
    }
    if len(devices) > 1:
        two = list(devices[:2])
        for n, g in chains.items():
            xs = {"x": np.ones(n, np.float32)}
            runners[f"split{n}"] = (PipelineRunner(partition_graph(g, [0, 1], 2), two), xs)
            runners[f"joined{n}"] = (PipelineRunner(partition_graph(g, [0, 0], 2), two), xs)

        runners["pair"] = (PipelineRunner(pair_partition(graph), two), feeds)
    try:
        rounds = 8
        med = interleaved_medians({k: _stepper(r, f) for k, (r, f) in runners.items()}, rounds=rounds,
                                  per_round=max(1, repeats // rounds))
    finally:
        for r, _ in runners.values():
            r.close()
    handoff, contention = [], 0.0
    if len(devices) > 1:
        handoff = [(n * 4.0, med[f"split{n}"] - med[f"joined{n}"]) for n in (small, large)]
        contention = med["pair"] / med["whole"] - 1.0
    return fit_calibration(med["one"], med["chain"], 64, med["whole"], sum(graph.measured_s), len(graph), handoff,
                           contention)
