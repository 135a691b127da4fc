"""Cost of every node on every device, and of moving a tensor between two devices.

    compute[i][d] = measured_s[i] / speed_d + op_overhead_d                       (profiled costs)
                  = max(flops_i / flops_d, bytes_i / mem_bandwidth_d) + op_overhead_d   (estimated costs)
    comm(bytes, s, e) = 0 if s == e else latency_s + bytes / bandwidth_s
    cut(bytes, s, e)  = comm(bytes, s, e) + call_overhead_e     what placers charge for a cross-device edge: it
                                                                  also starts a new stage (session call) on e

Profiled costs are used when the graph carries them (``PlacementGraph.measured_s``), estimated ones otherwise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from onnxfuse.placement.devices import DeviceSpec, comm_time
from onnxfuse.placement.graph import PlacementGraph

__all__ = ["CostTable", "cost_table"]


@dataclass
class CostTable:
    """compute[i][d] in seconds, plus the devices for communication costs."""

    compute: list[list[float]]
    devices: list[DeviceSpec]
    source: str  # "profiled" or "estimated"

    def comm(self, nbytes: float, src: int, dst: int) -> float:
        return 0.0 if src == dst else comm_time(nbytes, self.devices[src], self.devices[dst])

    def cut(self, nbytes: float, src: int, dst: int) -> float:
        """What a placer charges for an edge between devices: the transfer, plus the session call the receiving
        device makes for the new stage the cut starts (0 on one device)."""
        return 0.0 if src == dst else self.comm(nbytes, src, dst) + self.devices[dst].call_overhead

    def mean_compute(self, i: int) -> float:
        return sum(self.compute[i]) / len(self.devices)

    def mean_cut(self, nbytes: float) -> float:
        """Average ``cut`` cost between two distinct devices (0 with one device)."""
        D = len(self.devices)
        if D < 2:
            return 0.0
        return sum(self.cut(nbytes, s, e) for s in range(D) for e in range(D) if s != e) / (D * (D - 1))


def _node_time(graph: PlacementGraph, i: int, dev: DeviceSpec) -> float:
    measured = graph.measured_s[i] if graph.measured_s is not None else math.nan
    if not math.isnan(measured):
        base = measured / dev.speed
    else:
        base = max(graph.flops[i] / dev.flops, graph.bytes_accessed[i] / dev.mem_bandwidth)
    return base + dev.op_overhead


def cost_table(graph: PlacementGraph, devices: Sequence[DeviceSpec]) -> CostTable:
    """Every node's compute time on every device."""
    devices = list(devices)
    compute = [[_node_time(graph, i, d) for d in devices] for i in range(len(graph))]
    return CostTable(compute, devices, "profiled" if graph.measured_s is not None else "estimated")
