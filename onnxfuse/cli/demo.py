"""`onnxfuse demo`: a learning-rate sweep of 8 small CNNs on scikit-learn's bundled digits, fused into one array.

export (8 seeds) -> fuse -> train (SGD with momentum, 8 learning rates, all models in one step, on the runtime
chosen; the held-out digits evaluated every 20 steps, drawn in ``array/report.png``) -> split -> each split final
checkpoint loaded into its own plain ``torch.nn.Module`` (the class the jobs were exported from) and evaluated
alone on the held-out digits: no onnxfuse code and no ONNX in that evaluation.
"""
from __future__ import annotations

import os

import numpy as np

__all__ = ["digits_data", "run_demo", "DEMO_LRS"]

DEMO_LRS = [0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.5, 1.0]
DEMO_FILES = ("digits_train.npz", "jobs", "array", "models")  # what the demo writes (and replaces) in its folder


def digits_data(seed: int = 0, test_fraction: float = 0.2):
    """scikit-learn's 8x8 digits (1797 images, bundled, no download) as [n, 1, 8, 8] float32 in [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    y = d.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def _lrs(models: int) -> list[float]:
    if models == len(DEMO_LRS):
        return list(DEMO_LRS)
    return [float(v) for v in np.geomspace(DEMO_LRS[0], DEMO_LRS[-1], models)]


def run_demo(out_dir: str = "onnxfuse-demo", models: int = 8, steps: int = 300, batch_size: int = 64,
             progress: bool = True, runtime: str = "auto", precision: str = "fp32") -> list[dict]:
    """The demo (see the module docstring); ``progress``: its step lines and the progress bar; ``precision``: the
    training's (``--precision``: bf16 and fp16 train the fp32 weights under autocast; the split models are
    evaluated in fp32, as any checkpoint would be)."""
    from onnxfuse.core._clock import Stopwatch
    from onnxfuse.core._io import check_output_path, claim_output
    from onnxfuse.core._lock import LOCK_FILE
    from onnxfuse.core.errors import ConfigError
    from onnxfuse.runtime.trainers import resolve_runtime

    check_output_path(out_dir)  # '' would be the current folder
    # (a lock file marks a folder some command holds: claim_output names the holder)
    other = sorted(set(os.listdir(out_dir)) - set(DEMO_FILES) - {LOCK_FILE}) if os.path.isdir(out_dir) else []
    if other or (os.path.exists(out_dir) and not os.path.isdir(out_dir)):
        raise ConfigError(f"'{out_dir}' holds {repr(other[0]) if other else 'a file'}, which `onnxfuse demo` did not "
                          f"write; the demo replaces {', '.join(DEMO_FILES)} there: give -o a new folder")
    runtime = resolve_runtime(runtime, "cpu", precision)
    say = print if progress else (lambda *a, **k: None)  # the progress lines ([1/4] ...); -q: the table alone
    clock = Stopwatch()
    with claim_output(out_dir, "demo", replace=False):  # no other command writes there meanwhile
        return _demo(out_dir, models, steps, batch_size, runtime, precision, progress, say, clock)


def _demo(out_dir, models, steps, batch_size, runtime, precision, progress, say, clock) -> list[dict]:
    """The demo's four stages, holding ``out_dir``."""
    import torch
    from safetensors.torch import load_file

    from onnxfuse.core._io import atomic_file
    from onnxfuse.core.array import model_weights_file
    from onnxfuse.core.passes import fuse_models, save_array
    from onnxfuse.core.split import split_array
    from onnxfuse.exporters import export_array, zoo
    from onnxfuse.runtime._machine import cpu_description
    from onnxfuse.training.report import make_report
    from onnxfuse.training.run import TrainConfig, train_array

    (xtr, ytr), (xte, yte) = digits_data()
    data = os.path.join(out_dir, "digits_train.npz")
    with atomic_file(data) as tmp, open(tmp, "wb") as f:  # whole or absent, like every file onnxfuse writes
        np.savez(f, input=xtr, labels=ytr)
    lrs = _lrs(models)
    say(f"[1/4] exporting {models} DigitsCNN models (seeds 0..{models - 1}) to {out_dir}/jobs")
    paths = export_array(zoo.DigitsCNN, os.path.join(out_dir, "jobs"), models, [batch_size, 1, 8, 8], overwrite=True)
    say(f"[2/4] fusing them into {out_dir}/array")
    fa = fuse_models(paths)
    save_array(fa, os.path.join(out_dir, "array"), overwrite=True)
    say(f"[3/4] training all {models} at once for {steps} steps on the {runtime} runtime"
          f"{'' if precision == 'fp32' else ' in ' + precision} (SGD, momentum 0.9, lr "
          f"{', '.join(f'{v:g}' for v in lrs)})")
    cfg = TrainConfig(steps=steps, batch_size=batch_size, optimizer="sgd", lr=lrs, momentum=0.9, seed=0,
                      log_every=10, eval_every=20, runtime=runtime, precision=precision)
    res = train_array(os.path.join(out_dir, "array"), data, cfg, progress=progress,
                      eval_data={"input": xte, "labels": yte}, tune_process=True)
    # the CPU beside the figures: the high learning rates' runs are chaotic, and another CPU's rounding moves them
    where = f"trained on {cpu_description()}, {runtime} runtime{'' if precision == 'fp32' else ', ' + precision}"
    make_report(os.path.join(out_dir, "array"), note=where)  # array/report.png: the curves of every model
    say(f"[4/4] splitting into {out_dir}/models and evaluating each model alone: its checkpoint in a plain "
          "zoo.DigitsCNN")
    split_array(os.path.join(out_dir, "array"), os.path.join(out_dir, "models"), overwrite=True)
    rows = []
    for b in range(models):
        module = zoo.DigitsCNN()
        module.load_state_dict(load_file(os.path.join(out_dir, "models", model_weights_file(b))))
        with torch.no_grad():
            logits = module.eval()(torch.from_numpy(np.ascontiguousarray(xte))).numpy()
        rows.append({"model": b, "lr": lrs[b], "train_loss": res.final_loss[b],
                     "test_accuracy": float((logits.argmax(1) == yte).mean())})
    print(f"\n{where}:\n{'model':>5}  {'lr':>7}  {'final train loss':>16}  {'test accuracy':>13}")
    for r in rows:
        print(f"{r['model']:>5}  {r['lr']:>7g}  {r['train_loss']:>16.4f}  {100 * r['test_accuracy']:>12.1f}%")
    best = max(rows, key=lambda r: r["test_accuracy"])
    print(f"\nbest: model {best['model']} (lr {best['lr']:g}) {100 * best['test_accuracy']:.1f}% on {len(yte)} held-out "
          f"digits (chance 10%); training {res.samples_per_s:,.0f} samples/s; total {clock.seconds:.0f}s")
    print(f"per-model checkpoints: {out_dir}/models/model_b.onnx and model_b.safetensors; curves: "
          f"{out_dir}/array/report.png")
    return rows
