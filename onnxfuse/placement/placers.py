"""Placers: which device runs each node.

``greedy``  the sequential placer of the device-placement literature: visit the nodes in a traversal order and
            put each where it would finish earliest, given what is placed so far:

                ready(i, d)  = max over predecessors p of  finish(p) + cut(bytes(p->i), dev(p), d)
                               (a predecessor not placed yet counts with its earliest possible finish, the
                               critical path to it on the fastest device without communication)
                finish(i, d) = earliest gap of length w(i, d) on d's timeline at or after ready(i, d)
                score(i, d)  = max(finish(i, d), finish(i, d) + cut(bytes(i->s), d, dev(s)) for placed
                               successors s on other devices)

            among the devices with memory left for it (``MemoryLedger``); ties go to the lower device index.
            The placer's timeline is its own estimate; the simulator scores the result.
``heft``    Topcuoglu et al.'s HEFT: the same insertion-based earliest-finish rule, visiting nodes by
            decreasing upward rank  rank(i) = mean_w(i) + max over successors s (mean_cut(i->s) + rank(s)),
            i.e. the critical path to the end first.
``single``  everything on device 0 (the one-device baseline every speedup is measured against).

Model-axis sharding of fused arrays is in :mod:`onnxfuse.placement.shard` (it changes the graph, not only
where nodes go).

Every placer is registered once, in :data:`PLACERS` at the end of this module: its name, its help text and the
function that places. ``onnxfuse place``'s ``--placer`` choices and help, ``compare_placements`` and ``place`` read it.
"""
from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from onnxfuse.core.errors import PlacementError
from onnxfuse.placement.costs import CostTable
from onnxfuse.placement.devices import DeviceSpec, format_bytes, size_flag
from onnxfuse.placement.graph import PlacementGraph
from onnxfuse.placement.orders import topological, traversal_order

__all__ = ["Placement", "MemoryLedger", "DoesNotFit", "greedy_placement", "heft_placement", "single_placement",
           "upward_ranks", "placement_memory", "check_memory", "smallest_memory", "place", "Placer", "PLACERS",
           "PLACER_NAMES", "BASELINE"]


@dataclass
class Placement:
    """device_of[i]: the device index of node i; how it was found; the placer's own step estimate."""

    device_of: list[int]
    placer: str
    order: str | None = None
    estimate: float = math.nan
    extra: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.placer}/{self.order}" if self.order else self.placer

    def devices_used(self) -> int:
        return len(set(self.device_of))


class DoesNotFit(PlacementError):
    """No device has memory left for a node (raised inside a placer; ``place`` explains it to the user)."""

    def __init__(self, node: str, need: float, left: list[float]):
        self.node = node
        super().__init__(f"node '{node}' needs {format_bytes(need)} more but the devices have "
                         f"{', '.join(format_bytes(x) for x in left)} left")


class MemoryLedger:
    """Bytes held on every device as nodes are placed (see :mod:`onnxfuse.placement.graph` for the model):
    a weight once per device that reads it (times the graph's weight factor), a graph input once per device that
    reads it, every tensor a node writes on its device, and a copy of every tensor a device receives."""

    def __init__(self, graph: PlacementGraph, capacity: Sequence[float]):
        self.graph = graph
        self.capacity = list(capacity)
        self.used = [0.0] * len(capacity)
        self.resident: list[set[str]] = [set() for _ in capacity]
        self.device_of = [-1] * len(graph)

    def extra(self, i: int, d: int) -> dict[int, float]:
        """Bytes each device would gain if node i went to device d."""
        g = self.graph
        add: dict[int, float] = defaultdict(float)
        for t in g.inputs[i]:
            info = g.tensors[t]
            if t in self.resident[d]:
                continue
            if info.kind == "weight":
                add[d] += info.nbytes * g.weight_factor
            elif info.kind == "input":
                add[d] += info.nbytes
            elif self.device_of[info.producer] not in (-1, d):  # a copy received from another device
                add[d] += info.nbytes
        for t in g.outputs[i]:
            info = g.tensors[t]
            add[d] += info.nbytes
            for e in {self.device_of[c] for c in info.consumers} - {-1, d}:
                if t not in self.resident[e]:
                    add[e] += info.nbytes
        return add

    def fits(self, i: int, d: int) -> bool:
        return all(self.used[e] + x <= self.capacity[e] for e, x in self.extra(i, d).items())

    def place(self, i: int, d: int) -> None:
        g = self.graph
        for e, x in self.extra(i, d).items():
            self.used[e] += x
        self.device_of[i] = d
        for t in g.inputs[i]:
            producer = g.tensors[t].producer
            if producer is None or self.device_of[producer] >= 0:  # charged now; else when its producer is placed
                self.resident[d].add(t)
        for t in g.outputs[i]:
            self.resident[d].add(t)
            for c in g.tensors[t].consumers:
                if self.device_of[c] >= 0:
                    self.resident[self.device_of[c]].add(t)

    def shortfall(self, i: int) -> tuple[float, list[float]]:
        """The least extra bytes node i needs on any one device, and what each device has left."""
        need = min(self.extra(i, d).get(d, 0.0) for d in range(len(self.capacity)))
        return need, [c - u for c, u in zip(self.capacity, self.used)]


