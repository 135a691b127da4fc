"""Are `onnxfuse plan`'s predictions right? The planner fits its lines on small arrays (--probe, default 1,2,4), then
this script really trains larger arrays (--B, default 8,16,32) and compares predicted with measured step time and
memory, with the relative error (measured / predicted - 1):

    python benchmarks/plan_check.py --models lenet,transformer_lm --B 8,16,32 [--device cuda] [-o plan_check.md]

Memory is measured as the planner measures it (torch's CPU allocator peak through the profiler, or
torch.cuda.max_memory_allocated), and the graph-count estimate (``estimate_step_memory``, what the ort runtime's
sizing uses) is compared with it too. Step times are medians of interleaved rounds within each measurement; the
planner's probes and the larger arrays are measured one after the other, so on a shared machine whose speed
drifts the time errors carry that noise.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from onnxfuse.measure.sizing import measure_arrays, size_array  # noqa: E402


def _err(measured: float | None, predicted: float) -> str:
    return "–" if measured is None else f"{100 * (measured / predicted - 1):+.0f}%"


def check(models, Bs, probe, device, runtime, batch, steps, rounds) -> tuple[str, list[str]]:
    lines = ["| model | B | step ms predicted | measured | error | MiB predicted | measured | error "
             "| graph estimate MiB | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for name in models:
        t0 = time.perf_counter()
        sizing = size_array(name, runtime=runtime, device=device, batch=batch, probe=probe, max_B=max(Bs),
                          memory_budget="1TiB", steps=steps, rounds=rounds)
        measured = measure_arrays(name, Bs, sizing.runtime, device, batch, steps=steps, rounds=rounds)
        (a, b), (m0, m1) = sizing.time_fit, sizing.memory_fit
        notes.append(f"{name}: fitted on B={','.join(str(p.B) for p in sizing.probes)}: step = {1e3 * a:.2f} ms + "
                     f"{1e3 * b:.3f} ms x B, memory = {m0 / 2 ** 20:.2f} + {m1 / 2 ** 20:.3f} MiB x B "
                     f"({sizing.memory_source}); {sizing.summary()} ({time.perf_counter() - t0:.0f} s)")
        for q, kind in [(q, " (probe)") for q in sizing.probes] + [(q, "") for q in measured]:
            pr = sizing.predict(q.B)
            mem = "–" if q.memory is None else f"{q.memory / 2 ** 20:,.1f}"
            lines.append(f"| {name} | {q.B}{kind} | {1e3 * pr.step_s:,.1f} | {1e3 * q.step_s:,.1f} | "
                         f"{_err(q.step_s, pr.step_s)} | {pr.memory / 2 ** 20:,.1f} | {mem} | "
                         f"{_err(q.memory, pr.memory)} | {q.memory_estimate / 2 ** 20:,.1f} | "
                         f"{_err(q.memory, q.memory_estimate)} |")
        print(f"{name} done", file=sys.stderr, flush=True)
    return "\n".join(lines), notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="lenet,transformer_lm", help="zoo models, comma-separated")
    ap.add_argument("--B", default="8,16,32", help="array sizes really measured against the prediction")
    ap.add_argument("--probe", default="1,2,4", help="the planner's probe sizes")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runtime", default="auto")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-o", "--output", help="also write the markdown here")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    Bs = [int(v) for v in args.B.split(",") if v]
    probe = [int(v) for v in args.probe.split(",") if v]
    cmd = (f"python benchmarks/plan_check.py --models {','.join(models)} --B {args.B} --probe {args.probe} --device "
           f"{args.device} --runtime {args.runtime} --batch {args.batch} --steps {args.steps} --rounds {args.rounds}")
    t0 = time.perf_counter()
    table, notes = check(models, Bs, probe, args.device, args.runtime, args.batch, args.steps, args.rounds)
    import torch

    text = (f"`{cmd}`\n\n{os.cpu_count()} CPUs, torch {torch.__version__}; error = measured / predicted - 1; "
            f"{time.perf_counter() - t0:.0f} s in all.\n\n" + "".join(f"- {n}\n" for n in notes) + "\n" + table + "\n")
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
