"""The fused forms of recurrent nets side by side (``onnxfuse/core/rules/recurrent.py``): one AdamW training step of B
MNIST-row classifiers (``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN(28, H, batch_first=True)`` over 28 rows of 28 pixels,
then ``nn.Linear(H, 10)``, batch 32 per model) fused in each form, and the same B models trained by PyTorch one
after another (``torch.optim.AdamW`` each), on one runtime; interleaved rounds, medians.

    python benchmarks/recurrent_forms.py --ops LSTM,GRU,RNN --hidden 64,128 --B 2,4,8,16 --runtime torch

Prints a markdown table: step ms per form and for PyTorch one after another, the rule's default form, the fastest
one, and the default's ratio to PyTorch one after another (> 1: the fused array is faster), then the command line.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

T, PIXELS, CLASSES = 28, 28, 10


def _module(op: str, hidden: int, seed: int):
    import torch
    import torch.nn as nn

    class RowClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = getattr(nn, op)(PIXELS, hidden, batch_first=True)
            self.head = nn.Linear(hidden, CLASSES)

        def forward(self, x):
            y, _ = self.rnn(x)
            return self.head(y[:, -1])

    torch.manual_seed(seed)
    return RowClassifier()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="LSTM,GRU,RNN")
    ap.add_argument("--hidden", default="64,128")
    ap.add_argument("--B", default="2,4,8,16")
    ap.add_argument("--runtime", default="torch", choices=("torch", "ort"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    import torch

    from onnxfuse import fuse_models
    from onnxfuse.core.rules import RULES
    from onnxfuse.exporters import export_module
    from onnxfuse.measure.workloads import interleaved_rounds
    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.runtime.process import tune_process
    from onnxfuse.runtime.trainers import make_trainer

    tune_process(args.threads)  # the process `onnxfuse train` trains in
    print(f"`python benchmarks/recurrent_forms.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print(f"{args.runtime} runtime, {args.threads} thread(s), T = {T} rows of {PIXELS}, batch {args.batch} per "
          f"model, AdamW; step ms = median of {args.rounds} interleaved rounds of {args.steps} steps\n")
    forms = RULES[("", "LSTM")].forms
    print("| op | H | B | " + " | ".join(f"{f} ms" for f in forms) + " | PyTorch one after another ms | default | "
          "fastest | default ÷ one after another |")
    print("|---|---:|---:|" + "---:|" * (len(forms) + 1) + "---|---|---:|")
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(args.batch, T, PIXELS, generator=gen)
    y = torch.randint(0, CLASSES, (args.batch,), generator=gen)
    feeds = {"input": x, "labels": y} if args.runtime == "torch" else {"input": x.numpy(), "labels": y.numpy()}
    for op in args.ops.split(","):
        op_forms = RULES[("", op)].forms
        for H in (int(v) for v in args.hidden.split(",")):
            for B in (int(b) for b in args.B.split(",")):
                mods = [_module(op, H, b) for b in range(B)]
                with tempfile.TemporaryDirectory() as d:
                    paths = []
                    for b, m in enumerate(mods):
                        paths.append(os.path.join(d, f"model_{b}.onnx"))
                        export_module(m, paths[-1], example_inputs=(x[:2],))
                    steppers = {}
                    for form in op_forms:
                        fa = fuse_models(paths, strategy=form)
                        trainer = make_trainer(args.runtime, fa.model, fa.spec, "cross-entropy",
                                               make_optimizer("adamw", B, lr=1e-3), threads=args.threads,
                                               workdir=os.path.join(d, form))
                        steppers[form] = lambda t=trainer: t.step(feeds)
                    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in mods]

                    def one_after_another():
                        for m, opt in zip(mods, opts):
                            opt.zero_grad()
                            torch.nn.functional.cross_entropy(m(x), y).backward()
                            opt.step()
                    steppers["torch"] = one_after_another
                    for step in steppers.values():  # warm-up
                        step()
                        step()
                    times = interleaved_rounds(steppers, args.rounds, args.steps)
                ms = {k: statistics.median(v) / args.steps * 1e3 for k, v in times.items()}
                fastest = min(op_forms, key=lambda f: ms[f])
                cells = " | ".join(f"{ms[f]:.1f}" if f in ms else "" for f in forms)
                print(f"| {op} | {H} | {B} | {cells} | {ms['torch']:.1f} | {op_forms[0]} | {fastest} | "
                      f"{ms['torch'] / ms[op_forms[0]]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
