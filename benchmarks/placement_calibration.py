"""Does the simulator predict real partitioned runs? Simulated vs. measured step time of every distinct
placement of zoo graphs on 2 CPU "devices" (one onnxruntime session thread each) on this machine.

    python benchmarks/placement_calibration.py [--models resnet18,transformer_lm,mobilenetv2]
        [--arrays lenet:4,resnet18:4] [--batch-size 32] [--rounds 10] [--repeats 40] [--out FILE]

Per graph: profile every node (one thread), calibrate the session-call, per-op and link overheads
(``onnxfuse.placement.profile.calibrate``), place with every placer x order plus a two-stage pipeline cut at the
middle of the graph ("halves"), run every distinct placement as a pipeline of sessions, interleaved in rounds,
re-fit the kernel scale on the one-device run and the contention on the whole model run on both devices at
once, both measured in the same rounds (the machine's speed, and how much its two CPUs slow each other down,
drift by tens of percent over seconds), and compare. The criterion of the placement docs: within 30%.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _placement_zoo import profiled_array, profiled_model  # noqa: E402

from onnxfuse.placement import Placement, make_devices, simulate  # noqa: E402
from onnxfuse.placement.orders import topological  # noqa: E402
from onnxfuse.placement.partition import assign_stages  # noqa: E402
from onnxfuse.placement.compare import (Candidate, compare_placements, measure_candidates,  # noqa: E402
                                        rescale_to_measured)
from onnxfuse.placement.profile import calibrate  # noqa: E402


def add_halves(comparison) -> None:
    """A two-stage pipeline: the first half of the nodes (topological order) on device 0, the rest on 1."""
    g = comparison.graph
    order = topological(g.dag)
    device_of = [0] * len(g)
    for i in order[len(order) // 2:]:
        device_of[i] = 1
    c = Candidate("halves", None, g, comparison.candidates[0].costs, Placement(device_of, "halves"))
    c.sim = simulate(g, c.costs, c.placement, "stage")
    comparison.candidates.append(c)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,transformer_lm,mobilenetv2")
    ap.add_argument("--arrays", default="lenet:4,resnet18:4", help="NAME:B fused arrays (sharding competes)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=40, help="timed steps per placement, spread over the rounds")
    ap.add_argument("--out", help="also write the report (markdown) to this file")
    args = ap.parse_args(argv)
    batch = args.batch_size
    devices = make_devices(2)
    lines, verdicts = [], []

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    jobs = [(m, None) for m in args.models.split(",") if m] + \
           [(a.split(":")[0], int(a.split(":")[1])) for a in args.arrays.split(",") if a]
    with tempfile.TemporaryDirectory(prefix="placement-cal-") as tmp:
        for name, B in jobs:
            label = name if B is None else f"{name} x{B}"
            say(f"== {label}: profiling")
            if B is None:
                g, feeds = profiled_model(name, os.path.join(tmp, name), batch)
                shard = None
            else:
                g, feeds, shard = profiled_array(name, B, os.path.join(tmp, label), batch, devices)
            say(f"== {label}: calibrating")
            cal = calibrate(g, devices, feeds)
            devs = cal.apply(devices)
            comparison = compare_placements(g, devs, ["greedy", "heft"] + (["shard"] if shard else []), shard=shard)
            add_halves(comparison)
            say(f"== {label}: running every distinct placement ({args.rounds} rounds)")
            measure_candidates(comparison, feeds, warmup=3, repeats=args.repeats, rounds=args.rounds,
                               probe_contention=True)
            cal = rescale_to_measured(comparison, cal)
            rows, seen = [], set()
            for c in comparison.candidates:
                key = (c.placer == "shard", tuple(c.placement.device_of))
                if key in seen:
                    continue
                seen.add(key)
                same = [d.label for d in comparison.candidates if d is not c and d.ok and
                        (d.placer == "shard", tuple(d.placement.device_of)) == key]
                stages = 1 + max(assign_stages(c.graph.dag, c.placement.device_of)) if c.placer != "shard" else 1
                err = c.sim.step_time / c.measured.median - 1
                rows.append((c, same, stages, err))
            lines.append(f"### {label} ({len(g)} nodes, batch {batch})\n\ncalibration: session call "
                         f"{cal.call_overhead * 1e6:.1f} us, per op {cal.op_overhead * 1e6:.2f} us, kernel scale "
                         f"{cal.kernel_scale:.2f} (re-fitted alongside), link {cal.latency * 1e6:.1f} us"
                         f" + bytes / {cal.bandwidth / 1e9:.1f} GB/s, contention {cal.contention:.2f} "
                         "(re-fitted alongside)\n")
            lines.append("| placement | same placement as | devices used | stages | simulated ms | measured ms "
                         "| error | outputs equal |\n|---|---|---|---|---|---|---|---|")
            for c, same, stages, err in rows:
                lines.append(f"| {c.label} | {', '.join(same) or '–'} | {c.placement.devices_used()} | {stages} | "
                             f"{c.sim.step_time * 1e3:.3f} | {c.measured.median * 1e3:.3f} | {100 * err:+.1f}% | "
                             f"{'yes' if c.output_error < 1e-5 else 'NO'} |")
            split = [r for r in rows if r[0].placement.devices_used() > 1]
            within = [r for r in split if abs(r[3]) <= 0.30]
            best = comparison.best()
            best_err = best.sim.step_time / best.measured.median - 1
            verdict = (f"{label}: {len(within)} of {len(split)} multi-device placements within 30% "
                       f"(worst {max((abs(r[3]) for r in split), default=0) * 100:.0f}%); the recommended "
                       f"{best.label}: {100 * best_err:+.1f}%")
            verdicts.append(verdict)
            lines.append(f"\n{verdict}\n")
            say(verdict)
    command = "python benchmarks/placement_calibration.py " + " ".join(argv if argv is not None else sys.argv[1:])
    load = os.getloadavg()
    text = (f"`{command.strip()}` — {datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, load "
            f"average {load[0]:.2f} at the end\n\n" + "\n".join(lines) + "\n**Summary**\n\n" +
            "\n".join(f"- {v}" for v in verdicts))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
