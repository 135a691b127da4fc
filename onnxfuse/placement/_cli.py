"""`onnxfuse place`: plan (and optionally run) a model or fused array on several devices.

    onnxfuse place MODEL.onnx --devices 4 [--device-spec devices.yaml] [--order all|topo,...]
                   [--placer all|greedy,heft,shard] [--run] -o PLACE_DIR

PLACE_DIR gets placement.json (the recommended placement node by node, every candidate's figures, devices,
calibration), the recommended placement's sub-models (device_{d}.onnx, plus stages/ when a device runs more than
one stage), results.md (the table and the recommendation) and gantt.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from ..errors import ConfigError, InputFileError, OnnxFuseError
from .devices import format_bytes

__all__ = ["add_place_parser", "cmd_place"]


def add_place_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `place` subcommand."""
    p = subparsers.add_parser("place", help="place a model or fused array on several devices: traversal orders x "
                              "placers, simulated (and with --run measured) step times, a recommendation")
    p.add_argument("model", metavar="MODEL.onnx", help="an ONNX model, a training graph, or ARRAY_DIR/fused.onnx "
                   "(an array folder works too; model-axis sharding needs its array.json and sources/)")
    p.add_argument("--devices", type=int, help="number of equal devices (default 2, or what --device-spec lists)")
    p.add_argument("--device-spec", metavar="YAML", help="devices file: defaults + a list of devices "
                   "(memory, flops, bandwidth, latency, kind, device_id, threads, speed; see docs/placement.md)")
    p.add_argument("--memory", help="memory per device, e.g. 8GiB (default unlimited)")
    p.add_argument("--bandwidth", help="link bandwidth per device, e.g. 10GB/s")
    p.add_argument("--latency", help="link latency per transfer, e.g. 20us")
    p.add_argument("--flops", help="compute rate for estimated costs, e.g. 50GFLOP/s")
    p.add_argument("--threads", type=int, help="intra-op threads of each CPU device's session (default 1)")
    p.add_argument("--order", default="all", help="traversal orders for the greedy placer: all, or a comma list of "
                   "topo, reversed_topo, lexicographic_topo, dfs_preorder, dfs_postorder, reversed_postorder, bfs, "
                   "by_name")
    p.add_argument("--placer", default="all", help="all, or a comma list of greedy, heft, shard")
    p.add_argument("--costs", default="auto", choices=["auto", "profile", "estimate"],
                   help="node costs: profiled with onnxruntime on this machine, or estimated from FLOPs and bytes "
                   "(auto: profile when the model runs here)")
    cal = p.add_mutually_exclusive_group()
    cal.add_argument("--calibrate", dest="calibrate", action="store_true", default=None,
                     help="fit this machine's session/op overheads and link into the devices (default with --run "
                     "and profiled costs when no link flags or device spec are given)")
    cal.add_argument("--no-calibrate", dest="calibrate", action="store_false")
    p.add_argument("--batch-size", type=int, default=32, help="size of the free batch dimension of the inputs "
                   "(default 32)")
    p.add_argument("--dims", help="other free input dimensions by name, e.g. T=16,S=128")
    p.add_argument("--inputs", metavar="FEEDS.npz", help="input arrays by graph input name (their shapes fix the "
                   "dimensions); default: random inputs")
    p.add_argument("--training", action="store_true", help="plan memory for training this forward graph "
                   "(weights x (2 + optimizer slots), every activation kept)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "momentum", "sgd"],
                   help="optimizer whose state --training counts (default adamw: 2 slots)")
    p.add_argument("--granularity", default="stage", choices=["stage", "op"],
                   help="simulate whole sub-models per session call (stage, what --run executes) or single ops")
    p.add_argument("--run", action="store_true", help="also run every distinct placement as a pipeline of "
                   "onnxruntime sessions, check its outputs against the whole model and time it")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per placement with --run (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing (default 3)")
    p.add_argument("-o", "--output", required=True, metavar="PLACE_DIR")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_place)
    return p


def _list(text: str, flag: str, known: list[str]) -> list[str]:
    if text.strip() == "all":
        return list(known)
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"{flag}: give 'all' or a comma list of {', '.join(known)}")
    return items