def placement_memory(graph: PlacementGraph, device_of: Sequence[int], n_devices: int) -> list[float]:
    """Bytes each device holds under a placement (the ledger's model)."""
    ledger = MemoryLedger(graph, [math.inf] * n_devices)
    for i in topological(graph.dag):
        ledger.place(i, device_of[i])
    return ledger.used


def check_memory(graph: PlacementGraph, device_of: Sequence[int], devices: Sequence[DeviceSpec]) -> None:
    """Raise PlacementError when a placement holds more on a device than it has."""
    used = placement_memory(graph, device_of, len(devices))
    for dev, u in zip(devices, used):
        if u > dev.memory:
            raise PlacementError(f"{graph.label}: the placement holds {format_bytes(u)} on device '{dev.name}', "
                                 f"which has {format_bytes(dev.memory)}; give memory={size_flag(u)!r} "
                                 "or more, or more devices")


def _critical_finish(graph: PlacementGraph, costs: CostTable) -> list[float]:
    """Earliest finish of every node on the fastest device with free communication (a lower bound)."""
    finish = [0.0] * len(graph)
    for i in topological(graph.dag):
        start = max((finish[p] for p in graph.dag.preds[i]), default=0.0)
        finish[i] = start + min(costs.compute[i])
    return finish


def _earliest_gap(busy: list[tuple[float, float]], ready: float, length: float) -> float:
    """Start of the first idle interval of ``length`` at or after ``ready`` in a sorted list of busy intervals."""
    k = bisect.bisect_left(busy, (ready, -math.inf))
    prev_end = busy[k - 1][1] if k > 0 else 0.0
    start = max(ready, prev_end)
    for s, e in busy[k:]:
        if start + length <= s:
            return start
        start = max(start, e)
    return start


def _sequential_place(graph: PlacementGraph, costs: CostTable, order: Sequence[int], name: str,
                      order_name: str | None) -> Placement:
    """Visit ``order`` and put each node where it finishes earliest (module docstring), within memory."""
    D = len(costs.devices)
    lower = _critical_finish(graph, costs)
    ledger = MemoryLedger(graph, [d.memory for d in costs.devices])
    busy: list[list[tuple[float, float]]] = [[] for _ in range(D)]
    finish = [math.nan] * len(graph)
    dev_of = ledger.device_of
    for i in order:
        best = None
        for d in range(D):
            if not ledger.fits(i, d):
                continue
            ready = 0.0
            for p in graph.dag.preds[i]:
                if dev_of[p] >= 0:
                    ready = max(ready, finish[p] + costs.cut(graph.edge_bytes(p, i), dev_of[p], d))
                else:
                    ready = max(ready, lower[p])
            w = costs.compute[i][d]
            start = _earliest_gap(busy[d], ready, w)
            end = start + w
            score = end
            for s in graph.dag.succs[i]:
                if dev_of[s] >= 0 and dev_of[s] != d:
                    score = max(score, end + costs.cut(graph.edge_bytes(i, s), d, dev_of[s]))
            if best is None or (score, end) < best[:2]:
                best = (score, end, d, start)
        if best is None:
            need, left = ledger.shortfall(i)
            raise DoesNotFit(graph.names[i], need, left)
        _, end, d, start = best
        ledger.place(i, d)
        bisect.insort(busy[d], (start, end))
        finish[i] = end
    estimate = max(finish) if len(graph) else 0.0
    return Placement(list(dev_of), name, order_name, estimate)


def greedy_placement(graph: PlacementGraph, costs: CostTable, order: str | Sequence[int] = "topo") -> Placement:
    """The sequential earliest-finish placer visiting nodes in ``order`` (a name from ORDERS or a sequence)."""
    if isinstance(order, str):
        return _sequential_place(graph, costs, traversal_order(graph.dag, order), "greedy", order)
    seq = list(order)
    if sorted(seq) != list(range(len(graph))):
        raise PlacementError(f"{graph.label}: a traversal order must list every node index exactly once")
    return _sequential_place(graph, costs, seq, "greedy", "custom")


