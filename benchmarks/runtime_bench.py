"""The fused array on the torch runtime vs. the same B models trained one after another in plain PyTorch, on one
device (CPU or CUDA), side by side in one process.

For each model and B: B zoo models with different weights (seeds 0..B-1); one ONNX export, whose initializers are
replaced by each model's state_dict (the exporter keeps state_dict names), fused; then rounds that alternate

    fused   one step of the fused array on each runtime asked for (``--runtimes torch,ort``; ort on CPU only)
            trains all B models (per-model AdamW learning rates)
    seq     B torch modules, each with its own torch.optim.AdamW, stepped one after another
    vmap    (``--baselines vmap``) the B modules as one torch.func ensemble: stack_module_state + functional_call +
            vmap, one AdamW over the stacked parameters (one learning rate; BatchNorm without running statistics,
            which vmap cannot update in place: torch.func.replace_all_batch_norm_modules_)
    dense   (``--baselines dense``) ONE model at batch B * N: the FLOPs of the array in one ordinary model, the
            ceiling fusion can approach

on the same device-resident random batch (N samples per model). A round times ``--steps`` steps after the warm-up;
the ratio is the median of the per-round ratios (the two runs of a round see the same machine). Samples/s count
all B models: B * N * steps / time. Peak memory is torch's allocator peak on CUDA (max_memory_allocated), else
the process's peak RSS.

    python benchmarks/runtime_bench.py --device cuda --models lenet,resnet18,transformer_lm --B 1,8,32,64 -o DIR

writes DIR/runtime_bench.json and DIR/runtime_bench.md and prints the table as it goes.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from onnxfuse import fuse_models  # noqa: E402
from onnxfuse.exporters import export_module  # noqa: E402
from onnxfuse.exporters.zoo import ZOO  # noqa: E402
from onnxfuse.training import make_optimizer  # noqa: E402
from onnxfuse.training.losses import get_loss  # noqa: E402
from onnxfuse.training.runtime import make_trainer  # noqa: E402


def modules(name: str, B: int) -> list[torch.nn.Module]:
    factory = ZOO[name].factory
    kwargs = {"dropout": 0.0} if "dropout" in inspect.signature(factory).parameters else {}
    out = []
    for b in range(B):
        torch.manual_seed(b)
        out.append(factory(**kwargs))
    return out


def batch(name: str, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    e = ZOO[name]
    shape = (n,) + tuple(e.input_shape[1:])
    if e.input_dtype == "int64":
        x = torch.randint(0, e.input_high, shape)
        y = torch.randint(0, e.num_classes, shape)  # next-token labels, one per position
    else:
        x = torch.randn(shape)
        y = torch.randint(0, e.num_classes, (n,))
    return x.to(device), y.to(device)


def fused_array(name: str, mods: list[torch.nn.Module], n: int, folder: str):
    """One export, B copies with each model's weights, fused."""
    path = os.path.join(folder, f"{name}.onnx")
    export_module(copy.deepcopy(mods[0]), path, example_inputs=(batch(name, n, torch.device("cpu"))[0],))
    base = onnx.load(path)
    protos = []
    for m in mods:
        state = {k: v.detach().cpu().numpy() for k, v in m.state_dict().items()}
        p = copy.deepcopy(base)
        for t in p.graph.initializer:
            if t.name in state:
                t.CopyFrom(numpy_helper.from_array(state[t.name].astype(numpy_helper.to_array(t).dtype), t.name))
        protos.append(p)
    return fuse_models(protos, labels=[f"model_{b}" for b in range(len(mods))])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _loss(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)) if task == "lm" else F.cross_entropy(out, y)


def vmap_step(mods: list[torch.nn.Module], task: str, x: torch.Tensor, y: torch.Tensor, lr: float):
    """One AdamW step of the B models as a torch.func ensemble (the loss summed over the models)."""
    from torch.func import functional_call, replace_all_batch_norm_modules_, stack_module_state

    base = copy.deepcopy(mods[0])
    replace_all_batch_norm_modules_(base)
    params, buffers = stack_module_state([replace_all_batch_norm_modules_(copy.deepcopy(m)) for m in mods])
    params = {k: torch.nn.Parameter(v) for k, v in params.items()}
    opt = torch.optim.AdamW(params.values(), lr=lr)

    def one(p, b, xx):
        return functional_call(base, (p, b), (xx,))

    ensemble = torch.vmap(one, in_dims=(0, 0, None), randomness="different")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = ensemble(params, buffers, x)  # [B, N, ...]
        loss = sum(_loss(task, out[b], y) for b in range(out.shape[0]))
        loss.backward()
        opt.step()
    return step


def dense_step(mods: list[torch.nn.Module], task: str, x: torch.Tensor, y: torch.Tensor, B: int, lr: float):
    """One AdamW step of ONE model at batch B * N."""
    model = copy.deepcopy(mods[0])
    xb, yb = x.repeat((B,) + (1,) * (x.dim() - 1)), y.repeat((B,) + (1,) * (y.dim() - 1))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        _loss(task, model(xb), yb).backward()
        opt.step()
    return step


