"""Every placer x traversal order on one graph: place, simulate, optionally run for real, compare, recommend.

This is what ``onnxfuse place`` and the study run. A *candidate* is one (placer, order) of the placer table
(``placers.PLACERS``); its baseline, ``single`` (everything on device 0), is always evaluated: speedups are
relative to it.
"""
from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from onnxfuse.core.errors import ConfigError, PlacementError
from onnxfuse.placement.costs import CostTable, cost_table
from onnxfuse.placement.devices import DeviceSpec, format_bytes
from onnxfuse.placement.execute import PipelineRunner, RunResult, max_rel_error, run_whole
from onnxfuse.placement.graph import PlacementGraph
from onnxfuse.placement.orders import ORDER_NAMES
from onnxfuse.placement.partition import Partition, partition_graph
from onnxfuse.placement.placers import BASELINE, PLACER_NAMES, PLACERS, Placement, Placer, check_memory, place
from onnxfuse.placement.shard import Sharding, shard_partition
from onnxfuse.placement.simulate import SimResult, simulate

__all__ = ["Candidate", "Comparison", "PLACER_NAMES", "check_placers", "compare_placements", "measure_candidates",
           "rescale_to_measured",
           "results_table", "recommend"]

_PAIR = "(two copies at once)"


@dataclass
class Candidate:
    """One placer (and order) on one graph: its placement, simulated step and, when run, measured step."""

    placer: str
    order: str | None
    graph: PlacementGraph
    costs: CostTable
    placement: Placement | None = None
    sim: SimResult | None = None
    error: str | None = None
    measured: RunResult | None = None
    output_error: float | None = None
    same_as: str | None = None  # label of an identical placement measured instead

    @property
    def label(self) -> str:
        return f"{self.placer}/{self.order}" if self.order else self.placer

    @property
    def entry(self) -> Placer:
        """The placer table's entry (a placement a caller built itself counts as an ordinary placer)."""
        return PLACERS.get(self.placer) or Placer(self.placer, "a placement given by the caller")

    @property
    def ok(self) -> bool:
        return self.sim is not None

    def to_json(self) -> dict:
        d: dict = {"placer": self.placer, "order": self.order, "error": self.error}
        if self.sim is not None:
            d.update(self.sim.to_json())
            d["devices_used"] = self.placement.devices_used()
            d["placer_estimate_s"] = None if math.isnan(self.placement.estimate) else self.placement.estimate
        if self.measured is not None:
            d["measured_median_s"] = self.measured.median
            d["measured_best_s"] = self.measured.best
            d["output_max_rel_error"] = self.output_error
        return d


@dataclass
class Comparison:
    graph: PlacementGraph
    devices: list[DeviceSpec]
    candidates: list[Candidate]
    shard: Sharding | None = None
    notes: list[str] = field(default_factory=list)
    contention_measured: float | None = None  # from the two-copies probe run alongside the placements

    @property
    def baseline(self) -> Candidate | None:
        return next((c for c in self.candidates if c.placer == BASELINE and c.ok), None)

    def ranked(self, measured: bool = False) -> list[Candidate]:
        """Candidates that placed, fastest first (by measured median when asked and available)."""
        def key(c: Candidate) -> tuple:  # ties: less traffic, fewer devices, the baseline, then by name
            t = c.measured.median if measured and c.measured is not None else c.sim.step_time
            return (t, c.sim.bytes_moved, c.placement.devices_used(), c.placer != BASELINE, c.label)
        return sorted((c for c in self.candidates if c.ok), key=key)

    def best(self, measured: bool = False) -> Candidate:
        ranked = self.ranked(measured)
        return ranked[0] if ranked else self.baseline

    def partition_of(self, c: Candidate) -> Partition:
        if c.entry.needs_array:
            return shard_partition(self.shard, len(self.devices))
        return partition_graph(c.graph, c.placement, len(self.devices))


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def check_placers(placers: Sequence[str]) -> None:
    """A ConfigError naming the first of ``placers`` that the placer table does not have."""
    unknown = [p for p in placers if p not in PLACERS]
    if unknown:
        raise ConfigError(f"placers: unknown placer '{unknown[0]}'; choose from {', '.join(PLACER_NAMES)} or all")