def upward_ranks(graph: PlacementGraph, costs: CostTable) -> list[float]:
    """rank(i) = mean_w(i) + max over successors s of (mean_cut(bytes(i->s)) + rank(s))."""
    rank = [0.0] * len(graph)
    for i in reversed(topological(graph.dag)):
        tail = max((costs.mean_cut(graph.edge_bytes(i, s)) + rank[s] for s in graph.dag.succs[i]), default=0.0)
        rank[i] = costs.mean_compute(i) + tail
    return rank


def heft_placement(graph: PlacementGraph, costs: CostTable) -> Placement:
    """HEFT: insertion-based earliest finish, nodes by decreasing upward rank (ties: topological position)."""
    rank = upward_ranks(graph, costs)
    position = {i: k for k, i in enumerate(topological(graph.dag))}
    order = sorted(range(len(graph)), key=lambda i: (-rank[i], position[i]))
    return _sequential_place(graph, costs, order, "heft", None)


def single_placement(graph: PlacementGraph, costs: CostTable) -> Placement:
    """Every node on device 0."""
    device_of = [0] * len(graph)
    check_memory(graph, device_of, costs.devices[:1])
    return Placement(device_of, "single", None, sum(c[0] for c in costs.compute))


def smallest_memory(graph: PlacementGraph, costs: CostTable,
                    placer: Callable[[PlacementGraph, CostTable], Placement], tolerance: float = 0.01) -> float:
    """The smallest memory per device (scaling every device's memory alike; equal devices: that memory) with
    which ``placer`` succeeds, by bisection between a lower bound and the whole graph's memory."""
    import dataclasses

    total = placement_memory(graph, [0] * len(graph), 1)[0]
    biggest = max(d.memory for d in costs.devices if not math.isinf(d.memory))
    ratio = [d.memory / biggest for d in costs.devices]

    def works(m: float) -> bool:
        devs = [dataclasses.replace(d, memory=m * r) for d, r in zip(costs.devices, ratio)]
        try:
            placer(graph, CostTable(costs.compute, devs, costs.source))
            return True
        except DoesNotFit:
            return False

    hi = total / min(ratio)
    lo = total / sum(ratio) * 0.999  # every byte somewhere, nothing replicated
    if not works(hi):  # cannot happen with the ledger model; keep the message honest if it does
        return hi
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        if works(mid):
            hi = mid
        else:
            lo = mid
    return hi


# ------------------------------------------------------------------------------------------- the placer table
@dataclass(frozen=True)
class Placer:
    """A placer as ``onnxfuse place`` offers it. ``place(graph, costs, order)`` returns a Placement or raises
    DoesNotFit. ``orders``: run once per traversal order (``--order``). ``needs_array``: it changes the graph and
    places a fused array's sub-arrays (``compare.py`` builds them; ``place`` is None). ``baseline``: always evaluated,
    the one-device step every speedup is against; not a ``--placer`` choice."""

    name: str
    help: str
    place: Callable[[PlacementGraph, CostTable, str | None], Placement] | None = None
    orders: bool = False
    needs_array: bool = False
    baseline: bool = False


PLACERS: dict[str, Placer] = {p.name: p for p in [
    Placer("greedy", "sequential earliest-finish placer, once per traversal order (--order)",
           lambda g, c, order: greedy_placement(g, c, order or "topo"), orders=True),
    Placer("heft", "HEFT: earliest finish, nodes by decreasing upward rank",
           lambda g, c, order: heft_placement(g, c)),
    Placer("shard", "model-axis sharding of a fused array: a sub-array per device, no tensor between devices",
           needs_array=True),
    Placer("single", "everything on device 0 (the baseline)", lambda g, c, order: single_placement(g, c),
           baseline=True),
]}
PLACER_NAMES = [p.name for p in PLACERS.values() if not p.baseline]  # the --placer choices
BASELINE = next(p.name for p in PLACERS.values() if p.baseline)


def place(graph: PlacementGraph, costs: CostTable, placer: str, order: str | None = None) -> Placement:
    """Run one placer; when the graph does not fit, raise PlacementError with the smallest memory that works."""
    entry = PLACERS.get(placer)
    if entry is None or entry.place is None:
        raise PlacementError(f"unknown placer '{placer}'; choose from {', '.join(PLACERS)}")

    def run(g: PlacementGraph, c: CostTable) -> Placement:
        return entry.place(g, c, order)

    try:
        return run(graph, costs)
    except DoesNotFit as e:
        m = smallest_memory(graph, costs, run)
        biggest = max(d.memory for d in costs.devices)
        label = f"{placer}/{order}" if entry.orders else placer
        raise PlacementError(
            f"{graph.label} does not fit on {len(costs.devices)} device(s) with {format_bytes(biggest)} each "
            f"({label}: {e}); the smallest memory per device that works for this placer is about "
            f"{format_bytes(m)}: give memory={size_flag(m)!r} or more devices") from e