def _devices(args):
    from .devices import load_device_spec, make_devices

    flags = {k: v for k, v in (("memory", args.memory), ("bandwidth", args.bandwidth), ("latency", args.latency),
                               ("flops", args.flops), ("threads", args.threads)) if v is not None}
    if args.device_spec:
        if flags:
            raise ConfigError(f"--{next(iter(flags))} cannot be combined with --device-spec; put it in the file")
        return load_device_spec(args.device_spec, args.devices)
    return make_devices(args.devices if args.devices is not None else 2, **flags)


def _dims(text: str | None) -> dict[str, int]:
    out = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = int(value)
            if not sep or out[name.strip()] < 1:
                raise ValueError
        except ValueError:
            raise ConfigError(f"--dims: '{item}' is not NAME=POSITIVE_INTEGER (e.g. T=16)") from None
    return out


def _feeds(path: str | None) -> dict[str, np.ndarray] | None:
    if path is None:
        return None
    if not os.path.isfile(path):
        raise InputFileError(f"--inputs '{path}' does not exist")
    try:
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    except Exception as e:
        raise InputFileError(f"--inputs '{path}' is not a readable .npz file ({type(e).__name__})") from e


def _dims_from_feeds(model, feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """Named free dimensions of the graph inputs, read off the given arrays."""
    inits = {t.name for t in model.graph.initializer}
    dims = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if vi.name not in feeds:
            raise ConfigError(f"--inputs has no array '{vi.name}' (it holds {', '.join(sorted(feeds)) or 'nothing'})")
        shape = feeds[vi.name].shape
        spec = vi.type.tensor_type.shape.dim
        if len(shape) != len(spec):
            raise ConfigError(f"--inputs: '{vi.name}' has shape {list(shape)} but the graph input has rank {len(spec)}")
        for d, n in zip(spec, shape):
            if d.HasField("dim_param") and d.dim_param:
                dims[d.dim_param] = int(n)
    return dims


def _say(args, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr, flush=True)


def cmd_place(args) -> int:
    """onnxfuse place: check the flags, build and cost the graph, plan, optionally run, write PLACE_DIR. An
    array folder given as MODEL (or its fused.onnx) is held locked throughout."""
    import contextlib

    from .. import _folder as array_folder
    from .._io import check_output_dir

    model_dir = os.path.dirname(os.path.abspath(args.model))
    array = args.model if array_folder.is_array(args.model) else \
        model_dir if os.path.isfile(args.model) and array_folder.is_array(model_dir) else None
    inputs = [p for p in (array or args.model, args.device_spec, args.inputs) if p]
    array_folder.check_output_location(args.output, inputs)
    check_output_dir(args.output, args.overwrite)
    with array_folder.open_array(array, "place") if array else contextlib.nullcontext():
        return _place(args)


def _place(args) -> int:
    from .plan import measure_plan, plan_placements, recommend, rescale_to_measured, results_table

    devices, orders, placers = _check_flags(args)
    path, model, label, feeds, dims = _inputs(args, placers)
    graph, feeds, shard, profiled = _graph(args, path, model, label, feeds, dims, devices, placers)
    calibration = _maybe_calibrate(args, graph, feeds, devices, profiled)
    if calibration is not None:
        devices = calibration.apply(devices)
    plan = plan_placements(graph, devices, placers, orders, shard, args.granularity, progress=not args.quiet)
    if args.run:
        measure_plan(plan, feeds, args.warmup, args.repeats, probe_contention=calibration is not None,
                     progress=not args.quiet)
        if calibration is not None:
            calibration = rescale_to_measured(plan, calibration)
            plan.notes.append(f"simulated with the kernel scale and contention re-fitted on steps measured "
                              f"alongside ({calibration.kernel_scale:.2f}, {calibration.contention:.2f})")
    table, advice = results_table(plan), recommend(plan)
    files = _write(args, plan, label, profiled, calibration, table, advice)
    print(f"{label} on {len(devices)} device(s): {_setup_line(plan, profiled)}")
    for note in plan.notes:
        print(f"note: {note}")
    print(table)
    print(advice)
    print(f"wrote {args.output}/ (placement.json, {', '.join(files[:3])}{' ...' if len(files) > 3 else ''}, "
          "results.md, gantt.png)")
    return 0


def _check_flags(args):
    """(devices, orders, placers) from the flags; every bad value is reported before any work starts."""
    from .orders import ORDER_NAMES
    from .plan import PLACER_NAMES

    devices = _devices(args)
    orders = _list(args.order, "--order", ORDER_NAMES)
    placers = _list(args.placer, "--placer", PLACER_NAMES)
    for o in orders:
        if o not in ORDER_NAMES:
            raise ConfigError(f"--order: unknown traversal order '{o}'; choose from {', '.join(ORDER_NAMES)} or all")
    if args.repeats < 1 or args.warmup < 0:
        raise ConfigError("--repeats must be at least 1 and --warmup at least 0")
    return devices, orders, placers


def _inputs(args, placers):
    """(model path, model, label, feeds or None, named dims) from MODEL and --inputs / --dims."""
    from .graph import load_model

    path = args.model
    if os.path.isdir(path):
        path = os.path.join(path, "fused.onnx")
        if not os.path.exists(path):
            raise InputFileError(f"'{args.model}' is a folder without fused.onnx; give an ONNX file or an array folder")
    model = load_model(path)
    feeds = _feeds(args.inputs)
    dims = _dims(args.dims)
    if feeds is not None:
        dims.update(_dims_from_feeds(model, feeds))
    is_array = os.path.basename(path) == "fused.onnx" and os.path.exists(
        os.path.join(os.path.dirname(os.path.abspath(path)), "array.json"))
    label = (os.path.basename(os.path.dirname(os.path.abspath(path))) + "/fused.onnx") if is_array else \
        os.path.basename(path)
    return path, model, label, feeds, dims


def _graph(args, path, model, label, feeds, dims, devices, placers):
    """The placement graph, its inputs, the shard plan of a fused array (when sharding is asked for) and
    whether the costs are profiled (the whole array and its sub-arrays in alternation)."""
    from .graph import build_graph, example_feeds
    from .shard import find_array, shard_plan

    _say(args, f"building the graph of {label} ...")
    graph = build_graph(model, label=label, batch_size=args.batch_size, dims=dims, feeds=feeds,
                        training=args.training, optimizer=args.optimizer)
    feeds = feeds if feeds is not None else example_feeds(graph.model)
    array = find_array(path, model) if "shard" in placers else None
    shard, extra = None, []
    if array is not None:
        def sub_feeds(b0, b1):
            return {k: (v[b0:b1] if k in array.per_model_inputs else v) for k, v in feeds.items()}

        def build(sub, sub_label, b0, b1):
            return build_graph(sub, label=sub_label, batch_size=args.batch_size, dims=dims, feeds=sub_feeds(b0, b1),
                               training=args.training, optimizer=args.optimizer)

        _say(args, f"re-fusing {array.B} models into sub-arrays for model-axis sharding ...")
        shard = shard_plan(array, devices, build)
        extra = [(g, sub_feeds(b0, b1)) for g in shard.distinct_graphs()
                 for (_, b0, b1), h in zip(shard.groups, shard.graphs) if h is g]
    profiled = _maybe_profile(args, graph, feeds, extra)
    if shard is not None:
        shard.share_profiles()
    return graph, feeds, shard, profiled


def _maybe_calibrate(args, graph, feeds, devices, profiled):
    """Calibrate this machine's overheads when asked (default: with --run, profiled costs, and no link given)."""
    link_given = args.device_spec or args.bandwidth or args.latency
    wanted = args.calibrate if args.calibrate is not None else (args.run and profiled and not link_given)
    if not wanted:
        return None
    if not profiled:
        raise ConfigError("--calibrate needs profiled costs (--costs profile): the model could not be profiled")
    from .profile import calibrate

    return calibrate(graph, devices, feeds, progress=not args.quiet)


def _write(args, plan, label, profiled, calibration, table, advice) -> list[str]:
    """PLACE_DIR, atomically: the recommended placement's sub-models, gantt.png, placement.json, results.md."""
    from .._io import atomic_dir
    from .gantt import gantt_png

    best = plan.best(measured=args.run)
    with atomic_dir(args.output, args.overwrite) as tmp:
        files, partition = _write_best(plan, best, tmp)
        gantt_png(best.graph, best.sim, plan.devices, os.path.join(tmp, "gantt.png"),
                  title=f"{label}: {best.label}, simulated step {best.sim.step_time * 1e3:.3f} ms",
                  measured=best.measured.spans if best.measured is not None else None)
        doc = _placement_json(plan, best, partition, label, profiled, calibration, files, advice)
        with open(os.path.join(tmp, "placement.json"), "w") as f:
            json.dump(_clean(doc), f, indent=1)
        with open(os.path.join(tmp, "results.md"), "w") as f:
            f.write(f"# Placement of {label} on {len(plan.devices)} device(s)\n\n{_setup_line(plan, profiled)}\n\n"
                    f"{table}\n\n{advice}\n")
    return files


def _maybe_profile(args, graph, feeds, extra=()) -> bool:
    """Profile the graph's nodes (and the ``extra`` (graph, feeds) pairs, in alternation with it) unless
    estimates were asked for; in auto mode fall back to estimates when the model cannot run here."""
    if args.costs == "estimate":
        return False
    try:
        from .profile import profile_graphs

        _say(args, "profiling every node with onnxruntime ...")
        profile_graphs([graph] + [g for g, _ in extra], [feeds] + [f for _, f in extra])
        return True
    except (ImportError, OnnxFuseError, RuntimeError, ValueError) as e:
        if args.costs == "profile":
            why = " ".join(str(e).split())[:200]
            raise ConfigError(f"--costs profile: the model could not be profiled here ({why}); "
                              "use --costs estimate") from e
        print(f"onnxfuse: warning: profiling failed ({' '.join(str(e).split())[:200]}); using FLOP/byte estimates",
              file=sys.stderr)
        return False


def _setup_line(plan, profiled: bool) -> str:
    g = plan.graph
    return (f"{g.kind} graph, {len(g)} nodes, {'profiled' if profiled else 'estimated'} costs, "
            f"{plan.candidates[0].sim.granularity if plan.candidates[0].ok else 'stage'} granularity; devices: "
            + ", ".join(f"{d.name} ({d.kind}, memory {format_bytes(d.memory)})" for d in plan.devices))


def _write_best(plan, best, folder: str) -> tuple[list[str], object]:
    """The recommended placement's sub-models: device_{d}.onnx, and stages/ when a device runs several stages."""
    import onnx

    from .partition import device_model

    partition = plan.partition_of(best)
    files = []
    per_device: dict[int, list] = {}
    for s in partition.stages:
        per_device.setdefault(s.device, []).append(s)
    for d, stages in sorted(per_device.items()):
        name = f"device_{d}.onnx"
        model = stages[0].model if len(stages) == 1 else device_model(best.graph, best.placement.device_of, d)
        onnx.save(model, os.path.join(folder, name))
        files.append(name)
    if any(len(v) > 1 for v in per_device.values()):
        os.makedirs(os.path.join(folder, "stages"))
        for s in partition.stages:
            onnx.save(s.model, os.path.join(folder, "stages", f"{s.label}.onnx"))
        files.append("stages/")
    return files, partition


def _placement_json(plan, best, partition, label, profiled, calibration, files, advice) -> dict:
    g = best.graph
    return {
        "format": "onnxfuse-placement/1",
        "model": label,
        "graph": plan.graph.summary(),
        "costs": "profiled" if profiled else "estimated",
        "calibration": calibration.to_json() if calibration else None,
        "devices": [d.to_json() for d in plan.devices],
        "recommendation": advice,
        "best": {
            "placer": best.placer, "order": best.order,
            "simulated_step_s": best.sim.step_time,
            "measured_step_s": best.measured.median if best.measured is not None else None,
            "files": files,
            "stages": partition.to_json(),
            "placement": {g.names[i]: plan.devices[d].name for i, d in enumerate(best.placement.device_of)},
            **({"shards": best.placement.extra} if best.placer == "shard" else {}),
        },
        "candidates": [c.to_json() for c in plan.candidates],
    }


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
