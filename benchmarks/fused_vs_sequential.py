"""Training throughput and peak memory: B LeNets as one fused array vs. the same B models trained one after
another (onnxfuse B=1 arrays, and plain onnxruntime-training), for B = 4 and 16.

    python benchmarks/fused_vs_sequential.py [--models 4,16] [--steps 30] [--warmup 5] [--batch-size 32]
                                             [--repeats 3] [--json results.json]

Same as ``onnxfuse bench``; the measurement itself is ``onnxfuse.training.bench.run_benchmark``.
"""
from __future__ import annotations

import argparse
import sys

from onnxfuse.cli import _numbers
from onnxfuse.errors import OnnxFuseError
from onnxfuse.training.bench import run_benchmark


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="fused array vs. the same models trained one after another (ORT)")
    p.add_argument("--models", default="4,16", help="array sizes B to measure, e.g. 4,16")
    p.add_argument("--steps", type=int, default=30, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per model before timing")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="alternating fused/sequential rounds; medians reported")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    try:
        run_benchmark(B_values=_numbers(args.models, "--models", int), steps=args.steps, warmup=args.warmup,
                      batch_size=args.batch_size, repeats=args.repeats, out=args.json)
    except OnnxFuseError as e:
        print(f"fused_vs_sequential: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
