"""The fusion strategies side by side: one training step of the fused array with every convolution grouped
(``default``), every convolution per model (``per-model``), and each node in the form measured fastest (``auto``,
onnxfuse/measure/forms.py), on one runtime, interleaved rounds, medians.

    python benchmarks/forms_bench.py --models lenet,resnet18 --B 8,16 --runtime torch --threads 1

Prints a markdown table (step ms per strategy, auto's ratio to default, the forms auto chose, the seconds auto's
measurements took) and the command line. The measurements auto makes are cached (``$ONNXFUSE_CACHE_DIR``); this
script uses a fresh cache folder so that the time it reports is the time a first fuse takes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lenet,resnet18")
    ap.add_argument("--B", default="16")
    ap.add_argument("--runtime", default="torch", choices=("torch", "ort"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    os.environ["ONNXFUSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="onnxfuse-forms-cache-")

    import torch

    from onnxfuse import fuse_models
    from onnxfuse.exporters.zoo import ZOO
    from onnxfuse.measure.workloads import interleaved_rounds, zoo_batch, zoo_modules, zoo_protos
    from onnxfuse.measure.forms import measured_strategy
    from onnxfuse.recipe.losses import get_loss
    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.runtime.process import tune_process
    from onnxfuse.runtime.trainers import make_trainer

    tune_process(args.threads)  # the process `onnxfuse train` trains in
    print(f"`python benchmarks/forms_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print(f"{args.runtime} runtime, {args.threads} thread(s), batch {args.batch} per model, AdamW; step ms = median "
          f"of {args.rounds} interleaved rounds of {args.steps} steps\n")
    print("| model | B | default ms | per-model ms | auto ms | auto ÷ default | auto's forms | auto measured in |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for name in args.models.split(","):
        for B in (int(b) for b in args.B.split(",")):
            mods = zoo_modules(name, B)
            with tempfile.TemporaryDirectory() as d:
                protos = zoo_protos(name, mods, args.batch, d)
                x, y = zoo_batch(name, args.batch, torch.device("cpu"))
                loss = get_loss("cross-entropy", class_axis=-1) if ZOO[name].task == "lm" else "cross-entropy"
                feeds = {"input": x, "labels": y}
                if args.runtime == "ort":
                    feeds = {k: v.numpy() for k, v in feeds.items()}
                t0 = time.perf_counter()
                auto = measured_strategy(args.runtime, "cpu", args.batch, args.threads)
                fused = {"auto": fuse_models(protos, strategy=auto)}
                auto_s = time.perf_counter() - t0
                fused.update({s: fuse_models(protos, strategy=s) for s in ("default", "per-model")})
                trainers = {s: make_trainer(args.runtime, fa.model, fa.spec, loss,
                                            make_optimizer("adamw", B, lr=1e-3), threads=args.threads,
                                            workdir=os.path.join(d, s)) for s, fa in fused.items()}
                for t in trainers.values():
                    t.step(feeds)
                    t.step(feeds)
                order = ["default", "per-model", "auto"]
                times = interleaved_rounds({s: (lambda t=trainers[s]: t.step(feeds)) for s in order}, args.rounds,
                                           args.steps)
                ms = {s: statistics.median(v) / args.steps * 1e3 for s, v in times.items()}
                ratio = statistics.median(a / d for a, d in zip(times["auto"], times["default"]))
                chosen = Counter(fused["auto"].spec.summary["forms"].values())
                forms = ", ".join(f"{n} {f}" for f, n in sorted(chosen.items()))
                print(f"| {name} | {B} | {ms['default']:.1f} | {ms['per-model']:.1f} | {ms['auto']:.1f} | "
                      f"{ratio:.2f} | {forms} | {auto_s:.1f} s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
