"""The measurement of ``python benchmarks/fused_vs_sequential.py`` (the ORT-only benchmark of docs/benchmarks.md's
history): B LeNets trained as one fused array vs. the same B models trained one after another, all in ONNX
Runtime. Research code: the package does not import it.
`onnxfuse bench` (``onnxfuse/measure/bench.py``) is the benchmark against every way to train the same models.

What is measured, for each B (default 4 and 16), on scikit-learn's bundled digits upscaled to 28x28, batch 32,
AdamW with one learning rate per model (geomspace 1e-4..1e-2, torch defaults otherwise):

* ``fused``         one ``OrtTrainer`` over the fused array: one session call trains all B models per step.
* ``seq-onnxfuse``  B ``OrtTrainer``s of B=1 arrays (the same per-model optimizer and BatchNorm machinery),
                    trained one after another: isolates what fusing buys from what the machinery costs.
* ``seq-ort``       what a user of onnxruntime-training does today: ``generate_artifacts`` (ORT's own loss and
                    AdamW graphs, the AdamW block given torch's eps and weight decay), ``Module`` + ``Optimizer``
                    (one learning rate per model via ``set_learning_rate``), models one after another.

Throughput is samples/s = models x batch x timed steps / wall time of the timed steps; export, fusing, artifact
generation and session creation are reported separately as set-up time. Every configuration runs in its own
subprocess (``python benchmarks/_ort_sequential.py --worker MODE ...``) so that its peak RSS (``ru_maxrss``) is its
own; the sequential workers drop each model's session before building the next. The machine may be shared, so
``repeats`` rounds alternate the three configurations and medians are reported; the ratios are what matter.
ONNX Runtime's thread settings are left at their defaults (all cores) in every configuration.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core._io import atomic_write_bytes
from onnxfuse.core.errors import ConfigError

__all__ = ["run_benchmark", "MODES", "digits_28", "learning_rates"]

MODES = ("fused", "seq-onnxfuse", "seq-ort")
MODE_TITLES = {"fused": "fused", "seq-onnxfuse": "seq onnxfuse", "seq-ort": "seq ORT"}
IMAGE = 28
RESULT_MARK = "ONNXFUSE_BENCH_RESULT "  # the worker's one result line on stdout starts with this


# ----------------------------------------------------------------------------------------------------- data
def digits_28(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1797 bundled 8x8 digits as [n, 1, 28, 28] float32 in [0, 1] (each pixel repeated 3x3, then
    zero-padded by 2) and int64 labels, shuffled once with ``seed``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = np.kron(d.images / 16.0, np.ones((3, 3)))
    x = np.pad(x, ((0, 0), (2, 2), (2, 2))).astype(np.float32)[:, None]
    y = d.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    return np.ascontiguousarray(x[order]), np.ascontiguousarray(y[order])


class _Batches:
    """Batch ``i`` is the same contiguous slice (a view, no copy in the timed loop) for every configuration, so
    every model sees the same data at every step, as in the fused array."""

    def __init__(self, batch_size: int):
        self.x, self.y = digits_28()
        self.bs = batch_size
        self.count = len(self.y) // batch_size

    def __call__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        s = (i % self.count) * self.bs
        return self.x[s:s + self.bs], self.y[s:s + self.bs]


def learning_rates(B: int) -> list[float]:
    """Model b's AdamW learning rate: B values log-spaced over 1e-4..1e-2 (model 0 gets 1e-4 when B = 1)."""
    return [float(v) for v in np.geomspace(1e-4, 1e-2, B)]


