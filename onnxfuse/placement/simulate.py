"""Event simulator of one step of a placed graph (in the spirit of Placeto's simulator, with ONNX semantics).

Rules, each device independently:

* **compute**: a device runs one unit at a time. With ``granularity="stage"`` (the default: what the onnxruntime
  pipeline of :mod:`onnxfuse.placement.execute` does) a unit is a stage, one sub-model of
  :mod:`onnxfuse.placement.partition`: it starts when the device is free and *all* its inputs are there, costs
  ``call_overhead + sum(compute[i][d])``, runs its nodes back to back in topological order, and its outputs exist
  when it ends. A device runs its stages in stage order. With ``granularity="op"`` a unit is one node, ready when
  its own inputs are there; among ready nodes the earliest-ready first, then the lowest node index.
* **contention**: devices that name the same ``host`` share its cores and memory bandwidth: while k of them
  compute, each progresses at 1 / (1 + contention * (k - 1)) of its speed (processor sharing, re-rated whenever
  one starts or stops). Two CPU "devices" of one machine are such a pair; GPUs are not (contention 0).
* **links**: a device sends over one outgoing link, one message at a time, first come first served (ties: by
  destination index). When a unit ends, everything it wrote that another device reads goes to that device as
  one message (the pipeline hands a stage's outputs over together): ``latency + bytes / bandwidth`` of the
  sender. Transfers overlap compute on both ends; receiving is not limited.
* **data at the start**: graph inputs and weights are on every device that reads them at time 0.
* **step time**: when the last unit or transfer ends.
* **memory**: weights (times the graph's weight factor) and graph inputs a device reads are held all step; a
  tensor is held from the start of the node that writes it until its last reader on that device and its last
  outgoing transfer are done (kept all step when planning training, or when it is a graph output); a received
  copy from its transfer's start until its last reader there (at one instant, frees come before allocations,
  as a node starts when its predecessor has released its inputs). ``peak_memory`` is the highest sum per device;
  ``static_memory`` is the placer's bound (everything kept).

Simultaneous events are all applied before any device or link picks its next unit, so results do not depend on
the order events were queued in.
"""
from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from onnxfuse.core.errors import PlacementError
from onnxfuse.placement.costs import CostTable
from onnxfuse.placement.graph import PlacementGraph
from onnxfuse.placement.orders import topological
from onnxfuse.placement.partition import assign_stages
from onnxfuse.placement.placers import Placement, placement_memory

__all__ = ["Transfer", "SimResult", "simulate", "GRANULARITIES"]

GRANULARITIES = ("stage", "op")


@dataclass(frozen=True)
class Transfer:
    """One message on a link: every tensor a unit wrote that one other device reads."""

    tensors: tuple[str, ...]
    src: int
    dst: int
    start: float
    end: float
    nbytes: int


@dataclass
class SimResult:
    """One simulated step: its time, where the time went, memory and traffic."""

    step_time: float
    busy: list[float]                 # seconds each device computes
    link_busy: list[float]            # seconds each device's outgoing link sends
    peak_memory: list[float]          # bytes, live peak per device
    static_memory: list[float]        # bytes, the placer's bound per device
    bytes_moved: int
    transfers: list[Transfer]
    start: list[float]                # per node
    end: list[float]
    device_of: list[int] = field(default_factory=list)
    units: list[tuple[int, int, float, float]] = field(default_factory=list)  # (device, stage or node, start, end)
    granularity: str = "stage"

    def to_json(self) -> dict:
        return {"step_time_s": self.step_time, "busy_s": self.busy, "link_busy_s": self.link_busy,
                "peak_memory_bytes": self.peak_memory, "static_memory_bytes": self.static_memory,
                "bytes_moved": self.bytes_moved, "transfers": len(self.transfers), "granularity": self.granularity}


@dataclass
class _Unit:
    device: int
    nodes: list[int]
    key: int                       # stage index (stage mode) or node index (op mode)
    waits: set[tuple[str, int]]    # (tensor, device) it needs that other units provide
    ready_at: float = 0.0


_EPS = 1e-12  # seconds: events closer than this are simultaneous


