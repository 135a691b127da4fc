"""A graph placed end to end, from Python: :func:`place_model` and the :class:`PlacementReport` it returns.

    report = place_model("array/fused.onnx", make_devices(2), costs="estimate")
    print(report.table); print(report.recommendation)
    report.save("place")     # placement.json, device_<d>.onnx (+ stages/), results.md, gantt.png

``place_model`` builds and costs the graph, re-fuses a fused array into per-device sub-arrays (when a placer needs
them), profiles and calibrates (the policy: ``costs``, ``calibrate``), plans every placer x traversal order,
optionally runs each distinct placement for real, and recommends one. ``PlacementReport`` owns the output folder:
the placement.json schema (``to_json``) and the recommended placement's per-device models. ``onnxfuse place`` is
this, and a print.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from onnxfuse.core.array import ArrayDir, check_output_location
from onnxfuse.core.errors import ConfigError, OnnxFuseError
from onnxfuse.placement.devices import DeviceSpec, format_bytes, make_devices
from onnxfuse.placement.orders import ORDER_NAMES
from onnxfuse.placement.placers import PLACER_NAMES, PLACERS
from onnxfuse.placement.compare import Candidate, Comparison, check_placers

__all__ = ["PlacementReport", "PlacementWarning", "place_model", "check_place_output", "PLACEMENT_JSON", "RESULTS_MD", "GANTT_PNG", "FORMAT"]

PLACEMENT_JSON, RESULTS_MD, GANTT_PNG, STAGES = "placement.json", "results.md", "gantt.png", "stages"
FORMAT = "onnxfuse-placement/1"  # placement.json's "format"


class PlacementWarning(UserWarning):
    """Placement went on with less than was asked for (e.g. estimated costs where profiling failed)."""


@dataclass
class PlacementReport:
    """Every candidate placement of one graph, the recommended one, and how they were costed.

    ``measured``: the placements were run for real, and the recommendation is by measured step."""

    comparison: Comparison
    label: str
    profiled: bool
    calibration: object | None = None  # profile.Calibration
    measured: bool = False
    table: str = ""
    recommendation: str = ""
    _partition: object | None = field(default=None, repr=False)

    @property
    def best(self) -> Candidate:
        return self.comparison.best(measured=self.measured)

    @property
    def notes(self) -> list[str]:
        return self.comparison.notes

    @property
    def setup(self) -> str:
        """One line: the graph, how it was costed, the granularity and the devices."""
        comparison, g = self.comparison, self.comparison.graph
        c0 = comparison.candidates[0]
        return (f"{g.kind} graph, {len(g)} nodes, {'profiled' if self.profiled else 'estimated'} costs, "
                f"{c0.sim.granularity if c0.ok else 'stage'} granularity; devices: "
                + ", ".join(f"{d.name} ({d.kind}, memory {format_bytes(d.memory)})" for d in comparison.devices))

    @property
    def partition(self):
        """The recommended placement's per-device sub-models."""
        if self._partition is None:
            self._partition = self.comparison.partition_of(self.best)
        return self._partition

    def _per_device(self) -> dict[int, list]:
        per_device: dict[int, list] = {}
        for s in self.partition.stages:
            per_device.setdefault(s.device, []).append(s)
        return dict(sorted(per_device.items()))

    @property
    def device_files(self) -> list[str]:
        """What ``save`` writes for the recommended placement: device_<d>.onnx, and stages/ when a device runs
        more than one stage."""
        per_device = self._per_device()
        files = [f"device_{d}.onnx" for d in per_device]
        return files + [f"{STAGES}/"] if any(len(v) > 1 for v in per_device.values()) else files

    def to_json(self) -> dict:
        """placement.json: the recommended placement node by node, every candidate's figures, the devices and
        the calibration (JSON-safe: numpy scalars as numbers, inf and nan as null)."""
        comparison, best = self.comparison, self.best
        g = best.graph
        return _clean({
            "format": FORMAT,
            "model": self.label,
            "graph": comparison.graph.summary(),
            "costs": "profiled" if self.profiled else "estimated",
            "calibration": self.calibration.to_json() if self.calibration else None,
            "devices": [d.to_json() for d in comparison.devices],
            "recommendation": self.recommendation,
            "best": {
                "placer": best.placer, "order": best.order,
                "simulated_step_s": best.sim.step_time,
                "measured_step_s": best.measured.median if best.measured is not None else None,
                "files": self.device_files,
                "stages": self.partition.to_json(),
                "placement": {g.names[i]: comparison.devices[d].name for i, d in enumerate(best.placement.device_of)},
                **({"shards": best.placement.extra} if best.entry.needs_array else {}),
            },
            "candidates": [c.to_json() for c in comparison.candidates],
        })

    def save(self, folder: str | os.PathLike, overwrite: bool = False) -> list[str]:
        """Write ``folder`` atomically: placement.json, the recommended placement's sub-models (``device_files``),
        results.md and gantt.png; returns the names written. ``overwrite`` replaces a non-empty folder."""
        import json

        import onnx

        from onnxfuse.core._io import atomic_dir
        from onnxfuse.placement.gantt import gantt_png
        from onnxfuse.placement.partition import device_model

        best, comparison = self.best, self.comparison
        with atomic_dir(os.fspath(folder), overwrite, command="place") as tmp:
            per_device = self._per_device()
            for d, stages in per_device.items():
                model = stages[0].model if len(stages) == 1 else device_model(best.graph, best.placement.device_of, d)
                onnx.save(model, os.path.join(tmp, f"device_{d}.onnx"))
            if any(len(v) > 1 for v in per_device.values()):
                os.makedirs(os.path.join(tmp, STAGES))
                for s in self.partition.stages:
                    onnx.save(s.model, os.path.join(tmp, STAGES, f"{s.label}.onnx"))
            gantt_png(best.graph, best.sim, comparison.devices, os.path.join(tmp, GANTT_PNG),
                      title=f"{self.label} placed by {best.label}",
                      measured=best.measured.spans if best.measured is not None else None,
                      measured_step=best.measured.median if best.measured is not None else None)
            with open(os.path.join(tmp, PLACEMENT_JSON), "w") as f:
                json.dump(self.to_json(), f, indent=1)
            with open(os.path.join(tmp, RESULTS_MD), "w") as f:
                f.write(f"# Placement of {self.label} on {len(comparison.devices)} device(s)\n\n{self.setup}\n\n"
                        f"{self.table}\n\n{self.recommendation}\n")
        return [PLACEMENT_JSON, *self.device_files, RESULTS_MD, GANTT_PNG]


