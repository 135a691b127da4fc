"""Where a fused conv net's convolutions lose to the dense model's: one 3x3 convolution of each ResNet-18 (width 8)
stage, forward and backward, in the forms a fused array can take, against one model at batch B*N.

    python benchmarks/grouped_conv.py --isa native
    python benchmarks/grouped_conv.py --isa avx2 --onednn

Forms (B models, batch N each, C channels per model):
  grouped NCHW     one convolution with group = B on [N, B*C, H, W] (the fused graph's form, eager)
  grouped NHWC     the same in channels_last (what inductor's layout optimization gives a compiled step)
  B convs NHWC     each model's own dense convolution on its block of a [B*N, C, H, W] batch, concatenated
  dense NHWC/NCHW  one model at batch B*N: the ceiling (same FLOPs as the B models)

Interleaved rounds, medians, ms per forward + backward. ``--onednn`` adds, per form, the time oneDNN's verbose
log gives each primitive implementation (a child process per form with ONEDNN_VERBOSE=1): which kernel the
library picked, and what its layout reorders cost.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

STAGES = ((8, 32), (16, 16), (32, 8), (64, 4))  # (channels per model, image side) of ResNet-18 width 8 on 32x32
FORMS = ("grouped NCHW", "grouped NHWC", "B convs NHWC", "dense NHWC", "dense NCHW")


def _step(form: str, B: int, N: int, C: int, H: int):
    """One forward + backward of ``form``'s convolution, as a function of no arguments."""
    import torch
    import torch.nn.functional as F

    cl = torch.channels_last
    fmt = cl if "NHWC" in form else torch.contiguous_format
    make = lambda *shape: torch.randn(*shape).to(memory_format=fmt).requires_grad_()  # noqa: E731
    if form.startswith("grouped"):
        x, w = make(N, B * C, H, H), make(B * C, C, 3, 3)
        run = lambda: F.conv2d(x, w, None, 1, 1, 1, B)  # noqa: E731
    elif form.startswith("B convs"):
        x, w = make(B * N, C, H, H), torch.randn(B, C, C, 3, 3).requires_grad_()
        run = lambda: torch.cat([F.conv2d(xb, w[b].contiguous(memory_format=cl), None, 1, 1)  # noqa: E731
                                 for b, xb in enumerate(x.split(N))])
    else:
        x, w = make(B * N, C, H, H), make(C, C, 3, 3)
        run = lambda: F.conv2d(x, w, None, 1, 1)  # noqa: E731

    def step():
        y = run()
        y.backward(torch.ones_like(y))
    return step


def measure(B: int, N: int, rounds: int) -> dict[tuple[int, int], dict[str, float]]:
    """{stage: {form: median ms}} over ``rounds`` interleaved rounds (each form once per round, after a warm-up)."""
    from onnxfuse.runtime.process import tune_process

    tune_process(1)  # the process `onnxfuse train` trains in
    out = {}
    for C, H in STAGES:
        steps = {form: _step(form, B, N, C, H) for form in FORMS}
        times: dict[str, list[float]] = defaultdict(list)
        for step in steps.values():
            step(), step()
        for _ in range(rounds):
            for form, step in steps.items():
                t = time.perf_counter()
                step()
                times[form].append((time.perf_counter() - t) * 1e3)
        out[(C, H)] = {form: statistics.median(ts) for form, ts in times.items()}
        print(f"  stage C={C} H={H}: " + ", ".join(f"{f} {t:.1f}" for f, t in out[(C, H)].items()), file=sys.stderr,
              flush=True)
    return out


def onednn_kernels(form: str, B: int, N: int, C: int, H: int) -> dict[str, float]:
    """{'primitive implementation': ms} for one forward + backward of ``form`` (its second, warm), from oneDNN's
    verbose log in a child process."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            "from grouped_conv import _step; from onnxfuse.runtime.process import tune_process; tune_process(1); "
            f"s = _step({form!r}, {B}, {N}, {C}, {H}); "
            "s(); print('=== warm', flush=True); s()")
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    text = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    kernels: dict[str, float] = defaultdict(float)
    for line in text.split("=== warm", 1)[-1].splitlines():
        parts = line.split(",")
        if len(parts) > 4 and parts[0] == "onednn_verbose" and "exec" in parts:
            i = parts.index("exec")
            kernels[f"{parts[i + 2]} {parts[i + 3]}"] += float(parts[-1])
    return dict(kernels)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default="native", help="native, avx512, avx2 or default (onnxfuse bench --isa's)")
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--onednn", action="store_true", help="add each form's oneDNN kernels (first stage)")
    args = ap.parse_args(argv)
    from onnxfuse.runtime._machine import cpu_description, rerun_held_to

    code = rerun_held_to(args.isa, __file__, argv)
    if code is not None:
        return code
    print(f"# {cpu_description()}, 1 thread, B = {args.B}, batch {args.batch} per model, {args.rounds} rounds")
    print(f"# python benchmarks/grouped_conv.py {' '.join(argv or sys.argv[1:])}\n")
    results = measure(args.B, args.batch, args.rounds)
    print("| ms per forward + backward | " + " | ".join(FORMS) + " | grouped NHWC ÷ dense NHWC |")
    print("|---|" + "---:|" * (len(FORMS) + 1))
    for (C, H), row in results.items():
        print(f"| C = {C}, {H}×{H} | " + " | ".join(f"{row[f]:.1f}" for f in FORMS)
              + f" | {row['grouped NHWC'] / row['dense NHWC']:.2f} |")
    if args.onednn:
        C, H = STAGES[0]
        print(f"\noneDNN's kernels, C = {C}, {H}×{H} (ms, one warm forward + backward):\n")
        for form in FORMS:
            kernels = onednn_kernels(form, args.B, args.batch, C, H)
            print(f"- {form}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
