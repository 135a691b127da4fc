"""The traversal-order study: every order x placer on zoo graphs of several families, device counts and device
settings, with simulated step times from profiled node costs.

    python benchmarks/placement_study.py [--devices 2,4] [--batch-size 32] [--out study.md]

Families: CNN (resnet18, mobilenetv2), transformer (transformer_lm, bert_tiny, vit_tiny), fused array (LeNet x2,
x4, x8, ResNet-18 x4; model-axis sharding competes), training graph (onnxruntime training graphs with their
backward pass and AdamW update: LeNet x4, transformer_lm x2). Settings:

- ``cpu``: CPU devices like this machine's, one thread each: session-call, per-op and link overheads calibrated
  here, stage granularity (what `onnxfuse place --run` executes); the devices are independent (contention 0):
  this 2-vCPU VM's own contention swings between 0 and 1 from minute to minute, which would make the study
  about the VM's neighbours instead of the orders.
- ``placeto``: Placeto's simulator parameters (7.6 GB/s, 25 us per transfer, 5.7 us per op; op granularity)
  on the same profiled costs: the setting of the paper's experiments.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _order_study import StudyCase, order_summary, run_study, study_table  # noqa: E402
from _placement_zoo import profiled_array, profiled_model, profiled_training_graph  # noqa: E402

from onnxfuse.placement import make_devices  # noqa: E402
from onnxfuse.placement.profile import calibrate  # noqa: E402

PLACETO = dict(bandwidth="7.6GB/s", latency="25us", op_overhead="5.7us")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="2,4", help="device counts (default 2,4)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    ap.add_argument("--quick", action="store_true", help="one graph per family (a smoke run)")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.devices.split(",")]
    batch = args.batch_size

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="placement-study-") as tmp:
        graphs = []  # (family, label, graph, {D: sharding} or None)
        models = [("CNN", "resnet18"), ("CNN", "mobilenetv2"), ("transformer", "transformer_lm"),
                  ("transformer", "bert_tiny"), ("transformer", "vit_tiny")]
        arrays = [("lenet", 2), ("lenet", 4), ("lenet", 8), ("resnet18", 4)]
        training = [("lenet", 4), ("transformer_lm", 2)]
        if args.quick:
            models, arrays, training = models[::2][:2], arrays[1:2], training[:1]
        for family, name in models:
            say(f"profiling {name}")
            g, feeds = profiled_model(name, os.path.join(tmp, name), batch)
            graphs.append((family, name, g, None))
            if name == "resnet18":
                ref = (g, feeds)
        for name, B in arrays:
            say(f"fusing and profiling {name} x{B}")
            shards = {}
            for D in counts:
                g, _, sharding = profiled_array(name, B, os.path.join(tmp, f"{name}x{B}"), batch, make_devices(D))
                shards[D] = sharding
            graphs.append(("fused array", f"{name} x{B}", g, shards))
        for name, B in training:
            say(f"building and profiling the training graph of {name} x{B}")
            g, _ = profiled_training_graph(name, B, os.path.join(tmp, f"{name}x{B}-train"), batch)
            graphs.append(("training graph", f"{name} x{B} (train)", g, None))
        if "ref" not in locals():
            ref = profiled_model("resnet18", os.path.join(tmp, "ref"), batch)
        say("calibrating this machine's overheads and link on resnet18")
        cal = calibrate(ref[0], make_devices(2), ref[1], progress=True)

        cases = []
        for setting in ("cpu", "placeto"):
            for family, label, g, shards in graphs:
                for D in counts:
                    if setting == "cpu":  # this machine's overheads, devices independent (see the docstring)
                        devs = [dataclasses.replace(d, contention=0.0) for d in cal.apply(make_devices(D))]
                    else:
                        devs = make_devices(D, **PLACETO)
                    case = StudyCase(family, label, g, devs, setting, shards[D] if shards else None)
                    cases.append(case)
        run_study([c for c in cases if c.setting == "cpu"], granularity="stage")
        run_study([c for c in cases if c.setting == "placeto"], granularity="op")

    command = "python benchmarks/placement_study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"`{command.strip()}` — {datetime.date.today()}, {platform.machine()} "
              f"{os.cpu_count()} cores, batch {batch}; simulated step in ms, fastest greedy order in bold.\n\n"
              f"Calibration (cpu setting): session call {cal.call_overhead * 1e6:.1f} us, per op "
              f"{cal.op_overhead * 1e6:.2f} us, kernel scale {cal.kernel_scale:.2f}, link latency "
              f"{cal.latency * 1e6:.1f} us, bandwidth {cal.bandwidth / 1e9:.1f} GB/s (contention measured "
              f"{cal.contention:.2f}, not used: independent devices).")
    text = "\n\n".join([header, "### Every case", study_table(cases),
                        "### Orders per family (cpu setting): geometric-mean slowdown vs. the case's best order "
                        "(wins)", order_summary([c for c in cases if c.setting == "cpu"]),
                        "### Orders per family (placeto setting)", order_summary([c for c in cases
                                                                                   if c.setting == "placeto"])])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