class _Run:
    """A unit running on a device at a rate that changes when devices of its host start or stop (contention):
    progress(t) = work_done + (t - t_ref) * rate, with the (time, progress) breakpoints kept for node times."""

    def __init__(self, unit: int, work: float, now: float):
        self.unit, self.work, self.started = unit, work, now
        self.done, self.t_ref, self.rate = 0.0, now, 1.0
        self.points = [(now, 0.0)]

    def rebase(self, now: float, rate: float) -> None:
        self.done += (now - self.t_ref) * self.rate
        self.t_ref, self.rate = now, rate
        self.points.append((now, self.done))

    def end_time(self) -> float:
        return self.t_ref + (self.work - self.done) / self.rate

    def time_at(self, progress: float) -> float:
        """When the unit's progress reached ``progress`` (piecewise linear between breakpoints)."""
        for (t0, w0), (t1, w1) in zip(self.points, self.points[1:]):
            if progress <= w1 + 1e-18:
                return t0 if w1 == w0 else t0 + (t1 - t0) * (progress - w0) / (w1 - w0)
        return self.points[-1][0]


def _units(graph: PlacementGraph, device_of: Sequence[int], granularity: str) -> list[_Unit]:
    """Stages (or single nodes) with the (tensor, device) pairs each waits for."""
    position = {i: k for k, i in enumerate(topological(graph.dag))}
    if granularity == "stage":
        stage = assign_stages(graph.dag, device_of)
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i in sorted(range(len(graph)), key=position.__getitem__):
            groups[(device_of[i], stage[i])].append(i)
        units = [_Unit(d, nodes, s, set()) for (d, s), nodes in sorted(groups.items(), key=lambda kv: kv[0][::-1])]
    else:
        units = [_Unit(device_of[i], [i], i, set()) for i in range(len(graph))]
    for u in units:
        inside = set(u.nodes)
        for i in u.nodes:
            for t in graph.inputs[i]:
                p = graph.tensors[t].producer
                if p is not None and p not in inside:
                    u.waits.add((t, u.device))
    return units


def simulate(graph: PlacementGraph, costs: CostTable, placement: Placement | Sequence[int],
             granularity: str = "stage") -> SimResult:
    """Simulate one step of ``graph`` placed by ``placement`` (rules in the module docstring)."""
    if granularity not in GRANULARITIES:
        raise PlacementError(f"unknown granularity '{granularity}'; choose stage or op")
    device_of = list(placement.device_of if isinstance(placement, Placement) else placement)
    D = len(costs.devices)
    if len(device_of) != len(graph) or any(not 0 <= d < D for d in device_of):
        raise PlacementError(f"{graph.label}: the placement must give every one of its {len(graph)} nodes a device "
                             f"index between 0 and {D - 1}")
    sim = _Simulation(graph, costs, device_of, granularity)
    step = sim.run()
    if any(math.isnan(e) for e in sim.end):
        stuck = next(graph.names[i] for i in range(len(graph)) if math.isnan(sim.end[i]))
        raise PlacementError(f"{graph.label}: node '{stuck}' never ran in the simulation (internal error)")
    static = placement_memory(graph, device_of, D)
    peak = _peak_memory(graph, device_of, D, sim.start, sim.end, sim.transfers, step)
    return SimResult(step, sim.busy, sim.link_busy, peak, static, sum(t.nbytes for t in sim.transfers),
                     sim.transfers, sim.start, sim.end, device_of, sim.unit_spans, granularity)


