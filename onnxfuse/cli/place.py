"""`onnxfuse place`: plan (and optionally run) a model or fused array on several devices.

    onnxfuse place MODEL.onnx --devices 4 [--device-spec devices.yaml] [--order all|topo,...]
                   [--placer all|greedy,heft,shard] [--run] -o PLACE_DIR

PLACE_DIR gets placement.json (the recommended placement node by node, every candidate's figures, devices,
calibration), the recommended placement's sub-models (device_{d}.onnx, plus stages/ when a device runs more than
one stage), results.md (the table and the recommendation) and gantt.png.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from onnxfuse.cli._args import at_least
from onnxfuse.cli._flags import one_line
from onnxfuse.core.errors import ConfigError
from onnxfuse.placement.orders import ORDER_NAMES
from onnxfuse.placement.placers import PLACER_NAMES, PLACERS

__all__ = ["add_place_parser", "cmd_place"]


def _optimizer_choices() -> list[str]:
    """The training optimizers (one registry, onnxfuse/recipe/settings.py), and "momentum": SGD with momentum."""
    from onnxfuse.placement.graph import optimizer_names

    return optimizer_names()


def _optimizer(name: str) -> str:
    """--optimizer's value: one of ``_optimizer_choices``."""
    if name not in _optimizer_choices():
        raise argparse.ArgumentTypeError(f"invalid choice: '{name}' (choose from {', '.join(_optimizer_choices())})")
    return name


def _state_slots(name: str) -> int:
    """The state buffers per weight training keeps for --optimizer ``name`` (placement's ``optimizer_state_slots``:
    the registered optimizer's maths at the default hyper-parameters)."""
    from onnxfuse.placement.graph import optimizer_state_slots

    return optimizer_state_slots(name)


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
    p.add_argument("--placer", default="all", metavar="all|" + ",".join(PLACER_NAMES),
                   help="placers: all, or a comma list of " + "; ".join(
                       f"{name} ({PLACERS[name].help})" for name in PLACER_NAMES))
    p.add_argument("--costs", default="auto", choices=["auto", "profile", "estimate"],
                   help="node costs: profiled with onnxruntime on this machine, or estimated from FLOPs and bytes "
                   "(auto: profile when the model runs here)")
    cal = p.add_mutually_exclusive_group()
    cal.add_argument("--calibrate", dest="calibrate", action="store_true", default=None,
                     help="fit this machine's session/op overheads and link into the devices (default with --run "
                     "and profiled costs when no link flags or device spec are given)")
    cal.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                     help="keep the devices' overheads and link as given (or the defaults)")
    p.add_argument("--batch-size", type=at_least(1), default=32, help="size of the free batch dimension of the inputs "
                   "(default 32)")
    p.add_argument("--dims", help="other free input dimensions by name, e.g. T=16,S=128")
    p.add_argument("--inputs", metavar="FEEDS.npz", help="input arrays by graph input name (their shapes fix the "
                   "dimensions); default: random inputs")
    p.add_argument("--training", action="store_true", help="plan memory for training this forward graph "
                   "(weights x (2 + optimizer slots), every activation kept)")
    p.add_argument("--optimizer", default="adamw", type=_optimizer,
                   metavar="{" + ",".join(_optimizer_choices()) + "}",
                   help="optimizer whose state --training counts (default adamw: 2 slots; momentum: SGD with "
                   "momentum, 1 slot)")
    p.add_argument("--granularity", default="stage", choices=["stage", "op"],
                   help="simulate whole sub-models per session call (stage, what --run executes) or single ops")
    p.add_argument("--run", action="store_true", help="also run every distinct placement as a pipeline of "
                   "onnxruntime sessions, check its outputs against the whole model and time it")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per placement with --run (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing (default 3)")
    p.add_argument("-o", "--output", required=True, metavar="PLACE_DIR",
                   help="the folder for placement.json, the devices' sub-models, results.md and gantt.png")
    p.add_argument("--overwrite", action="store_true", help="replace PLACE_DIR")
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
    from onnxfuse.placement.devices import load_device_spec, make_devices

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
    from onnxfuse.recipe.data import load_npz

    if path is None:
        return None
    return load_npz(path, "--inputs", "write one with numpy.savez(path, NAME=array, ...), one array per graph input")


def cmd_place(args) -> int:
    """onnxfuse place: check the flags, place (``place_model``, which holds an array folder locked), print, write
    PLACE_DIR (``PlacementReport.save``)."""
    from onnxfuse.core._io import claim_output
    from onnxfuse.placement.result import check_place_output

    check_place_output(args.output, args.model, [args.device_spec, args.inputs], args.overwrite)
    with claim_output(args.output, "place", overwrite=args.overwrite):  # no other command writes there meanwhile
        return _place_and_save(args)


def _place_and_save(args) -> int:
    import warnings

    from onnxfuse.placement.result import GANTT_PNG, PLACEMENT_JSON, RESULTS_MD, PlacementWarning, place_model

    devices = _devices(args)
    orders = _list(args.order, "--order", ORDER_NAMES)
    placers = _list(args.placer, "--placer", PLACER_NAMES)
    feeds, dims = _feeds(args.inputs), _dims(args.dims)
    # the default calibrates with --run, unless the link was given (flags or a device file): keep it then
    link_given = args.device_spec or args.bandwidth or args.latency
    calibrate = args.calibrate if args.calibrate is not None or not link_given else False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlacementWarning)
        report = place_model(args.model, devices, placers=placers, orders=orders, costs=args.costs,
                             calibrate=calibrate, batch_size=args.batch_size, dims=dims, feeds=feeds,
                             training=args.training, optimizer=_state_slots(args.optimizer),
                             granularity=args.granularity, run=args.run, repeats=args.repeats,
                             warmup=args.warmup, progress=not args.quiet)
    for w in caught:  # placement's own warnings as one line each; any other as Python shows it
        if issubclass(w.category, PlacementWarning):
            print(f"onnxfuse: warning: {one_line(w.message, 'place')}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    report.save(args.output, args.overwrite)
    files = report.device_files
    print(f"{report.label} on {len(report.comparison.devices)} device(s): {report.setup}")
    for note in report.notes:
        print(f"note: {note}")
    print(report.table)
    print(report.recommendation)
    print(f"wrote {args.output}/ ({PLACEMENT_JSON}, {', '.join(files[:3])}{' ...' if len(files) > 3 else ''}, "
          f"{RESULTS_MD}, {GANTT_PNG})")
    return 0