# ---------------------------------------------------------------------------------------------------- memory
def _rss_mib() -> float | None:
    """Current resident set size (Linux /proc); None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _peak_rss_mib() -> float:
    """Peak resident set size of this process (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0


# ---------------------------------------------------------------------------------------------------- worker
def _train(step: Callable[[int], np.ndarray], warmup: int, steps: int) -> tuple[float, np.ndarray]:
    """Warm-up steps (first-run allocations, kernel selection), then ``steps`` timed steps; returns (timed wall
    seconds, the last step's loss)."""
    for i in range(warmup):
        step(i)
    loss = None
    with Stopwatch() as timed:
        for i in range(warmup, warmup + steps):
            loss = step(i)
    return timed.seconds, np.asarray(loss, dtype=np.float64).reshape(-1)


def _worker(mode: str, B: int, jobs_dir: str, steps: int, warmup: int, batch_size: int) -> dict:
    """Train B models in configuration ``mode``; every worker imports the same libraries and loads the same data
    before ``rss_before_mib`` is read, so the baselines are comparable."""
    import onnx
    import onnxruntime
    from onnxruntime.training import artifacts as ort_artifacts
    from onnxruntime.training import onnxblock
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    from onnxfuse.core._io import read_onnx
    from onnxfuse.core.array import model_file
    from onnxfuse.core.passes import fuse_models
    from onnxfuse.core.source import METADATA_KEY

    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.runtime.ort.trainer import OrtTrainer

    onnxruntime.set_default_logger_severity(3)
    threads = int(os.environ.get("ONNXFUSE_BENCH_THREADS", "0"))  # 0: ORT's default (all cores)
    data = _Batches(batch_size)
    paths = [os.path.join(jobs_dir, model_file(b)) for b in range(B)]
    lrs = learning_rates(B)
    work = tempfile.mkdtemp(prefix=f"onnxfuse-bench-{mode}-")
    gc.collect()
    rss_before = _rss_mib()
    setup_s = timed_s = 0.0
    losses: list[float] = []

    def fused_step(trainer: OrtTrainer) -> Callable[[int], np.ndarray]:
        def step(i: int) -> np.ndarray:
            x, y = data(i)
            return trainer.step({"input": x, "labels": y})
        return step

    try:
        if mode == "fused":
            with Stopwatch() as setup:
                fa = fuse_models(paths)
                trainer = OrtTrainer(fa.model, fa.spec, "cross-entropy", make_optimizer("adamw", B, lr=lrs),
                                       workdir=os.path.join(work, "array"), threads=threads or None)
            setup_s = setup.seconds
            timed_s, loss = _train(fused_step(trainer), warmup, steps)
            losses = loss.tolist()
        elif mode == "seq-onnxfuse":
            for b in range(B):
                with Stopwatch() as setup:
                    fa = fuse_models([paths[b]])
                    trainer = OrtTrainer(fa.model, fa.spec, "cross-entropy",
                                           make_optimizer("adamw", 1, lr=[lrs[b]]),
                                           workdir=os.path.join(work, f"model_{b}"), threads=threads or None)
                setup_s += setup.seconds
                dt, loss = _train(fused_step(trainer), warmup, steps)
                timed_s += dt
                losses.append(float(loss[0]))
                # One after another: this model's session is gone before the next one is built.
                del trainer, fa
                gc.collect()
        elif mode == "seq-ort":
            for b in range(B):
                setup = Stopwatch()
                model = read_onnx(paths[b], "run the benchmark again")
                meta = json.loads(next(p.value for p in model.metadata_props if p.key == METADATA_KEY))
                params = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
                if sorted(params) != sorted(meta["trainable"]):
                    # LeNet has no buffers: every float initializer is a trainable parameter. If that ever
                    # changes, ORT's artifacts would train buffers and the comparison would be wrong.
                    raise RuntimeError(f"{paths[b]}: float initializers {params} != trainable {meta['trainable']}")
                art = os.path.join(work, f"model_{b}")
                os.makedirs(art)
                # ORT's OptimType.AdamW block defaults to eps 1e-6 and weight decay 0; torch's (and the fused
                # array's) are 1e-8 and 1e-2. Same hyper-parameters, so both do the same work and the final losses
                # can be compared; the cost of ORT's AdamWOptimizer kernel does not depend on them.
                adamw = onnxblock.optim.AdamW(betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
                ort_artifacts.generate_artifacts(
                    model, requires_grad=params, frozen_params=[], loss=ort_artifacts.LossType.CrossEntropyLoss,
                    optimizer=adamw, artifact_directory=art)
                state = CheckpointState.load_checkpoint(os.path.join(art, "checkpoint"))
                so = onnxruntime.SessionOptions()
                so.log_severity_level = 3
                so.add_session_config_entry("session.set_denormal_as_zero", "1")  # as OrtTrainer does
                if threads:
                    so.intra_op_num_threads = threads
                module = Module(os.path.join(art, "training_model.onnx"), state,
                                os.path.join(art, "eval_model.onnx"), session_options=so)
                optimizer = Optimizer(os.path.join(art, "optimizer_model.onnx"), module)
                optimizer.set_learning_rate(lrs[b])
                module.train()
                setup_s += setup.seconds

                def step(i: int, module=module, optimizer=optimizer) -> np.ndarray:
                    x, y = data(i)
                    loss = module(x, y)
                    optimizer.step()
                    module.lazy_reset_grad()
                    return loss

                dt, loss = _train(step, warmup, steps)
                timed_s += dt
                losses.append(float(loss[0]))
                del module, optimizer, state, model, step
                gc.collect()
        else:
            raise ConfigError(f"unknown worker mode '{mode}'; choose one of: {', '.join(MODES)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "mode": mode, "B": B, "steps": steps, "warmup": warmup, "batch_size": batch_size,
        "samples_per_s": B * batch_size * steps / timed_s, "timed_s": timed_s, "setup_s": setup_s,
        "rss_before_mib": rss_before, "peak_rss_mib": _peak_rss_mib(), "final_loss": losses,
        "intra_op_threads": "default",
    }


@dataclass
class _Run:
    mode: str
    B: int
    result: dict
    wall_s: float


def _spawn(mode: str, B: int, jobs_dir: str, steps: int, warmup: int, batch_size: int) -> _Run:
    """One worker subprocess; its stderr (ORT's native build logs, warnings) is shown only if it fails."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--models", str(B),
           "--jobs", jobs_dir, "--steps", str(steps), "--warmup", str(warmup), "--batch-size", str(batch_size)]
    with Stopwatch() as worker:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = worker.seconds
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"benchmark worker '{mode}' B={B} failed (exit {proc.returncode}):\n{tail}")
    return _Run(mode, B, json.loads(lines[-1][len(RESULT_MARK):]), wall)


# ---------------------------------------------------------------------------------------------------- driver
def _check(B_values: Sequence[int] | None, steps: int, warmup: int, batch_size: int, repeats: int) -> list[int]:
    Bs = [4, 16] if B_values is None else list(B_values)
    if not Bs:
        raise ConfigError("--models needs at least one array size, e.g. 4,16")
    for B in Bs:
        if isinstance(B, bool) or not isinstance(B, (int, np.integer)) or B < 1:
            raise ConfigError(f"--models: array sizes must be integers >= 1, got {B!r}")
    if steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {steps}")
    if warmup < 0:
        raise ConfigError(f"--warmup must be 0 or more, got {warmup}")
    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {repeats}")
    n = 1797  # sklearn's digits
    if not 1 <= batch_size <= n:
        raise ConfigError(f"--batch-size must be between 1 and {n} (the digits data set), got {batch_size}")
    return list(dict.fromkeys(int(B) for B in Bs))  # keep order, drop repeats


def _command(Bs: list[int], steps: int, warmup: int, batch_size: int, repeats: int) -> str:
    return (f"--models {','.join(map(str, Bs))} --steps {steps} --warmup {warmup} --batch-size {batch_size} "
            f"--repeats {repeats}")


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _summarise(runs: list[_Run], B: int) -> dict:
    out: dict = {"B": B, "configs": {}}
    for mode in MODES:
        rs = [r.result for r in runs if r.mode == mode and r.B == B]
        sps = [r["samples_per_s"] for r in rs]
        before, peak = _median([r["rss_before_mib"] for r in rs]), _median([r["peak_rss_mib"] for r in rs])
        out["configs"][mode] = {
            "samples_per_s_median": statistics.median(sps), "samples_per_s": sps,
            "setup_s_median": statistics.median(r["setup_s"] for r in rs),
            "timed_s": [r["timed_s"] for r in rs],
            "peak_rss_mib_median": peak, "rss_before_mib_median": before,
            "rss_increase_mib_median": None if before is None else peak - before,
            "peak_rss_mib": [r["peak_rss_mib"] for r in rs],
            "final_loss": rs[-1]["final_loss"],
        }
    c = out["configs"]
    # Within a round the three workers run back to back, so a per-round ratio compares runs that saw the same
    # machine speed; the headline ratio is the median of those paired ratios (robust to the slow drifts of a
    # shared machine, which move whole rounds).
    fr = c["fused"]["samples_per_s"]
    out["fused_over_seq_ort_per_round"] = [a / b for a, b in zip(fr, c["seq-ort"]["samples_per_s"])]
    out["fused_over_seq_onnxfuse_per_round"] = [a / b for a, b in zip(fr, c["seq-onnxfuse"]["samples_per_s"])]
    out["fused_over_seq_ort"] = statistics.median(out["fused_over_seq_ort_per_round"])
    out["fused_over_seq_onnxfuse"] = statistics.median(out["fused_over_seq_onnxfuse_per_round"])
    # Same initial weights, learning rates and batches: the fused models should end where the sequential ones do
    # (up to float summation order; seq-ort also uses ORT's AdamWOptimizer kernel, whose "transformers" mode
    # puts eps and the weight decay slightly differently from torch.optim.AdamW).
    fl = np.array(c["fused"]["final_loss"])
    out["final_loss_max_abs_diff"] = {m: float(np.max(np.abs(fl - np.array(c[m]["final_loss"]))))
                                      for m in ("seq-onnxfuse", "seq-ort")}
    return out


def _fmt(v: float | None, spec: str = ",.0f") -> str:
    return "n/a" if v is None else format(v, spec)


def _print_table(summaries: list[dict]) -> None:
    cols = ["B", "fused samples/s", "seq onnxfuse samples/s", "seq ORT samples/s", "fused/seq-ORT",
            "fused/seq-onnxfuse", "peak RSS MiB (fused / seq onnxfuse / seq ORT)"]
    rows = []
    for s in summaries:
        c = s["configs"]
        rows.append([str(s["B"])] + [_fmt(c[m]["samples_per_s_median"]) for m in MODES]
                    + [f"{s['fused_over_seq_ort']:.2f}x", f"{s['fused_over_seq_onnxfuse']:.2f}x",
                       " / ".join(_fmt(c[m]["peak_rss_mib_median"]) for m in MODES)])
    _table(cols, rows)
    print()
    cols = ["B", "config", "samples/s (each repeat)", "set-up s", "RSS before MiB", "peak RSS MiB",
            "increase MiB", "final-step loss"]
    rows = []
    for s in summaries:
        for m in MODES:
            c = s["configs"][m]
            loss = c["final_loss"]
            loss_txt = ("/".join(f"{v:.3f}" for v in loss) if len(loss) <= 4 else
                        f"min {min(loss):.3f} med {statistics.median(loss):.3f} max {max(loss):.3f}")
            rows.append([str(s["B"]), MODE_TITLES[m], ", ".join(_fmt(v) for v in c["samples_per_s"]),
                         f"{c['setup_s_median']:.1f}", _fmt(c["rss_before_mib_median"]),
                         _fmt(c["peak_rss_mib_median"]), _fmt(c["rss_increase_mib_median"]), loss_txt])
    _table(cols, rows)


def _table(cols: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(c), *(len(r[k]) for r in rows)) for k, c in enumerate(cols)]
    line = lambda cells: " | ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    print(line(cols))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def run_benchmark(B_values: Sequence[int] | None = None, steps: int = 50, warmup: int = 5, batch_size: int = 32,
                  repeats: int = 5, out: str | os.PathLike | None = None) -> dict:
    """Measure fused vs. sequential training throughput and peak memory for each B; print a table, write
    ``out`` (JSON) if given and return every number."""
    import onnxruntime
    import torch

    from onnxfuse.exporters import export_array, zoo

    Bs = _check(B_values, steps, warmup, batch_size, repeats)
    args = _command(Bs, steps, warmup, batch_size, repeats)
    env = {"onnxruntime": onnxruntime.__version__, "torch": torch.__version__, "python": platform.python_version(),
           "cpu_count": os.cpu_count(), "platform": platform.platform(), "ort_threads": "default (all cores)"}
    print(f"onnxfuse benchmark: LeNet (1x28x28, 10 classes) on sklearn digits, batch {batch_size}, AdamW "
          f"lr geomspace(1e-4, 1e-2, B); {warmup} warm-up + {steps} timed steps per model; {repeats} rounds of "
          f"fused / seq onnxfuse / seq ORT, medians reported")
    print(f"onnxruntime {env['onnxruntime']}, torch {env['torch']}, python {env['python']}, "
          f"os.cpu_count() = {env['cpu_count']}, ORT threads: default\n", flush=True)
    clock = Stopwatch()
    runs: list[_Run] = []
    with tempfile.TemporaryDirectory(prefix="onnxfuse-bench-") as tmp:
        # Export once, seeds 0..max(B)-1; the array of size B uses the first B (seeds 0..B-1).
        with Stopwatch() as export:
            jobs = os.path.join(tmp, "jobs")
            export_array(zoo.LeNet, jobs, max(Bs), [batch_size, 1, IMAGE, IMAGE])
        export_s = export.seconds
        print(f"exported {max(Bs)} LeNets in {export_s:.1f}s", flush=True)
        for B in Bs:
            for r in range(repeats):
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):  # no configuration always runs first
                    run = _spawn(mode, B, jobs, steps, warmup, batch_size)
                    runs.append(run)
                    res = run.result
                    print(f"  B={B:<3} round {r + 1}/{repeats}  {MODE_TITLES[mode]:<13} "
                          f"{res['samples_per_s']:>8,.0f} samples/s  (set-up {res['setup_s']:.1f}s, "
                          f"peak RSS {res['peak_rss_mib']:,.0f} MiB, worker {run.wall_s:.1f}s)", flush=True)
    summaries = [_summarise(runs, B) for B in Bs]
    total_s = clock.seconds
    print()
    _print_table(summaries)
    print(f"\nratios are medians of the per-round ratios fused / sequential samples/s (> 1: the fused array is "
          "faster); set-up (fusing, "
          f"artifacts, sessions) is not timed; export of the LeNets took {export_s:.1f}s once")
    for s in summaries:
        print(f"B={s['B']}: per-round fused/seq-ORT " + ", ".join(f"{v:.2f}x" for v in s["fused_over_seq_ort_per_round"])
              + "; fused/seq-onnxfuse " + ", ".join(f"{v:.2f}x" for v in s["fused_over_seq_onnxfuse_per_round"]))
    for s in summaries:
        d = s["final_loss_max_abs_diff"]
        print(f"B={s['B']}: final-step losses vs. fused differ by at most {d['seq-onnxfuse']:.1e} (seq onnxfuse), "
              f"{d['seq-ort']:.1e} (seq ORT) (same weights, lr and batches: seq onnxfuse differs by rounding only, "
              "seq ORT also by ORT's transformers-style AdamW)")
    print(f"total {total_s:.0f}s. reproduce with:\n  python benchmarks/fused_vs_sequential.py {args}\n"
          f"  (the measurement: benchmarks/_ort_sequential.py, run_benchmark)")
    result = {
        "benchmark": "fused_vs_sequential", "model": "LeNet", "input_shape": [batch_size, 1, IMAGE, IMAGE],
        "data": "sklearn digits, 8x8 upscaled to 28x28", "optimizer": "adamw",
        "B_values": Bs, "steps": steps, "warmup": warmup, "batch_size": batch_size, "repeats": repeats,
        "command": f"python benchmarks/fused_vs_sequential.py {args}", "env": env, "export_s": export_s,
        "total_s": total_s, "results": summaries,
        "runs": [{"mode": r.mode, "B": r.B, "worker_wall_s": r.wall_s, **r.result} for r in runs],
    }
    if out is not None:
        atomic_write_bytes(out, json.dumps(result, indent=1).encode())  # whole or not at all, naming it on failure
        print(f"wrote {os.fspath(out)}")
    return result


def _worker_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/_ort_sequential.py",
                                description="one benchmark configuration (run_benchmark starts these)")
    p.add_argument("--worker", required=True, choices=MODES)
    p.add_argument("--models", type=int, required=True)
    p.add_argument("--jobs", required=True, help="folder with model_0.onnx .. model_{B-1}.onnx")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    a = p.parse_args(argv)
    _check([a.models], a.steps, a.warmup, a.batch_size, 1)
    res = _worker(a.worker, a.models, a.jobs, a.steps, a.warmup, a.batch_size)
    print(RESULT_MARK + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
