"""The fused array on the torch (and ort) runtime vs. the same B models trained one after another in plain PyTorch,
and optionally the other peers (B processes at once, a torch.func ensemble, the HFTA-style model, the dense
ceiling; each eager or compiled): ``onnxfuse bench`` under this script's older flags. The measurement is
``onnxfuse.measure.bench.run_bench`` (``benchmarks/gpu_check.sh`` runs ``onnxfuse bench`` itself).

    python benchmarks/runtime_bench.py --device cuda --models lenet,resnet18,transformer_lm --B 1,8,32,64 \\
        --runtimes torch,torch-compiled --baselines vmap,vmap-compiled,dense,dense-compiled -o DIR

is ``onnxfuse bench --device cuda --models ... --B 1,8,32,64 --modes torch,torch-compiled,seq-torch,vmap,...
-o DIR`` and writes DIR/bench.{json,csv,md,png}.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from onnxfuse.measure.bench import run_bench  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", default="lenet,resnet18,transformer_lm")
    ap.add_argument("--B", default="1,8,32,64")
    ap.add_argument("--batch", type=int, default=32, help="samples per model per step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting new measurements after this long")
    ap.add_argument("--runtimes", default="torch", help="fused runtimes to measure: torch, torch-compiled, ort "
                    "(CPU only)")
    ap.add_argument("--baselines", default="", help="more ways to train the same models: concurrent (B processes "
                    "at once), vmap (torch.func ensemble), hfta (HFTA-style, fused by hand), dense (one model at "
                    "batch B*N: the ceiling), each of these three also X-compiled (under torch.compile), seq-ort")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("-o", "--output", default="runtime-bench")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("runtime_bench: torch sees no CUDA device; skipped")
            return 0
    modes = [m for m in args.runtimes.split(",") if m] + ["seq-torch"] + [b for b in args.baselines.split(",") if b]
    run_bench(models=args.models.split(","), B=[int(b) for b in args.B.split(",")], device=args.device, modes=modes,
              batch=args.batch, steps=args.steps, rounds=args.rounds, warmup=args.warmup, out=args.output,
              budget_s=args.budget_s, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
