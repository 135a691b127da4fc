"""Where each mode's training step spends its time: `onnxfuse bench`'s modes built the same way, each profiled
for a few steps with torch's profiler after its warm-up, its operators' own CPU time summed by kind, per step.

    python benchmarks/profile_step.py --models resnet18,lenet --B 16 --isa avx2
    python benchmarks/profile_step.py --models resnet18 --modes torch,torch-compiled,dense-compiled --isa native

Kinds: convolution forward, convolution backward, BatchNorm (forward and backward), matrix products, copies
(copy_, cat, contiguous, casts), and the rest (elementwise, reductions, the optimizer's arithmetic, inductor's
fused kernels). A compiled mode's fused kernels are "the rest"; the convolutions it calls out to oneDNN for are
named as in eager. One thread, as `onnxfuse bench --threads 1`. Prints one markdown table per model.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

KINDS = ("conv forward", "conv backward", "batch norm", "matmul", "copies", "the rest")
_MATMUL = ("aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "aten::linear", "aten::baddbmm")
_COPIES = ("aten::copy_", "aten::cat", "aten::_to_copy", "aten::contiguous", "aten::clone")


def kind(op: str) -> str:
    """The kind of operator ``op`` (a profiler event's name)."""
    if "convolution" in op:
        return "conv backward" if "backward" in op else "conv forward"
    if "batch_norm" in op:
        return "batch norm"
    if op in _MATMUL:
        return "matmul"
    if op in _COPIES:
        return "copies"
    return "the rest"


def profile(step, steps: int) -> dict[str, float]:
    """{kind: ms per step} of ``steps`` calls of ``step``, by the operators' own CPU time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    out: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.key.startswith(("autograd::", "Optimizer.", "ProfilerStep", "Torch-Compiled Region",
                                 "CompiledFunction")):
            continue  # wrappers: their operators are counted themselves
        out[kind(event.key)] += event.self_cpu_time_total / 1e3 / steps
    return dict(out)


def measure(name: str, B: int, modes: list[str], steps: int, warmup: int, batch: int) -> dict[str, dict[str, float]]:
    """{mode: {kind: ms per step}} for zoo model ``name`` at ``B``, each mode built as `onnxfuse bench` builds it."""
    import contextlib

    import torch

    from onnxfuse.measure.bench import _first_steps, _inputs, _makers
    from onnxfuse.measure.bench_modes import zoo_workload
    from onnxfuse.runtime.process import tune_process

    tune_process(1)  # the process `onnxfuse bench` measures in
    folder = tempfile.mkdtemp(prefix="onnxfuse-profile-")
    work = zoo_workload(name, B, batch, torch.device("cpu"), folder)
    with contextlib.ExitStack() as stack:
        make = _makers(work, "fp32", True, _inputs(work), torch.device("cpu"), folder, 1, "default", stack)
        out = {}
        for mode in modes:
            step = make[mode]()
            _first_steps({mode: step}, [mode], warmup, lambda: None)  # as the bench's: a compiled form chosen
            out[mode] = profile(step, steps)
            print(f"  {name} B={B} {mode}: {sum(out[mode].values()):.0f} ms per step", file=sys.stderr, flush=True)
    return out


def table(name: str, B: int, results: dict[str, dict[str, float]]) -> str:
    lines = [f"| {name}, B = {B}: ms per step | " + " | ".join(KINDS) + " | all |",
             "|---|" + "---:|" * (len(KINDS) + 1)]
    for mode, by_kind in results.items():
        lines.append(f"| {mode} | " + " | ".join(f"{by_kind.get(k, 0.0):.0f}" for k in KINDS)
                     + f" | {sum(by_kind.values()):.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,lenet")
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--modes", default="torch,torch-compiled,seq-torch,vmap,dense,dense-compiled",
                    help="onnxfuse bench's mode names")
    ap.add_argument("--isa", default="native", help="native, avx512, avx2 or default (onnxfuse bench --isa's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2, help="profiled steps per mode")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    from onnxfuse.runtime._machine import cpu_description, rerun_held_to

    code = rerun_held_to(args.isa, __file__, argv)
    if code is not None:
        return code
    print(f"# {cpu_description()}, 1 thread, batch {args.batch} per model, {args.steps} profiled steps per mode")
    print(f"# python benchmarks/profile_step.py {' '.join(argv or sys.argv[1:])}\n")
    for name in args.models.split(","):
        print(table(name, args.B, measure(name, args.B, args.modes.split(","), args.steps, args.warmup,
                                          args.batch)) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