def compare_placements(graph: PlacementGraph, devices: Sequence[DeviceSpec], placers: Sequence[str] = PLACER_NAMES,
                       orders: Sequence[str] = ORDER_NAMES, shard: Sharding | None = None,
                       granularity: str = "stage", progress: bool = False) -> Comparison:
    """Place and simulate ``graph`` with every requested placer (those with ``orders`` once per order). ``shard``
    is the model-axis sharding of a fused array (needed for the 'shard' placer; skipped for other graphs unless asked
    for alone). A graph that fits with no placer raises the first placer's PlacementError."""
    devices = list(devices)
    check_placers(placers)
    if shard is None and placers and all(PLACERS[p].needs_array for p in placers):
        raise PlacementError(f"{graph.label}: model-axis sharding needs a fused array: pass ARRAY_DIR/fused.onnx "
                             "(with array.json and sources/ next to it)")
    costs = cost_table(graph, devices)
    comparison = Comparison(graph, devices, [])
    todo: list[tuple[str, str | None]] = [(BASELINE, None)]
    for p in placers:
        if PLACERS[p].orders:
            todo += [(p, o) for o in orders]
        elif PLACERS[p].needs_array and shard is None:
            comparison.notes.append(f"{p}: not a fused array (give ARRAY_DIR/fused.onnx to shard the model axis)")
        elif p != BASELINE:
            todo.append((p, None))
    first_error: PlacementError | None = None
    for k, (p, order) in enumerate(todo):
        _say(progress, f"[{k + 1}/{len(todo)}] {p}{'/' + order if order else ''}")
        if PLACERS[p].needs_array:
            c = Candidate(p, None, shard.union, cost_table(shard.union, devices), shard.placement)
            try:
                check_memory(shard.union, shard.placement.device_of, devices)
            except PlacementError as e:
                c.error, first_error = str(e), first_error or e
                comparison.candidates.append(c)
                continue
        else:
            c = Candidate(p, order, graph, costs)
            try:
                c.placement = place(graph, costs, p, order)
            except PlacementError as e:
                c.error = str(e)
                if p != BASELINE:
                    first_error = first_error or e
                comparison.candidates.append(c)
                continue
        c.sim = simulate(c.graph, c.costs, c.placement, granularity)
        comparison.candidates.append(c)
    if not any(c.ok and c.placer != BASELINE for c in comparison.candidates) and first_error is not None:
        raise first_error
    comparison.shard = shard
    return comparison


def measure_candidates(comparison: Comparison, feeds: Mapping[str, np.ndarray], warmup: int = 3,
                       repeats: int = 20, which: Callable[[Candidate], bool] | None = None, rounds: int = 5,
                       probe_contention: bool = False, progress: bool = False) -> None:
    """Run the partitioned graph of every placed candidate (each distinct placement once), time it, and check
    its outputs against the whole model run in one session.

    The placements take turns: ``rounds`` rounds, each running every placement ``repeats / rounds`` steps, and
    a placement's time is the median of all its steps. On a shared machine a burst of someone else's load then
    hits every placement alike instead of whichever happened to run during it. ``probe_contention`` adds the
    whole model run on two devices at once to the rounds (``comparison.contention_measured``, for
    ``rescale_to_measured``): how much two devices of this machine slow each other down right now.
    """
    fresh = comparison.graph.kind == "training graph"
    expected = run_whole(comparison.graph.model, feeds, comparison.devices[0])
    chosen = [c for c in comparison.candidates if c.ok and (which is None or which(c))]
    unique: dict[tuple, Candidate] = {}
    for c in chosen:
        unique.setdefault(_placement_key(c), c)
    runners = {}
    try:
        for k, c in enumerate(unique.values()):
            _say(progress, f"loading [{k + 1}/{len(unique)}] {c.label}")
            runners[c.label] = PipelineRunner(comparison.partition_of(c), comparison.devices)
        probe = probe_contention and len(comparison.devices) > 1 and comparison.baseline is not None
        if probe:
            from onnxfuse.placement.profile import pair_partition

            runners[_PAIR] = PipelineRunner(pair_partition(comparison.graph), comparison.devices)
        times: dict[str, list[float]] = {label: [] for label in runners}
        outputs: dict[str, dict] = {}
        spans: dict[str, list] = {}
        per_round = max(1, math.ceil(repeats / max(1, rounds)))
        for r in range(max(1, rounds)):
            _say(progress, f"running round {r + 1}/{max(1, rounds)} of {len(runners)} placements")
            for label, runner in runners.items():
                for k in range((warmup if r == 0 else 0) + per_round):
                    step_feeds = {n: np.array(v, copy=True) for n, v in feeds.items()} if fresh else feeds
                    outputs[label], wall, spans[label] = runner.step(step_feeds)
                    if r > 0 or k >= warmup:
                        times[label].append(wall)
    finally:
        for runner in runners.values():
            runner.close()
    if probe:
        base = unique[_placement_key(comparison.baseline)].label
        comparison.contention_measured = statistics.median(times[_PAIR]) / statistics.median(times[base]) - 1.0
    for c in chosen:
        twin = unique[_placement_key(c)]
        c.measured = RunResult(times[twin.label], outputs[twin.label], spans[twin.label])
        c.output_error = max_rel_error(outputs[twin.label], expected)
        c.same_as = None if twin is c else twin.label


