"""Training throughput and peak memory: B LeNets as one fused array vs. the same B models trained one after
another (onnxfuse B=1 arrays, and plain onnxruntime-training), for B = 4 and 16, all in ONNX Runtime.

    python benchmarks/fused_vs_sequential.py [--models 4,16] [--steps 50] [--warmup 5] [--batch-size 32]
                                             [--repeats 5] [--json results.json]

The benchmark behind README's "Benchmark" history table; the measurement itself is ``run_benchmark`` in
``benchmarks/_ort_sequential.py``. ``onnxfuse bench`` is the benchmark against every way to train the same models
(PyTorch one after another, a torch.func ensemble, the dense ceiling, both runtimes).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _ort_sequential import run_benchmark  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="4,16", help="array sizes B to measure, e.g. 4,16")
    ap.add_argument("--steps", type=int, default=50, help="timed steps per model")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per model before timing")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5,
                    help="rounds of fused / sequential runs back to back; medians of per-round ratios reported")
    ap.add_argument("--json", help="also write the results to this JSON file")
    a = ap.parse_args(argv)
    run_benchmark(B_values=[int(v) for v in a.models.split(",") if v.strip()], steps=a.steps, warmup=a.warmup,
                  batch_size=a.batch_size, repeats=a.repeats, out=a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