def place_model(model: str | os.PathLike, devices: Sequence[DeviceSpec] | int = 2, *,
                placers: Sequence[str] | str = "all", orders: Sequence[str] | str = "all", costs: str = "auto",
                calibrate: bool | None = None, batch_size: int = 32, dims: Mapping[str, int] | None = None,
                feeds: Mapping[str, np.ndarray] | None = None, training: bool = False, optimizer: str | int = "adamw",
                granularity: str = "stage", run: bool = False, repeats: int = 20, warmup: int = 3,
                progress: bool = False) -> PlacementReport:
    """Place the ONNX graph ``model`` (a model, a training graph, ``ARRAY_DIR/fused.onnx`` or an array folder)
    on ``devices`` (DeviceSpec objects, or a number of equal ones) with every placer of ``placers`` ('all' or names
    from ``placers.PLACERS``; greedy once per traversal order of ``orders``), simulate each, and with ``run`` run
    each distinct placement for real (checking its outputs against the whole model and timing it).

    ``costs``: 'profile' (onnxruntime on this machine), 'estimate' (FLOPs and bytes), or 'auto' (profile when the
    model runs here; otherwise estimate, with a warning). ``calibrate``: fit this machine's overheads into the
    devices; None calibrates with ``run`` when the costs are profiled. ``feeds`` (arrays by graph input name) fix
    the free dimensions, as ``batch_size`` and ``dims`` do otherwise. ``training`` plans memory for training a
    forward graph with ``optimizer``'s state. An array folder is held locked throughout."""
    orders = list(ORDER_NAMES) if orders == "all" else list(orders)
    placers = list(PLACER_NAMES) if placers == "all" else list(placers)
    for o in orders:
        if o not in ORDER_NAMES:
            raise ConfigError(f"orders: unknown traversal order '{o}'; choose from {', '.join(ORDER_NAMES)} or all")
    check_placers(placers)
    if costs not in ("auto", "profile", "estimate"):
        raise ConfigError(f"costs: '{costs}' is not auto, profile or estimate")
    if repeats < 1 or warmup < 0:
        raise ConfigError("repeats= must be at least 1 and warmup= at least 0")
    devices = make_devices(devices) if isinstance(devices, int) else list(devices)
    array = ArrayDir.holding(model)
    with array.locked("place") if array is not None else contextlib.nullcontext():
        return _place(os.fspath(model), devices, placers, orders, costs, calibrate, batch_size, dict(dims or {}),
                      feeds, training, optimizer, granularity, run, repeats, warmup, progress)


def check_place_output(output: str | os.PathLike, model: str | os.PathLike,
                       other_inputs: Sequence[str | os.PathLike | None] = (), overwrite: bool = False) -> None:
    """Refuse, before any work, an output folder that is, is inside or contains an input (the array folder as a
    whole when ``model`` is one or its graph: ``place`` reads its sources), and a non-empty one without
    ``overwrite``."""
    from onnxfuse.core._io import check_output_dir

    array = ArrayDir.holding(model)
    inputs = [array.path if array is not None else model] + [p for p in other_inputs if p]
    check_output_location(output, inputs)
    check_output_dir(os.fspath(output), overwrite)


def _say(progress: bool, msg: str) -> None:
    if progress:
        import sys

        print(msg, file=sys.stderr, flush=True)


