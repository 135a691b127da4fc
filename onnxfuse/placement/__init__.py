"""Device placement: place an ONNX graph (a model, a fused array, or a training graph) on several devices.

    graph.py      tasks, tensors, sizes, FLOPs and memory of an ONNX model        (build_graph)
    devices.py    device specs from flags or YAML                                 (DeviceSpec, load_device_spec)
    orders.py     traversal orders (topo, reversed_topo, dfs_*, bfs, by_name...)  (ORDERS, traversal_order)
    costs.py      compute and communication costs                                 (cost_table)
    placers.py    greedy sequential placer, HEFT, memory accounting, the placer table  (PLACERS, place)
    shard.py      model-axis sharding of fused arrays                             (shard_array)
    simulate.py   event simulator of one step                                     (simulate)
    partition.py  per-device ONNX sub-models                                      (partition_graph)
    execute.py    run them as a pipeline of onnxruntime sessions                  (run_partition)
    profile.py    profiled costs and calibration of the simulator                 (profile_graph, calibrate)
    compare.py    every placer x order on one graph, compared                     (compare_placements)
    result.py     all of it from one call, and its output folder                  (place_model, PlacementReport)
    gantt.py      Gantt chart PNG                                                 (gantt_figure)

The command is ``onnxfuse/cli/place.py``; the order x placer study is ``benchmarks/placement_study.py``.

onnxruntime is imported only inside the functions that profile or run.
"""
from __future__ import annotations

from onnxfuse.placement.costs import CostTable, cost_table
from onnxfuse.placement.devices import DeviceSpec, load_device_spec, make_devices
from onnxfuse.placement.graph import PlacementGraph, build_graph, example_feeds
from onnxfuse.placement.orders import ORDER_NAMES, ORDERS, CycleError, Dag, traversal_order
from onnxfuse.placement.partition import Partition, Stage, assign_stages, partition_graph
from onnxfuse.placement.placers import (PLACER_NAMES, PLACERS, MemoryLedger, Placement, Placer, greedy_placement,
                                        heft_placement, place, placement_memory, single_placement)
from onnxfuse.placement.compare import (Candidate, Comparison, compare_placements, measure_candidates, recommend,
                                        results_table)
from onnxfuse.placement.result import PlacementReport, place_model
from onnxfuse.placement.shard import ArrayInfo, find_array, shard_array, shard_groups
from onnxfuse.placement.simulate import SimResult, simulate

__all__ = [
    "PlacementGraph", "build_graph", "example_feeds", "DeviceSpec", "make_devices", "load_device_spec",
    "Dag", "ORDERS", "ORDER_NAMES", "traversal_order", "CycleError", "CostTable", "cost_table",
    "Placement", "MemoryLedger", "greedy_placement", "heft_placement", "single_placement", "place",
    "placement_memory", "ArrayInfo", "find_array", "shard_groups", "shard_array", "SimResult", "simulate",
    "Partition", "Stage", "assign_stages", "partition_graph", "Candidate", "Comparison", "compare_placements",
    "measure_candidates", "results_table", "recommend", "Placer", "PLACERS", "PLACER_NAMES", "place_model",
    "PlacementReport",
]