def _placement_key(c: Candidate) -> tuple:
    """Candidates with equal keys run the same partitioned graph (a sharded array is another graph)."""
    return c.entry.needs_array, tuple(c.placement.device_of)


def rescale_to_measured(comparison: Comparison, calibration) -> object:
    """Re-fit the calibration's kernel scale on the one-device step measured in the same rounds as the
    partitioned ones (and its contention on the two-copies probe, when ``measure_candidates`` ran it), and re-simulate
    every candidate with them (placements unchanged). Returns the new calibration.

    The speed of a shared machine drifts by tens of percent over seconds; anchoring the scale on a run measured
    alongside makes the comparison of simulated and measured steps about the placement, not the drift. The
    single-device candidate agrees by construction; every other one is a prediction.
    """
    import dataclasses

    from onnxfuse.placement.profile import fit_calibration

    base = comparison.baseline
    if base is None or base.measured is None or comparison.graph.measured_s is None:
        return calibration
    c, o = calibration.call_overhead, calibration.op_overhead
    contention = calibration.contention if comparison.contention_measured is None else comparison.contention_measured
    graph = comparison.graph
    refit = fit_calibration(c + o, c + 64 * o, 64, base.measured.median, sum(graph.measured_s), len(graph),
                            contention=contention)
    calibration = dataclasses.replace(calibration, kernel_scale=refit.kernel_scale, whole_s=base.measured.median,
                                      contention=refit.contention)
    comparison.devices = calibration.apply(comparison.devices)
    for cand in comparison.candidates:
        if cand.ok:
            cand.costs = cost_table(cand.graph, comparison.devices)
            cand.sim = simulate(cand.graph, cand.costs, cand.placement, cand.sim.granularity)
    return calibration


def _ms(t: float | None) -> str:
    return "–" if t is None or math.isnan(t) else f"{t * 1e3:.3f}"


def results_table(comparison: Comparison) -> str:
    """Markdown table: one row per candidate, simulated (and measured) step, speedup, traffic, memory."""
    base = comparison.baseline
    measured = any(c.measured is not None for c in comparison.candidates)
    head = ["placer", "order", "devices used", "simulated ms", "speedup", "moved", "peak memory"]
    if measured:
        head += ["measured ms", "sim / measured", "outputs"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in comparison.candidates:
        if not c.ok:
            cells = [c.placer, c.order or "–", "–", "does not fit" if "fit" in (c.error or "") else "error",
                     "–", "–", "–"] + (["–", "–", "–"] if measured else [])
            rows.append("| " + " | ".join(cells) + " |")
            continue
        speed = f"{base.sim.step_time / c.sim.step_time:.2f}x" if base is not None and c.sim.step_time > 0 else "–"
        cells = [c.placer, c.order or "–", str(c.placement.devices_used()), _ms(c.sim.step_time), speed,
                 format_bytes(c.sim.bytes_moved), format_bytes(max(c.sim.peak_memory))]
        if measured:
            if c.measured is None:
                cells += ["–", "–", "–"]
            else:
                ratio = c.sim.step_time / c.measured.median
                equal = c.output_error is not None and c.output_error < 1e-4
                ok = "equal" if equal else f"differ ({c.output_error:.1e})"
                cells += [_ms(c.measured.median), f"{ratio:.2f}", ok]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def recommend(comparison: Comparison) -> str:
    """One paragraph: the best candidate, how much faster than one device, and the best traversal order(s)."""
    measured = any(c.measured is not None for c in comparison.candidates)
    best = comparison.best(measured)
    base = comparison.baseline
    if best is None:
        return "no placement fits these devices"
    basis = "measured" if measured and best.measured is not None else "simulated"
    t = best.measured.median if basis == "measured" else best.sim.step_time
    text = f"recommended: {best.label} ({basis} step {_ms(t)} ms"
    if base is not None:
        t0 = base.measured.median if basis == "measured" and base.measured is not None else base.sim.step_time
        text += f", {t0 / t:.2f}x one device" if t > 0 else ""
    text += f", {best.placement.devices_used()} of {len(comparison.devices)} devices used)"
    if best.entry.needs_array:
        text += f"; models per device: {best.placement.extra.get('models')}"
    greedy = [c for c in comparison.candidates if c.entry.orders and c.ok]
    if greedy:
        fastest = min(c.sim.step_time for c in greedy)
        winners = [c.order for c in greedy if c.sim.step_time <= fastest * 1.0005]
        if len(winners) == len(greedy) > 1:
            text += f". Every traversal order gives the greedy placer the same step ({_ms(fastest)} ms simulated)"
        else:
            text += f". Best traversal order for the greedy placer: {', '.join(winners)} ({_ms(fastest)} ms simulated)"
    if best.placement.devices_used() == 1 and len(comparison.devices) > 1:
        text += ". One device is fastest: moving tensors between devices costs more than the parallelism gains"
    return text + "."