def measure(name: str, B: int, n: int, steps: int, warmup: int, rounds: int, device: torch.device,
            folder: str, runtimes: list[str], baselines: list[str] = ()) -> dict:
    mods = modules(name, B)
    lrs = [float(v) for v in np.geomspace(1e-4, 1e-3, B)] if B > 1 else [1e-3]
    task = ZOO[name].task
    loss_name = get_loss("cross-entropy", class_axis=-1) if task == "lm" else "cross-entropy"
    t0 = time.perf_counter()
    fa = fused_array(name, mods, n, folder)
    fuse_s = time.perf_counter() - t0
    trainers = {rt: make_trainer(rt, fa.model, fa.spec, loss_name, make_optimizer("adamw", B, lr=lrs),
                                 device=str(device)) for rt in runtimes}
    x, y = batch(name, n, device)
    feeds = {"input": x, "labels": y}
    host = {"input": x.cpu().numpy(), "labels": y.cpu().numpy()}  # the ort runtime takes numpy (CPU)
    seq = [m.to(device).train() for m in mods]
    opts = [torch.optim.AdamW(m.parameters(), lr=lr) for m, lr in zip(seq, lrs)]

    def seq_step() -> None:
        for m, o in zip(seq, opts):
            o.zero_grad(set_to_none=True)
            _loss(task, m(x), y).backward()
            o.step()

    def fused_step(rt: str):
        trainer = trainers[rt]
        return lambda: trainer.step(feeds if rt == "torch" else host)

    def timed(fn) -> float:
        _sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        _sync(device)
        return time.perf_counter() - t

    steppers = {**{rt: fused_step(rt) for rt in runtimes}, "seq": seq_step}
    if "vmap" in baselines:
        steppers["vmap"] = vmap_step(seq, task, x, y, lrs[0])
    if "dense" in baselines:
        steppers["dense"] = dense_step(seq, task, x, y, B, lrs[0])
    for fn in steppers.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steppers}
    for r in range(rounds):
        kinds = list(steppers) if r % 2 == 0 else list(reversed(steppers))
        for kind in kinds:
            times[kind].append(timed(steppers[kind]))
    samples = B * n * steps
    row = {"model": name, "B": B, "batch": n, "device": str(device), "steps": steps, "rounds": rounds,
           "seq_samples_s": samples / statistics.median(times["seq"]), "peak_mib": _peak(device), "fuse_s": fuse_s}
    for rt in [k for k in steppers if k != "seq"]:  # per-round ratios: both runs of a round see the same machine
        ratios = [s / f for f, s in zip(times[rt], times["seq"])]
        row[f"{rt}_samples_s"] = samples / statistics.median(times[rt])
        row[f"{rt}_over_seq"] = statistics.median(ratios)
        row[f"{rt}_round_ratios"] = ratios
        if "dense" in times:
            row[f"{rt}_of_dense"] = statistics.median([d / f for f, d in zip(times[rt], times["dense"])])
    return row


_LABEL = {"torch": "fused (torch runtime)", "ort": "fused (ort runtime)", "vmap": "torch.func ensemble",
          "dense": "one model at batch B*N"}


def table(rows: list[dict], modes: list[str]) -> str:
    """Samples/s of every mode, its ratio to PyTorch one after another and (with the dense mode) to the ceiling."""
    dense = "dense" in modes
    head = " | ".join(f"{_LABEL[m]} samples/s | ÷ one after another" + (" | ÷ dense" if dense else "")
                      for m in modes)
    lines = [f"| model | B | one after another (PyTorch) samples/s | {head} | peak MiB |",
             "|---|---:|---:|" + ("---:|---:|" + ("---:|" if dense else "")) * len(modes) + "---:|"]
    for r in rows:
        cells = " | ".join(f"{r[f'{m}_samples_s']:,.0f} | {r[f'{m}_over_seq']:.2f}x"
                           + (f" | {r[f'{m}_of_dense']:.2f}" if dense else "") for m in modes)
        lines.append(f"| {r['model']} | {r['B']} | {r['seq_samples_s']:,.0f} | {cells} | {r['peak_mib']:,.0f} |")
    return "\n".join(lines)


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
    ap.add_argument("--runtimes", default="torch", help="fused runtimes to measure: torch, ort (CPU only)")
    ap.add_argument("--baselines", default="", help="more ways to train the same models: vmap (torch.func "
                    "ensemble), dense (one model at batch B*N: the ceiling)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("-o", "--output", default="runtime-bench")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    runtimes = args.runtimes.split(",")
    modes = runtimes + [b for b in args.baselines.split(",") if b]
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("runtime_bench: torch sees no CUDA device; skipped")
            return 0
        torch.backends.cudnn.benchmark = True
    os.makedirs(args.output, exist_ok=True)
    rows: list[dict] = []
    t0 = time.perf_counter()
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), batch {args.batch} per model, AdamW, "
          f"{args.steps} steps x {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            for B in [int(b) for b in args.B.split(",")]:
                if args.budget_s and time.perf_counter() - t0 > args.budget_s:
                    print(f"skipped {name} B={B}: over the {args.budget_s:.0f} s budget")
                    continue
                try:
                    r = measure(name, B, args.batch, args.steps, args.warmup, args.rounds, device, folder, runtimes,
                                [b for b in args.baselines.split(",") if b])
                except torch.OutOfMemoryError as e:
                    print(f"{name} B={B}: out of memory ({str(e).splitlines()[0][:120]})")
                    continue
                finally:
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats(device)
                rows.append(r)
                fused = "  ".join(f"{m} {r[f'{m}_samples_s']:>9,.0f}/s ({r[f'{m}_over_seq']:.2f}x)" for m in modes)
                print(f"{name:>14} B={B:<3} fused: {fused}  one after another {r['seq_samples_s']:>9,.0f}/s  "
                      f"peak {r['peak_mib']:,.0f} MiB  (fused in {r['fuse_s']:.1f} s)", flush=True)
    with open(os.path.join(args.output, "runtime_bench.json"), "w") as f:
        json.dump({"argv": sys.argv, "rows": rows}, f, indent=1)
    with open(os.path.join(args.output, "runtime_bench.md"), "w") as f:
        f.write(f"`{' '.join(sys.argv)}` (torch {torch.__version__}, {torch.get_num_threads()} threads)\n\n"
                f"{table(rows, modes)}\n")
    print(table(rows, modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
