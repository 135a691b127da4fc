"""The README's table in "Mixed precision": each model of a bf16 / fp16 array against the same model trained alone
by plain torch under torch.autocast (+ GradScaler for fp16), ``||fused - alone|| / ||alone - alone in fp32||``
over every weight and buffer, at step 1 and after 6 steps. The cases and the training are
tests/runtime/torch/test_precision.py's. Run from the repository root: python benchmarks/precision_ratios.py"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_precision as tp  # noqa: E402

print("| model, optimizer | precision | step 1 | after 6 steps |\n|---|---|---:|---:|")
for case in tp.CASES:
    for precision in ("bf16", "fp16"):
        first, sixth, _, _ = tp.measured_ratios(case, precision)
        print(f"| {case} | {precision} | {min(first):.3f}–{max(first):.3f} | {min(sixth):.3f}–{max(sixth):.3f} |")
