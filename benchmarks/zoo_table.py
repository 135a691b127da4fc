"""The README's zoo table: every zoo model exported B = 4 times, fused, and legalized for training.

    python benchmarks/zoo_table.py [--B 4]

Columns: parameters of one model; nodes of one exported model after static values are resolved (what fusion
sees); nodes of the fused graph; fused fraction; layout changes the engine inserted; the op types the trainability
legalization rewrote. Equivalence with torch is what tests/exporters/test_zoo.py checks, not this script.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=4)
    args = ap.parse_args()

    from onnxfuse import fuse_models
    from onnxfuse.exporters import export_module
    from onnxfuse.exporters.zoo import ZOO
    from onnxfuse.runtime.ort.legalize import legalize

    print("| model | parameters | nodes | fused nodes | fused fraction | layout changes | legalized for training |")
    print("|---|---|---|---|---|---|---|")
    for name, entry in ZOO.items():
        kwargs = {"dropout": 0.0} if "dropout" in inspect.signature(entry.factory).parameters else {}
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for b in range(args.B):
                torch.manual_seed(b)
                m = entry.factory(**kwargs)
                shape = (8,) + tuple(entry.input_shape[1:])
                x = torch.randint(0, entry.input_high, shape) if entry.input_dtype == "int64" else torch.randn(shape)
                paths.append(os.path.join(tmp, f"model_{b}.onnx"))
                export_module(m, paths[-1], example_inputs=(x,))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fa = fuse_models(paths)
        params = sum(p.numel() for p in m.parameters())
        s = fa.spec.summary
        _, applied = legalize(fa.model)
        rewritten = sorted({line.split(" ")[0] for line in applied})
        print(f"| {name} | {params:,} | {s['nodes']} | {s['fused_nodes']} | {s['fused_fraction']:.0%} | "
              f"{s['layout_changes']} | {', '.join(rewritten) or '–'} |")


if __name__ == "__main__":
    main()
