"""Training throughput and peak memory: B LeNets as one fused array vs. the same B models trained one after
another (onnxfuse B=1 arrays, and plain onnxruntime-training), for B = 4 and 16.

    python benchmarks/fused_vs_sequential.py [--models 4,16] [--steps 50] [--warmup 5] [--batch-size 32]
                                             [--repeats 5] [--json results.json]

The same as ``onnxfuse bench`` (this script forwards its arguments to it); the measurement itself is
``onnxfuse.training.bench.run_benchmark``.
"""
from __future__ import annotations

import sys

from onnxfuse.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