class _Simulation:
    """The state of one simulated step: units waiting, ready or running per device, messages queued or on the
    links, and what has happened so far (node times, busy seconds, transfers)."""

    def __init__(self, graph: PlacementGraph, costs: CostTable, device_of: list[int], granularity: str):
        self.graph, self.costs, self.granularity = graph, costs, granularity
        D = self.D = len(costs.devices)
        units = self.units = _units(graph, device_of, granularity)
        self.unit_of = {i: k for k, u in enumerate(units) for i in u.nodes}
        self.waiting: dict[tuple[str, int], list[int]] = defaultdict(list)
        for k, u in enumerate(units):
            for w in u.waits:
                self.waiting[w].append(k)
        self.pending = [len(u.waits) for u in units]
        self.queue_of_device = [[k for k, u in enumerate(units) if u.device == d] for d in range(D)]  # stage order
        self.next_unit = [0] * D
        self.ready: list[list[tuple[float, int, int]]] = [[] for _ in range(D)]  # op mode: (ready_at, node, unit)
        self.running: dict[int, _Run] = {}  # device -> the unit it runs
        self.link_queue: list[list[tuple[float, int, tuple[str, ...], int]]] = [[] for _ in range(D)]
        self.link_running = [False] * D
        self.events: list[tuple[float, int, tuple]] = []  # transfer ends
        self.seq = 0
        self.start = [math.nan] * len(graph)
        self.end = [math.nan] * len(graph)
        self.busy = [0.0] * D
        self.link_busy = [0.0] * D
        self.transfers: list[Transfer] = []
        self.unit_spans: list[tuple[int, int, float, float]] = []
        self.hosts = [d.host or f"#{k}" for k, d in enumerate(costs.devices)]

    def run(self) -> float:
        """Play the step out; its time (when the last unit or transfer ends)."""
        for k, u in enumerate(self.units):
            if self.pending[k] == 0:
                self.became_ready(k, 0.0)
        now = step = 0.0
        self.dispatch(now)
        while self.events or self.running:
            t_unit = min((r.end_time() for r in self.running.values()), default=math.inf)
            now = min(t_unit, self.events[0][0] if self.events else math.inf)
            step = max(step, now)
            # apply every event within a picosecond of now before anyone picks new work
            done = sorted(d for d, r in self.running.items() if r.end_time() <= now + _EPS)
            for d in done:
                self.finish_unit(d, now)
            while self.events and self.events[0][0] <= now + _EPS:
                _, _, (tensors, s, dst) = heapq.heappop(self.events)
                self.link_running[s] = False
                for tensor in tensors:
                    self.arrive((tensor, dst), now)
            if done:
                self.rerate(now)
            self.dispatch(now)
        return step

    def became_ready(self, k: int, now: float) -> None:
        self.units[k].ready_at = now
        if self.granularity == "op":
            heapq.heappush(self.ready[self.units[k].device], (now, self.units[k].key, k))

    def rerate(self, now: float) -> None:
        """Speed of every running unit: 1 / (1 + contention * (devices busy on its host - 1))."""
        count: dict[str, int] = defaultdict(int)
        for d in self.running:
            count[self.hosts[d]] += 1
        for d, r in self.running.items():
            rate = 1.0 / (1.0 + self.costs.devices[d].contention * (count[self.hosts[d]] - 1))
            if rate != r.rate:
                r.rebase(now, rate)

    def _overhead(self, d: int) -> float:
        """A unit's fixed cost on device ``d``: a session call per stage, nothing per op."""
        return self.costs.devices[d].call_overhead if self.granularity == "stage" else 0.0

    def start_unit(self, d: int, now: float) -> bool:
        if d in self.running:
            return False
        if self.granularity == "stage":
            order = self.queue_of_device[d]
            if self.next_unit[d] >= len(order) or self.pending[order[self.next_unit[d]]] > 0:
                return False
            k = order[self.next_unit[d]]
            self.next_unit[d] += 1
        else:
            if not self.ready[d]:
                return False
            k = heapq.heappop(self.ready[d])[2]
        work = self._overhead(d) + sum(self.costs.compute[i][d] for i in self.units[k].nodes)
        self.running[d] = _Run(k, work, now)
        return True

    def finish_unit(self, d: int, now: float) -> None:
        r = self.running.pop(d)
        u = self.units[r.unit]
        r.points.append((now, r.work))
        t = self._overhead(d)
        for i in u.nodes:  # node boundaries: when the unit's progress reached their cumulative work
            self.start[i] = r.time_at(t)
            t += self.costs.compute[i][d]
            self.end[i] = r.time_at(t)
        self.busy[d] += now - r.started
        self.unit_spans.append((d, u.key, r.started, now))
        self._send_outputs(d, r.unit, now)

    def _send_outputs(self, d: int, unit: int, now: float) -> None:
        """What the unit wrote: there at once for readers on ``d``, one message per other device that reads it."""
        outbox: dict[int, list[str]] = defaultdict(list)  # destination device -> tensors, one message each
        for i in self.units[unit].nodes:
            for tensor in self.graph.outputs[i]:
                readers = {self.units[self.unit_of[c]].device for c in self.graph.tensors[tensor].consumers
                           if self.unit_of[c] != unit}
                for e in sorted(readers):
                    if e == d:
                        self.arrive((tensor, e), now)
                    else:
                        outbox[e].append(tensor)
        for e in sorted(outbox):
            self.seq += 1
            heapq.heappush(self.link_queue[d], (now, self.seq, tuple(outbox[e]), e))

    def start_link(self, s: int, now: float) -> None:
        if self.link_running[s] or not self.link_queue[s]:
            return
        _, _, tensors, dst = heapq.heappop(self.link_queue[s])
        nbytes = sum(self.graph.tensors[t].nbytes for t in tensors)
        t_end = now + self.costs.comm(nbytes, s, dst)
        self.transfers.append(Transfer(tensors, s, dst, now, t_end, nbytes))
        self.link_busy[s] += t_end - now
        self.link_running[s] = True
        self.seq += 1
        heapq.heappush(self.events, (t_end, self.seq, (tensors, s, dst)))

    def arrive(self, key: tuple[str, int], now: float) -> None:
        for k in self.waiting.pop(key, []):
            self.pending[k] -= 1
            if self.pending[k] == 0:
                self.became_ready(k, now)

    def dispatch(self, now: float) -> None:
        started = False
        for d in range(self.D):
            self.start_link(d, now)
            started |= self.start_unit(d, now)
        if started:
            self.rerate(now)