def _place(path, devices, placers, orders, costs, calibrate, batch_size, dims, feeds, training, optimizer,
           granularity, run, repeats, warmup, progress) -> PlacementReport:
    from onnxfuse.core._io import read_model
    from onnxfuse.placement.graph import build_graph, example_feeds
    from onnxfuse.placement.compare import (compare_placements, measure_candidates, recommend, rescale_to_measured,
                                            results_table)
    from onnxfuse.placement.shard import find_array, shard_array

    if os.path.isdir(path):
        path = ArrayDir(path).graph_path()
    model, label = read_model(path)
    if feeds is not None:
        dims.update(_dims_from_feeds(model, feeds))
    array = ArrayDir.of_fused(path)
    label = array.label if array is not None else label

    _say(progress, f"building the graph of {label} ...")
    graph = build_graph(model, label=label, batch_size=batch_size, dims=dims, feeds=feeds, training=training,
                        optimizer=optimizer)
    feeds = feeds if feeds is not None else example_feeds(graph.model)
    info = find_array(path, model) if any(PLACERS[p].needs_array for p in placers) else None
    shard, extra = None, []
    if info is not None:
        def sub_feeds(b0, b1):
            return {k: (v[b0:b1] if k in info.per_model_inputs else v) for k, v in feeds.items()}

        def build(sub, sub_label, b0, b1):
            return build_graph(sub, label=sub_label, batch_size=batch_size, dims=dims, feeds=sub_feeds(b0, b1),
                               training=training, optimizer=optimizer)

        _say(progress, f"re-fusing {info.B} models into sub-arrays for model-axis sharding ...")
        shard = shard_array(info, devices, build)
        extra = [(g, sub_feeds(b0, b1)) for g in shard.distinct_graphs()
                 for (_, b0, b1), h in zip(shard.groups, shard.graphs) if h is g]
    profiled = _maybe_profile(costs, graph, feeds, extra, progress)
    if shard is not None:
        shard.share_profiles()

    calibration = None
    if calibrate if calibrate is not None else (run and profiled):
        if not profiled:
            raise ConfigError("calibrate=True needs profiled costs, costs='profile': the model could not be profiled")
        from onnxfuse.placement.profile import calibrate as fit_overheads

        calibration = fit_overheads(graph, devices, feeds, progress=progress)
        devices = calibration.apply(devices)

    comparison = compare_placements(graph, devices, placers, orders, shard, granularity, progress=progress)
    if run:
        measure_candidates(comparison, feeds, warmup, repeats, probe_contention=calibration is not None,
                           progress=progress)
        if calibration is not None:
            calibration = rescale_to_measured(comparison, calibration)
            comparison.notes.append(f"simulated with the kernel scale and contention re-fitted on steps measured "
                              f"alongside ({calibration.kernel_scale:.2f}, {calibration.contention:.2f})")
    return PlacementReport(comparison, label, profiled, calibration, measured=run, table=results_table(comparison),
                           recommendation=recommend(comparison))


def _dims_from_feeds(model, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Named free dimensions of the graph inputs, read off the given arrays."""
    inits = {t.name for t in model.graph.initializer}
    dims = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if vi.name not in feeds:
            raise ConfigError(f"feeds: no array for graph input '{vi.name}' (it holds "
                              f"{', '.join(sorted(feeds)) or 'nothing'})")
        shape = feeds[vi.name].shape
        spec = vi.type.tensor_type.shape.dim
        if len(shape) != len(spec):
            raise ConfigError(f"feeds: '{vi.name}' has shape {list(shape)} but the graph input has rank {len(spec)}")
        for d, n in zip(spec, shape):
            if d.HasField("dim_param") and d.dim_param:
                dims[d.dim_param] = int(n)
    return dims


def _maybe_profile(costs: str, graph, feeds, extra, progress: bool) -> bool:
    """Profile the graph's nodes (and the ``extra`` (graph, feeds) pairs, in alternation with it) unless
    estimates were asked for; in auto mode fall back to estimates (with a warning) when the model cannot run
    here."""
    if costs == "estimate":
        return False
    try:
        from onnxfuse.placement.profile import profile_graphs

        _say(progress, "profiling every node with onnxruntime ...")
        profile_graphs([graph] + [g for g, _ in extra], [feeds] + [f for _, f in extra])
        return True
    except (ImportError, OnnxFuseError, RuntimeError, ValueError) as e:
        why = " ".join(str(e).split())[:200]
        if costs == "profile":
            raise ConfigError(f"costs='profile': the model could not be profiled here ({why}); "
                              "use costs='estimate'") from e
        warnings.warn(f"profiling failed ({why}); using FLOP/byte estimates", PlacementWarning, stacklevel=3)
        return False


def _clean(o):
    """JSON-safe: numpy scalars as Python numbers, inf and nan as null."""
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, (np.floating, np.integer)):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o