def _peak_memory(graph: PlacementGraph, device_of: Sequence[int], D: int, start: Sequence[float],
                 end: Sequence[float], transfers: Sequence[Transfer], step: float) -> list[float]:
    """Highest bytes held at once per device (module docstring).

    Not ``_graph.last_readers`` (the torch program's and the memory estimate's "freed after the step that last
    reads it"): here a tensor is freed at a *time*, per device, when its last reader on that device has ended and
    its last outgoing transfer is done, and a received copy has a lifetime of its own on the receiving device."""
    resident = [0.0] * D
    for d in range(D):
        seen: set[str] = set()
        for i in range(len(graph)):
            if device_of[i] != d:
                continue
            for t in graph.inputs[i]:
                info = graph.tensors[t]
                if t not in seen and info.kind in ("weight", "input"):
                    seen.add(t)
                    resident[d] += info.nbytes * (graph.weight_factor if info.kind == "weight" else 1.0)
    deltas: list[list[tuple[float, int, float]]] = [[] for _ in range(D)]
    outgoing: dict[tuple[str, int], float] = defaultdict(float)
    for tr in transfers:
        for t in tr.tensors:
            outgoing[(t, tr.src)] = max(outgoing[(t, tr.src)], tr.end)
    keep_all = graph.training
    outputs = set(graph.graph_outputs)
    for i in range(len(graph)):
        d = device_of[i]
        for t in graph.outputs[i]:
            info = graph.tensors[t]
            local = [end[c] for c in info.consumers if device_of[c] == d]
            free = step if keep_all or t in outputs else max(local + [outgoing.get((t, d), end[i])])
            deltas[d].append((start[i], 1, info.nbytes))
            deltas[d].append((free, 0, -info.nbytes))
    for tr in transfers:
        for t in tr.tensors:
            readers = [end[c] for c in graph.tensors[t].consumers if device_of[c] == tr.dst]
            deltas[tr.dst].append((tr.start, 1, graph.tensors[t].nbytes))
            deltas[tr.dst].append((max(readers + [tr.end]), 0, -graph.tensors[t].nbytes))
    peak = []
    for d in range(D):
        live = best = 0.0
        for _, _, x in sorted(deltas[d]):  # at one instant, frees first: a node starts when the last reader ended
            live += x
            best = max(best, live)
        peak.append(resident[d] + best)
    return peak
