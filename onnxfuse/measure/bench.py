"""`onnxfuse bench`: the fused array against every way a user could train the same B models, each in its best form.

For each model and B: B models with different weights; one ONNX model per model, fused; then rounds that alternate
the modes (the order reversed every other round), each timing ``steps`` steps after ``warmup`` untimed ones:

    torch           the fused array on the torch runtime: one step trains all B models (per-model AdamW learning
                    rates)
    torch-compiled  the same, its whole step captured by torch.compile (the torch runtime's compile="on")
    ort             the fused array on the ort runtime (onnxruntime-training; CPU only)
    seq-torch       B torch modules, each with its own torch.optim.AdamW, stepped one after another: the baseline
    seq-ort         the same B models one after another in onnxruntime-training: B one-model arrays on the ort
                    runtime
    concurrent      the B models as B OS processes training at once on the same device, each with its own torch
                    module and torch.optim.AdamW (its own learning rate, as seq-torch): B jobs launched without any
                    tool. The processes (multiprocessing's forkserver, else spawn) start once per measurement, build
                    their models (zoo model b after the same seed; an ONNX file's model b by onnxfuse's converter,
                    as seq-torch) and wait; a step or a round signals all to run, timed until all report done. On
                    the CPU each process gets max(1, threads // B) torch threads, threads = this process's torch
                    threads (--threads), as B jobs sharing the machine would split it, and every process is
                    confined to the first `threads` cores this process may use (sched_setaffinity): the B jobs
                    get the cores the other modes get, not the whole machine (16 one-thread processes on 2 cores
                    had twice the compute of every other mode at --threads 1). On CUDA they are not confined
    vmap            the B modules as one torch.func ensemble (stack_module_state + functional_call + vmap), one
                    AdamW over the stacked parameters (one learning rate; BatchNorm without running statistics, which
                    vmap cannot update in place: torch.func.replace_all_batch_norm_modules_)
    hfta            the B modules rewritten by hand as one HFTA-style PyTorch model (onnxfuse/measure/hfta_models.py:
                    grouped Conv2d, batched Linear, packed BatchNorm / LayerNorm / Embedding), one AdamW over its
                    parameters (one learning rate, as vmap); zoo models lenet, resnet18 and transformer_lm only
    dense           ONE model at batch B * N: the FLOPs of the array in one ordinary model, the ceiling fusion can
                    approach
    vmap-compiled, hfta-compiled, dense-compiled
                    vmap, hfta and dense in their best form under torch.compile (inductor, mode "default"): the
                    forward and loss as one compiled function (torch.compile(loss_fn, dynamic=False); AOTAutograd
                    compiles its backward with it) and torch.optim.AdamW(fused=True), one kernel for the update.
                    Measured on a 2-core CPU (B = 16, 1 thread, torch 2.13, interleaved): for the Transformer LM
                    this is 1.3-1.5x the eager step for all three; compiling the optimizer step as well
                    (torch.compile(opt.step)) gained nothing over the fused AdamW, and foreach AdamW was within the
                    noise of it; forward and backward as one compiled graph (torch.func.grad_and_value of the loss
                    over the parameters) was slower (hfta 58 vs 52 ms, dense 59 vs 50 ms). For LeNet every
                    compiled form was slower than eager on that CPU (dense ~1.7-2x, vmap and hfta ~1.0-1.15x; the
                    one-graph form: hfta 76 ms, this one 90, eager 90; dense 71, 77, eager 44): inductor's fused
                    ReLU + max_pool2d_with_indices kernel of the training forward took ~35 ms of the dense step;
                    measured as it is, not worked around (bench.md's ceiling is the better of dense and
                    dense-compiled)

on the same device-resident random batch (N samples per model). Samples/s count all B models: B * N * steps / the
median round time. A mode's ratio to seq-torch (and to dense) is the median of its per-round ratios: the runs of
one round see the same machine. The first step of every mode is timed alone ("first call s": the compile time of
the compiled modes, the lazy build of the others) and is never in the throughput: it is the first warm-up step
(one is run even with --warmup 0). Each measurement starts with dynamo's caches reset (every compiled mode compiles
its own graph for that model and B, static shapes); inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR, else its
default under the temp folder) still serves graphs compiled by an earlier run, so a second run's compile is the
cached time. Peak memory is torch's allocator peak on CUDA (per mode and precision, reset before each mode's turn
in a round, and over the row), else the process's peak RSS (one figure for the row in bench.json and bench.csv: it
only grows; the table's per-mode column is "–" on the CPU); concurrent's is the sum of its processes' peaks
(allocator on CUDA, RSS on the CPU, where pages the processes share count in each). Where a mode cannot run (ort
and seq-ort off the CPU or without onnxruntime.training, hfta for a model without a hand-fused version) it is left
out with a note.
bench.md says per model, B and precision which mode won (highest samples/s) and the fused array's best mode (torch,
torch-compiled or ort) as a fraction of the better of dense and dense-compiled.

The default modes are all of them: a comparison whose peers are not in their best form would flatter the fused
array. The compiled modes add their compile time to the run (not to their throughput), tens of seconds per
compiled mode, model and B on a CPU when inductor's cache is cold; pass --modes to measure fewer.

A model is a zoo name or an ONNX file. Zoo model b is the zoo module built after ``torch.manual_seed(b)``; one
export whose initializers are replaced by each module's state_dict (the exporter keeps state_dict names) gives
the B ONNX models. An ONNX file (one data input, float or int64 token ids that index an embedding initializer;
one output) gives model 0 its own weights and model b > 0 a copy with seeded Gaussian noise of 1 % of each
weight's standard deviation; its input is random at --batch (or at the file's fixed batch), its labels random
classes over the output's last axis (cross-entropy over the last axis, as for the zoo's LM). With no torch module
to run, seq-torch, concurrent and dense (compiled too) run the file's ONNX graph in torch by onnxfuse's own
converter (onnxfuse/runtime/torch_graph.py, initializers as nn.Parameters, torch.optim.AdamW); vmap and hfta
(compiled too) are left out, and dense too when the file's batch is fixed.

Every mode runs in each precision of ``precisions`` (``--precision fp32,bf16,fp16``): fp32 as above; bf16 and fp16
with float32 weights, optimizer state and update and the forward and loss under ``torch.autocast(device, dtype)``
(onnxfuse/runtime/precision.py's ``autocast``, for the fused array and every peer alike). The fused array is the
torch runtime's ``precision=``; for fp16 each peer scales its loss as a user of it would: seq-torch and concurrent
with a ``torch.amp.GradScaler`` per model (B separate trainings), vmap, hfta and dense with one GradScaler for the
one optimizer (HFTA's own scripts scale the fused model's summed loss once); the fused array keeps a scale per model
(GradScaler's semantics, onnxfuse/runtime/precision.py). The compiled peers compile the forward and loss with the
autocast inside. ort and seq-ort train in fp32 only (the ort runtime): left out at bf16 / fp16 with a note. Every
(mode, precision) is built before any runs and measured in the same interleaved rounds; a precision's rows are
one row per model and B, whose ratios are to seq-torch and dense in that precision. Each precision gets its own
copy of the B torch modules (a mode never steps another one's weights), and each mode's first step records the
summed loss of the B models before any update ("first loss": equal across the modes in fp32 up to rounding, off
by the precision's rounding under autocast).

``run_bench(..., out=DIR)`` writes DIR/bench.json, bench.csv (one row per model and B), bench.md (the table and
the command that reproduces it) and bench.png (each mode's speed as its ratio to seq-torch, the median and the
spread of the rounds, one panel per model and precision; ``plot_file`` draws it again from a bench.json).
"""
from __future__ import annotations

import contextlib
import copy
import csv
import json
import multiprocessing
import multiprocessing.connection
import os
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from onnxfuse.core._clock import Stopwatch
from onnxfuse.core._io import atomic_files, claim_output
from onnxfuse.core.errors import ConfigError, OnnxFuseError, shell
from onnxfuse.recipe.device import Device
from onnxfuse.recipe.runtimes import PRECISIONS, RUNTIMES, check_precision
from onnxfuse.runtime._machine import cpu_description

from onnxfuse.measure.workloads import (OnnxFile, file_batch, file_protos, interleaved_rounds, is_onnx_file,
                                        load_onnx_file, zoo_batch, zoo_module, zoo_modules, zoo_protos)

__all__ = ["run_bench", "plot_file", "bench_figure", "MODES", "MODE_TITLES", "FILE_TITLES", "ConcurrentWorkerError"]

MODE_TITLES = {"torch": "fused (torch runtime)", "torch-compiled": "fused (torch runtime, compiled)",
               "ort": "fused (ort runtime)", "seq-torch": "PyTorch one after another",
               "seq-ort": "onnxruntime-training one after another", "concurrent": "B processes at once",
               "vmap": "torch.func ensemble", "vmap-compiled": "torch.func ensemble, compiled",
               "hfta": "HFTA-style fused PyTorch (hand-written)", "hfta-compiled": "HFTA-style, compiled",
               "dense": "one model at batch B*N", "dense-compiled": "one model at batch B*N, compiled"}
# an ONNX file has no torch module: these modes run its ONNX graph by onnxfuse's converter instead
FILE_TITLES = {"seq-torch": "the ONNX graph in torch eager (onnxfuse's converter) one after another",
               "concurrent": "the ONNX graph in torch eager (onnxfuse's converter), B processes at once",
               "dense": "the ONNX graph in torch eager (onnxfuse's converter) at batch B*N",
               "dense-compiled": "the ONNX graph in torch (onnxfuse's converter) at batch B*N, compiled"}
MODES = tuple(MODE_TITLES)
BASELINE, CEILING = "seq-torch", "dense"
COMPILED = "-compiled"  # mode X-compiled is mode X under torch.compile
FUSED_MODES = ("torch", "torch-compiled", "ort")  # the fused array, on its runtimes
CEILINGS = (CEILING, CEILING + COMPILED)
_ORT_MODES = ("ort", "seq-ort")  # the ort runtime's: in the precisions it trains in only


def _runs_in(mode: str, precision: str) -> bool:
    """Whether ``mode`` trains in ``precision``: every mode but the ort runtime's in all of them."""
    return mode not in _ORT_MODES or precision in RUNTIMES["ort"].precisions


class ConcurrentWorkerError(OnnxFuseError):
    """A process of the concurrent mode failed or exited before it finished its steps."""


# ----------------------------------------------------------------------------------------------- the workloads
@dataclass
class _Workload:
    """One model at one B: the B ONNX models the fused array and the ort modes train, the B torch models seq-torch
    trains (on the device), the batch every model sees and the axis the loss reads its classes from."""

    name: str
    source: str  # "zoo" or "onnx" (a file)
    protos: list
    modules: list
    fresh: Callable[[], object]  # a new copy of model 0 on the device (for dense)
    x: object
    y: object
    input_name: str
    class_last: bool  # cross-entropy over the last axis ([N, .., classes]: an LM, an ONNX file), else axis 1
    export_s: float = 0.0

    @property
    def batch(self) -> int:
        return int(self.x.shape[0])


def _zoo_workload(name: str, B: int, n: int, device, folder: str) -> _Workload:
    from onnxfuse.exporters.zoo import ZOO

    mods = zoo_modules(name, B)
    with Stopwatch() as export:
        protos = zoo_protos(name, mods, n, folder)
    export_s = export.seconds
    x, y = zoo_batch(name, n, device)
    seq = [m.to(device).train() for m in mods]
    return _Workload(name, "zoo", protos, seq, lambda: copy.deepcopy(seq[0]), x, y, "input",
                     ZOO[name].task == "lm", export_s)


def _file_workload(f: OnnxFile, B: int, device) -> _Workload:
    """Model b's torch module is its ONNX graph in torch eager by onnxfuse's converter (initializers as
    nn.Parameters): there is no other torch version of a file."""
    from onnxfuse.runtime.torch_graph import OnnxModule

    protos = file_protos(f, B)
    mods = [OnnxModule(copy.deepcopy(p)).to(device).train() for p in protos]
    x, y = file_batch(f, device)
    return _Workload(f.path, "onnx", protos, mods, lambda: OnnxModule(copy.deepcopy(protos[0])).to(device).train(),
                     x, y, f.input_name, True)


def _base(mode: str) -> str:
    """The mode ``mode`` compiles (``vmap`` for ``vmap-compiled``), or ``mode`` itself."""
    return mode[:-len(COMPILED)] if mode.endswith(COMPILED) else mode


def _left_out(name: str, f: OnnxFile | None) -> dict[str, str]:
    """The modes model ``name`` cannot run, each with why (a compiled mode where its eager one cannot)."""
    from onnxfuse.measure.hfta_models import HFTA_MODELS

    if f is None:
        out = {} if name in HFTA_MODELS else {
            "hfta": f"no hand-fused version of {name} (onnxfuse/measure/hfta_models.py has {', '.join(HFTA_MODELS)})"}
    else:
        out = {m: "an ONNX file has no torch module" for m in ("vmap", "hfta")}
        if f.fixed_batch:
            out[CEILING] = f"its batch is fixed ({f.input_shape[0]})"
    return out | {m: out[_base(m)] for m in MODES if m != _base(m) and _base(m) in out}


def _plan(models: Sequence[str], modes: list[str], files: dict[str, OnnxFile], notes: list[str]
          ) -> dict[str, list[str]]:
    """The modes each model runs; a note for each mode left out and for what an ONNX file's modes run."""
    plan = {}
    for name in models:
        left = _left_out(name, files.get(name))
        plan[name] = [m for m in modes if m not in left]
        reasons: dict[str, list[str]] = {}
        for m in modes:
            if m in left:
                reasons.setdefault(left[m], []).append(m)
        notes.extend(f"{name}: left out {', '.join(ms)}: {why}" for why, ms in reasons.items())
        if name in files:
            eager = [m for m in (BASELINE, "concurrent") + CEILINGS if m in plan[name]]
            notes.append(f"{name}: {', '.join(eager)} run{'s' if len(eager) == 1 else ''} the file's ONNX graph "
                         "in torch by onnxfuse's converter (onnxfuse/runtime/torch_graph.py), not a torch module; "
                         "model b > 0 is the file's weights plus 1 % seeded noise"
                         + (f"; measured at its fixed batch {files[name].input_shape[0]}"
                            if files[name].fixed_batch else ""))
    return plan


def _output(module, x):
    """A module's output; onnxfuse's converter returns the graph's outputs as a tuple."""
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def _loss(class_last: bool, out, y):
    import torch.nn.functional as F

    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)) if class_last else F.cross_entropy(out, y)


def _autocast(precision: str, device):
    """The context a peer's forward and loss run in: the fused array's own (torch.autocast; fp32: none)."""
    from onnxfuse.runtime.precision import autocast

    return autocast(precision, device)


def _scaler(precision: str, device):
    """fp16: a torch.amp.GradScaler with its defaults (the fused array's per-model scales start the same); else
    None."""
    import torch

    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def _update(loss, opt, scaler) -> None:
    """Backward and the optimizer's step, through ``scaler`` where there is one (fp16): the loss times the scale,
    the gradients unscaled in ``scaler.step`` (skipped on overflow), the scale updated."""
    if scaler is None:
        loss.backward()
        opt.step()
        return
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def _summed(losses) -> float | None:
    """A step's losses (the fused runtime's per-model array, a peer's loss tensor or its list) summed, on the host."""
    if losses is None:
        return None
    if isinstance(losses, list):
        return float(sum(float(v) for v in losses))
    return float(np.sum(losses.detach().float().cpu().numpy() if hasattr(losses, "detach") else losses))


# ---------------------------------------------------------------------------------------------------- the modes
def _fused_step(protos: list, lrs: list[float], loss_name, runtime: str, device: str, feeds: dict,
                workdir: str, threads: int = 0, strategy: str = "default", batch: int = 32,
                compile: str = "off", precision: str = "fp32") -> Callable[[], object]:
    from onnxfuse.core.passes import fuse_models

    from onnxfuse.measure.forms import make_strategy
    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.runtime.trainers import make_trainer

    fa = fuse_models(protos, labels=[f"model_{b}" for b in range(len(protos))],
                     strategy=make_strategy(strategy, runtime, device, batch, threads, compile=compile))
    trainer = make_trainer(runtime, fa.model, fa.spec, loss_name, make_optimizer("adamw", len(protos), lr=lrs),
                           device=device, workdir=workdir, threads=threads or None, compile=compile,
                           precision=precision)
    return lambda: trainer.step(feeds)


def _seq_ort_step(protos: list, lrs: list[float], loss_name, feeds: dict, workdir: str,
                  threads: int = 0) -> Callable[[], None]:
    """B one-model arrays on the ort runtime, stepped one after another."""
    steps = [_fused_step([p], [lr], loss_name, "ort", "cpu", feeds, os.path.join(workdir, f"model_{b}"), threads)
             for b, (p, lr) in enumerate(zip(protos, lrs))]

    def step() -> None:
        for s in steps:
            s()
    return step


def _seq_torch_step(mods: list, lrs: list[float], class_last: bool, x, y,
                    precision: str = "fp32") -> Callable[[], list]:
    """The B models one after another, each with its own AdamW and (fp16) its own GradScaler, as B separate
    trainings would have; a step returns the B losses."""
    import torch

    opts = [torch.optim.AdamW(m.parameters(), lr=lr) for m, lr in zip(mods, lrs)]
    scalers = [_scaler(precision, x.device) for _ in mods]

    def step() -> list:
        losses = []
        for m, o, scaler in zip(mods, opts, scalers):
            o.zero_grad(set_to_none=True)
            with _autocast(precision, x.device):
                loss = _loss(class_last, _output(m, x), y)
            _update(loss, o, scaler)
            losses.append(loss.detach())
        return losses
    return step


def _adamw_step(loss_fn: Callable[[], object], params: list, lr: float, compiled: bool, precision: str = "fp32",
                device=None) -> Callable[[], object]:
    """One AdamW step of the scalar ``loss_fn()`` over ``params``: as written, or in the best compiled form measured
    (the module docstring): ``torch.compile(loss_fn)`` (forward and loss; AOTAutograd compiles the backward with
    it), static shapes, and ``AdamW(fused=True)``. bf16 / fp16: ``loss_fn`` under autocast (inside what is
    compiled), fp16 through one GradScaler. A step returns the loss."""
    import torch

    opt = torch.optim.AdamW(params, lr=lr, **({"fused": True} if compiled else {}))
    scaler = _scaler(precision, device)

    def amp_loss():
        with _autocast(precision, device):
            return loss_fn()

    forward = loss_fn if precision == "fp32" else amp_loss
    loss = torch.compile(forward, dynamic=False) if compiled else forward

    def step():
        opt.zero_grad(set_to_none=True)
        value = loss()
        _update(value, opt, scaler)
        return value.detach()
    return step


def _vmap_loss(mods: list, class_last: bool, x, y) -> tuple[Callable[[], object], list]:
    """The B models as a torch.func ensemble: the loss summed over the models, and the stacked parameters."""
    import torch
    from torch.func import functional_call, replace_all_batch_norm_modules_, stack_module_state

    base = copy.deepcopy(mods[0])
    replace_all_batch_norm_modules_(base)
    params, buffers = stack_module_state([replace_all_batch_norm_modules_(copy.deepcopy(m)) for m in mods])
    params = {k: torch.nn.Parameter(v) for k, v in params.items()}

    def one(p, b, xx):
        return functional_call(base, (p, b), (xx,))

    ensemble = torch.vmap(one, in_dims=(0, 0, None), randomness="different")

    def loss():
        out = ensemble(params, buffers, x)  # [B, N, ...]
        return sum(_loss(class_last, out[b], y) for b in range(out.shape[0]))
    return loss, list(params.values())


def _hfta_loss(name: str, mods: list, class_last: bool, x, y) -> tuple[Callable[[], object], list]:
    """The B models rewritten by hand as one HFTA-style model: the loss summed over the models, its parameters."""
    from onnxfuse.measure.hfta_models import hfta_model

    model = hfta_model(name, mods)

    def loss():
        out = model(x)  # [B, N, ...]
        return sum(_loss(class_last, out[b], y) for b in range(out.shape[0]))
    return loss, list(model.parameters())


def _dense_loss(model, class_last: bool, x, y, B: int) -> tuple[Callable[[], object], list]:
    """ONE model at batch B * N: its loss and parameters."""
    xb, yb = x.repeat((B,) + (1,) * (x.dim() - 1)), y.repeat((B,) + (1,) * (y.dim() - 1))

    def loss():
        return _loss(class_last, _output(model, xb), yb)
    return loss, list(model.parameters())


def _worker_module(source: tuple):
    """Concurrent model b's torch module: ("zoo", name, b) or ("onnx", the model's serialized ONNX)."""
    if source[0] == "zoo":
        return zoo_module(source[1], source[2])
    import onnx

    from onnxfuse.runtime.torch_graph import OnnxModule

    return OnnxModule(onnx.load_from_string(source[1]))


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _concurrent_worker(conn, source: tuple, x: np.ndarray, y: np.ndarray, lr: float, class_last: bool,
                       device: str, threads: int, cores: list[int], precision: str = "fp32") -> None:
    """One process of the concurrent mode: builds its model and AdamW (seq-torch's step for one model, in
    ``precision``), says
    ("ready", None), then for each count received runs that many steps and says ("done", its peak MiB), until
    "stop" (or the pipe closes: the parent is gone). A failure is sent as ("error" or "oom", one line)."""
    import torch

    try:
        dev = torch.device(device)
        if dev.type == "cpu":
            if cores and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
            from onnxfuse.runtime.train_step import keep_heap

            keep_heap()  # the allocator setting the fused step's process has (every mode gets it)
        step = _seq_torch_step([_worker_module(source).to(dev).train()], [lr], class_last,
                               torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev), precision)
        conn.send(("ready", None))
        while (steps := conn.recv()) != "stop":
            for _ in range(steps):
                step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            conn.send(("done", _peak_mib(dev)))
    except (EOFError, KeyboardInterrupt):
        pass  # the parent is gone, or the user stopped the run (the parent stops the others)
    except torch.OutOfMemoryError as e:
        conn.send(("oom", _first_line(e)))
    except Exception as e:  # noqa: BLE001 (sent to the parent, which raises it as one line)
        conn.send(("error", _first_line(e)))


def _cores(n: int) -> list[int]:
    """The first ``n`` cores this process may run on (all of them where that cannot be asked)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))[:n]


class _Concurrent:
    """The concurrent mode's B processes, started and waiting; ``pool(steps)`` runs ``steps`` steps in every
    process at once and returns when all are done; ``close()`` (or leaving ``with``) stops them, killing one that
    does not stop. A process that fails or exits is one ConcurrentWorkerError (torch.OutOfMemoryError for out of
    memory, which the bench notes), and every process is stopped."""

    def __init__(self, sources: list[tuple], x, y, lrs: list[float], class_last: bool, device, threads: int,
                 cores: list[int] | None = None, precision: str = "fp32"):
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if ctx.get_start_method() == "forkserver":
            ctx.set_forkserver_preload(["torch", "onnxfuse.measure.bench"])  # imported once, then forked
        self.procs, self.conns, self.peaks, self.threads = [], [], [0.0] * len(sources), threads
        try:
            x, y = x.cpu().numpy(), y.cpu().numpy()
            for b, (source, lr) in enumerate(zip(sources, lrs)):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=_concurrent_worker, name=f"onnxfuse-bench-concurrent-{b}", daemon=True,
                                args=(theirs, source, x, y, lr, class_last, str(device), threads, cores or [],
                                      precision))
                p.start()
                theirs.close()
                self.procs.append(p)
                self.conns.append(mine)
            self._collect("ready", "starting")
        except BaseException:
            self.close()
            raise

    def __call__(self, steps: int = 1) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError):  # a process that is gone: _collect says which
                c.send(steps)
        self.peaks = self._collect("done", f"running {steps} step{'s' if steps != 1 else ''}")

    def peak_mib(self) -> float:
        return sum(self.peaks)

    def _collect(self, kind: str, doing: str) -> list:
        """Each process's reply ``kind``, waiting on the pipes and the processes together (one that dies is seen
        at once); a failure stops every process and raises."""
        replies, pending = {}, set(range(len(self.procs)))
        while pending:
            multiprocessing.connection.wait([self.conns[b] for b in pending]
                                            + [self.procs[b].sentinel for b in pending])
            for b in sorted(pending):
                if self.conns[b].poll():
                    try:
                        got, value = self.conns[b].recv()
                    except (EOFError, OSError):  # closed, or reset by a process that was killed
                        got, value = "exit", None
                elif not self.procs[b].is_alive():
                    got, value = "exit", None
                else:
                    continue
                if got == kind:
                    replies[b] = value
                    pending.discard(b)
                    continue
                proc = self.procs[b]
                self.close()  # joins proc too
                if got == "oom":
                    import torch

                    raise torch.OutOfMemoryError(f"concurrent: model {b}'s process: {value}")
                if got == "error":
                    raise ConcurrentWorkerError(f"concurrent mode: model {b}'s process failed while {doing}: {value}; "
                                                "leave 'concurrent' out of modes=, or run modes=['seq-torch'] to see "
                                                "the same model fail in this process")
                raise ConcurrentWorkerError(f"concurrent mode: model {b}'s process exited (exit code "
                                            f"{proc.exitcode}) while {doing}; a negative code is the "
                                            "signal that killed it (-9: often out of memory): measure a smaller B "
                                            "or leave 'concurrent' out of modes=")
        return [replies[b] for b in range(len(self.procs))]

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError, ValueError):
                c.send("stop")
        deadline = time.monotonic() + 10  # for all: a process mid-steps finishes them first
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []

    def __enter__(self) -> "_Concurrent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------ measurement
def _peak_mib(device) -> float:
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _measure(work: _Workload, steps: int, warmup: int, rounds: int, device, modes: list[str], folder: str,
             threads: int = 0, strategy: str = "default", precisions: Sequence[str] = ("fp32",)) -> list[dict]:
    """Every mode in every precision (the ort runtime's in fp32 only), interleaved in the same rounds; one row per
    precision, its ratios to seq-torch and dense in that precision."""
    import torch

    from onnxfuse.recipe.losses import LABELS, get_loss

    B, n, x, y, last = len(work.protos), work.batch, work.x, work.y, work.class_last
    lrs = [float(v) for v in np.geomspace(1e-4, 1e-3, B)] if B > 1 else [1e-3]
    loss_name = get_loss("cross-entropy", class_axis=-1) if last else "cross-entropy"
    feeds = {work.input_name: x, LABELS: y}
    host = {k: v.cpu().numpy() for k, v in feeds.items()}  # the ort runtime takes numpy (CPU)
    sources = ([("zoo", work.name, b) for b in range(B)] if work.source == "zoo"
               else [("onnx", p.SerializeToString()) for p in work.protos])

    def makers(p: str) -> dict[str, Callable[[], Callable]]:
        """Precision ``p``'s modes; its own copy of the B torch modules (the first precision: the workload's)."""
        seq = work.modules if p == precisions[0] else [copy.deepcopy(m) for m in work.modules]
        losses = {"vmap": lambda: _vmap_loss(seq, last, x, y),
                  "hfta": lambda: _hfta_loss(work.name, seq, last, x, y),
                  "dense": lambda: _dense_loss(work.fresh(), last, x, y, B)}
        make = {"torch": lambda: _fused_step(work.protos, lrs, loss_name, "torch", str(device), feeds, folder,
                                             threads, strategy, n, precision=p),
                "torch-compiled": lambda: _fused_step(work.protos, lrs, loss_name, "torch", str(device), feeds,
                                                      folder, threads, strategy, n, compile="on", precision=p),
                "ort": lambda: _fused_step(work.protos, lrs, loss_name, "ort", "cpu", host,
                                           os.path.join(folder, "ort"), threads, strategy, n),
                "seq-torch": lambda: _seq_torch_step(seq, lrs, last, x, y, p),
                "seq-ort": lambda: _seq_ort_step(work.protos, lrs, loss_name, host, os.path.join(folder, "seq-ort"),
                                                 threads),
                # each process gets this process's torch threads split B ways, on as many cores as they are
                "concurrent": lambda: stack.enter_context(_Concurrent(sources, x, y, lrs, last, device,
                                                                      max(1, torch.get_num_threads() // B),
                                                                      _cores(torch.get_num_threads()), p))}
        return make | {m + suffix: (lambda loss=loss, c=bool(suffix): _adamw_step(*loss(), lrs[0], compiled=c,
                                                                                 precision=p, device=device))
                       for m, loss in losses.items() for suffix in ("", COMPILED)}

    keys = [(m, p) for p in precisions for m in modes if _runs_in(m, p)]  # (mode, precision)
    if any(m.endswith(COMPILED) for m in modes):
        torch._dynamo.reset()  # each measurement compiles its own graphs (no recompile limit across models and B)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    cuda = device.type == "cuda"
    peaks: dict[tuple, float] = {k: 0.0 for k in keys}

    def reset_peak(key: tuple) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def read_peak(key: tuple) -> None:
        peaks[key] = max(peaks[key], _peak_mib(device))

    with contextlib.ExitStack() as stack:  # the concurrent mode's processes stop however this ends
        steppers, setup_s, first_s, first_loss = {}, {}, {}, {}
        make = {p: makers(p) for p in precisions}
        # every mode built before any runs, the concurrent processes last: building the torch runtime sets the
        # process's torch threads (to 1 unless --threads), which compiled graphs are specialized on and the
        # concurrent processes split
        for mode, p in sorted(keys, key=lambda k: k[0] == "concurrent"):
            with Stopwatch() as setup:
                steppers[mode, p] = make[p][mode]()
            setup_s[mode, p] = setup.seconds  # fusing, sessions, optimizers, processes: not timed
        threads_now = torch.get_num_threads()
        for key in keys:
            sync()
            with Stopwatch() as first:  # the first step: compiling, lazy builds; the first warm-up step
                losses = steppers[key]()
                sync()
            first_s[key] = first.seconds
            first_loss[key] = _summed(losses)  # the B models' loss before any update (concurrent's: None)
            for _ in range(warmup - 1):
                steppers[key]()
        times = interleaved_rounds({k: steppers[k] for k in keys}, rounds, steps, sync,
                                   reset_peak if cuda else None, read_peak if cuda else None,
                                   runs_steps={k for k in keys if k[0] == "concurrent"})
        for k in keys:
            if k[0] == "concurrent":
                peaks[k] = steppers[k].peak_mib()  # its processes' own
    samples = B * n * steps
    rows = []
    for p in precisions:
        mine = {m: times[m, q] for m, q in keys if q == p}
        result = {}
        for mode in mine:
            result[mode] = {
                "samples_s": samples / statistics.median(mine[mode]),
                "over_seq_torch": statistics.median(b / t for t, b in zip(mine[mode], mine[BASELINE])),
                "of_dense": (statistics.median(d / t for t, d in zip(mine[mode], mine[CEILING]))
                             if CEILING in mine else None),
                "round_s": mine[mode], "setup_s": setup_s[mode, p], "first_call_s": first_s[mode, p],
                "first_loss": first_loss[mode, p],
                "peak_mib": peaks[mode, p] if cuda or mode == "concurrent" else None}
        if "concurrent" in result:
            result["concurrent"]["threads_per_process"] = steppers["concurrent", p].threads if not cuda else None
        rows.append({"model": work.name, "source": work.source, "B": B, "precision": p, "batch": n,
                     "device": str(device), "steps": steps, "warmup": warmup, "rounds": rounds, "threads": threads_now,
                     "export_s": work.export_s,
                     "peak_mib": max(v for (m, q), v in peaks.items() if q == p) if cuda else _peak_mib(device),
                     "modes": result, **_verdict(result, mine)})
    return rows


def _verdict(result: dict, times: dict) -> dict:
    """The row's winner (highest samples/s) and the fused array's best mode as a fraction of the better of dense and
    dense-compiled (the median of per-round ratios), when both are measured."""
    def best(among):
        return max((m for m in among if m in result), key=lambda m: result[m]["samples_s"], default=None)

    fused, ceiling = best(FUSED_MODES), best(CEILINGS)
    of = (statistics.median(c / t for t, c in zip(times[fused], times[ceiling]))
          if fused is not None and ceiling is not None else None)
    return {"winner": best(result), "fused_best": fused, "ceiling_best": ceiling, "fused_of_ceiling": of}


def _ort_unavailable(device) -> str | None:
    if device.type != "cpu":
        return f"the ort modes run on the CPU only (device {device})"
    try:
        import onnxruntime.training  # noqa: F401
    except ImportError as e:
        return f"onnxruntime.training does not import ({e}); pip install '.[cpu]' for the ort modes"
    return None


def _check(models: Sequence[str], Bs: Sequence[int], modes: Sequence[str], batch: int, steps: int, rounds: int,
           warmup: int, precisions: Sequence[str] = ("fp32",)) -> None:
    from onnxfuse.exporters.zoo import ZOO

    for name in models:
        if name not in ZOO and not is_onnx_file(name):
            raise ConfigError(f"models: unknown zoo model '{name}'; choose from: {', '.join(ZOO)}, or give the path "
                              "of an .onnx file")
    for mode in modes:
        if mode not in MODES:
            raise ConfigError(f"modes: unknown mode '{mode}'; choose from: {', '.join(MODES)}")
    if not precisions:
        raise ConfigError(f"precisions: give one or more of {', '.join(PRECISIONS)}, comma-separated (e.g. fp32,bf16)")
    for precision in precisions:
        check_precision(precision, where="precisions:")
    if not Bs or any(isinstance(B, bool) or not isinstance(B, (int, np.integer)) or B < 1 for B in Bs):
        raise ConfigError(f"B: array sizes must be integers >= 1, e.g. [1, 8, 16]; got {list(Bs)}")
    for name, v, least in (("batch", batch, 1), ("steps", steps, 1), ("rounds", rounds, 1),
                           ("warmup", warmup, 0)):
        if v < least:
            raise ConfigError(f"{name}: must be at least {least}, got {v}")


def command(models: Sequence[str], B: Sequence[int], device: str, modes: Sequence[str], batch: int, steps: int,
            rounds: int, warmup: int, out: str, budget_s: float = 0, threads: int = 0,
            strategy: str = "default", precisions: Sequence[str] = ("fp32",)) -> str:
    """The `onnxfuse bench` command line that reproduces a run."""
    words = ["onnxfuse", "bench", "--models", ",".join(models), "--B", ",".join(map(str, B)), "--device", device,
             "--modes", ",".join(modes), "--batch", str(batch), "--steps", str(steps), "--rounds", str(rounds),
             "--warmup", str(warmup)]
    words += ["--budget-s", f"{budget_s:g}"] if budget_s else []
    words += ["--threads", str(threads)] if threads else []
    words += ["--strategy", strategy] if strategy != "default" else []
    words += ["--precision", ",".join(precisions)] if list(precisions) != ["fp32"] else []
    return shell(*words, "-o", out)


# ---------------------------------------------------------------------------------------------------- outputs
def mode_title(row: dict, mode: str) -> str:
    """What ``mode`` measured for this row: an ONNX file's seq-torch and dense run its graph by onnxfuse's converter."""
    return FILE_TITLES.get(mode, MODE_TITLES[mode]) if row.get("source") == "onnx" else MODE_TITLES[mode]


def table(rows: list[dict], modes: list[str]) -> str:
    """One line per model, B, precision and mode measured: samples/s, the ratio to PyTorch one after another and to
    the dense ceiling (both in the row's precision), the first step alone (compiling, for a compiled mode), peak
    memory (the allocator's per mode and precision on CUDA, and concurrent's processes'; "–" on the CPU, where the
    process's RSS is one figure for the whole run)."""
    lines = ["| model | B | precision | mode | samples/s | ÷ PyTorch one after another | ÷ dense (ceiling) "
             "| first call s | peak MiB |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        for m in (m for m in modes if m in r["modes"]):
            c = r["modes"][m]
            dense = "–" if c["of_dense"] is None else f"{c['of_dense']:.2f}"
            peak = "–" if c["peak_mib"] is None else f"{c['peak_mib']:,.0f}"
            lines.append(f"| {r['model']} | {r['B']} | {r['precision']} | {mode_title(r, m)} | {c['samples_s']:,.0f} "
                         f"| {c['over_seq_torch']:.2f}× | {dense} | {c['first_call_s']:.1f} | {peak} |")
    return "\n".join(lines)


def _fused_of_ceiling(r: dict) -> str:
    of = r.get("fused_of_ceiling")
    return "–" if of is None else f"{of:.2f} ({r['fused_best']} ÷ {r['ceiling_best']})"


def wide_table(rows: list[dict], modes: list[str]) -> str:
    """One line per model, B and precision, one column per mode: samples/s and, in brackets, the ratio to PyTorch
    one after another in that precision; then the mode that won (highest samples/s) and the fused array's best mode
    as a fraction of the better of dense and dense-compiled. A mode no row has is left out."""
    modes = [m for m in modes if any(m in r["modes"] for r in rows)]
    head = [MODE_TITLES[m] for m in modes]
    lines = ["| model | B | precision | " + " | ".join(head) + " | won | fused best ÷ best dense |",
             "|---|---:|---|" + "---:|" * len(modes) + "---|---:|"]
    for r in rows:
        cells = [f"{r['modes'][m]['samples_s']:,.0f} ({r['modes'][m]['over_seq_torch']:.2f}×)" if m in r["modes"]
                 else "–" for m in modes]
        lines.append(f"| {r['model']} | {r['B']} | {r['precision']} | " + " | ".join(cells)
                     + f" | {r['winner']} | {_fused_of_ceiling(r)} |")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> str:
    """A line per model, B and precision: which mode won, and how near the fused array's best mode came to the
    ceiling."""
    lines = []
    for r in rows:
        won = r["modes"][r["winner"]]["samples_s"]
        line = f"- {r['model']} B={r['B']} {r['precision']}: {r['winner']} won ({won:,.0f} samples/s)"
        if r.get("fused_of_ceiling") is not None:
            line += (f"; the fused array's best mode, {r['fused_best']}, reached {r['fused_of_ceiling']:.2f} of "
                     f"{r['ceiling_best']}, the better dense")
        lines.append(line)
    return "\n".join(lines)


_PER_MODE = ("samples_s", "over_seq_torch", "of_dense", "first_call_s", "first_loss", "peak_mib")


def _write_csv(path: str, rows: list[dict], modes: list[str]) -> None:
    cols = ["model", "B", "precision", "batch", "device", "steps", "rounds", "peak_mib", "winner", "fused_best",
            "ceiling_best", "fused_of_ceiling"]
    per_mode = [f"{m} {k}" for m in modes for k in _PER_MODE]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols + per_mode)
        for r in rows:
            w.writerow([r[c] for c in cols] + [r["modes"].get(m, {}).get(k) for m in modes for k in _PER_MODE])


def _round_ratios(row: dict, mode: str) -> list[float]:
    """The mode's speed over PyTorch one after another in each round (the baseline's round time over the mode's,
    both in the row's precision): the ratios whose median is ``over_seq_torch``."""
    return [b / t for t, b in zip(row["modes"][mode]["round_s"], row["modes"][BASELINE]["round_s"])]


def _spread(row: dict, mode: str) -> tuple[float, float, float]:
    """(median, slowest, fastest) of the mode's per-round ratios to PyTorch one after another."""
    r = _round_ratios(row, mode)
    return row["modes"][mode]["over_seq_torch"], min(r), max(r)


def _where(env: dict, device_type: str) -> str:
    """The machine a bench.json's figures come from: on the CPU its model, instruction set and cores (env's
    ``cpu``, :func:`onnxfuse.runtime._machine.cpu_description`), on CUDA the GPU and its host's CPU. A bench.json
    written before ``cpu`` was recorded: the device name and the core count it has."""
    if "cpu" not in env:
        cores = f" ({env['cpu_count']} cores)" if env.get("cpu_count") and device_type == "cpu" else ""
        return f"{env.get('device_name') or device_type}{cores}"
    return env["cpu"] if device_type == "cpu" else f"{env.get('device_name', device_type)}, host {env['cpu']}"


def _caption(rows: list[dict], env: dict) -> str:
    """How the figures were measured, in words, and where the command is (bench.md, bench.json)."""
    r = rows[0] if rows else {}
    threads = env.get("threads", "?")
    where = _where(env, r.get("device", "cpu").split(":")[0])
    how = (f"{where}, torch {env.get('torch', '?')}, {threads} thread{'s' if threads != 1 else ''}; batch "
           f"{r.get('batch', '?')} per model, AdamW, {r.get('steps', '?')} steps x {r.get('rounds', '?')} rounds after "
           f"{r.get('warmup', '?')} warm-up, the modes interleaved in each round")
    return (how + ".\nMarker or bar: the median of the per-round ratios; whiskers: the slowest and the fastest "
            "round. The command that reproduces it: bench.md, bench.json.")


def _title(rows: list[dict]) -> str:
    Bs = sorted({r["B"] for r in rows})
    which = f"B = {Bs[0]} models" if len(Bs) == 1 else "B models"
    return f"Training {which} at once: speed relative to PyTorch training them one after another"


def _plot(path: str, rows: list[dict], modes: list[str], env: dict | None = None) -> None:
    """Write :func:`bench_figure` to ``path``."""
    from onnxfuse.core._plot import save

    save(bench_figure(rows, modes, env or {}), path, dpi=120)


def plot_file(json_path: str | os.PathLike, png_path: str | os.PathLike) -> None:
    """Draw bench.png again from a bench.json (``run_bench``'s): the same figure, e.g. after the plot changed."""
    with open(json_path) as f:
        result = json.load(f)
    _plot(os.fspath(png_path), result["rows"], result["modes"], result.get("env"))


def bench_figure(rows: list[dict], modes: list[str], env: dict):
    """The figure of bench.png: one panel per model and precision, each mode's speed as its ratio to PyTorch one
    after another (the baseline, 1x) with the spread of the rounds; the dense ceiling marked. One B: a bar per
    mode; several: a line per mode against B. The legend and how it was measured are below the panels."""
    from onnxfuse.core._plot import figure, legend_below, wrapped

    panels = list(dict.fromkeys(_panel(r) for r in rows)) or [("(no measurement)", "fp32")]
    one_b = len({r["B"] for r in rows}) <= 1
    n_modes = max([len(r["modes"]) for r in rows] or [1])
    if one_b:
        fig = figure(max(7.5, 5.8 * len(panels) + 1.0), 0.36 * n_modes + 1.0)
        handles, labels = _bar_panels(fig, rows, modes, panels)
    else:
        fig = figure(max(7.5, 4.6 * len(panels) + 0.4), 3.6)
        handles, labels = _line_panels(fig, rows, modes, panels)
    fig.suptitle(wrapped(_title(rows), fig.get_figwidth(), 11), fontsize=11)
    legend_below(fig, handles, labels, note=_caption(rows, env) if rows else None)
    return fig


def _bar_panels(fig, rows: list[dict], modes: list[str], panels: list[tuple[str, str]]) -> tuple[list, list]:
    """A bar per mode: the median ratio, whiskers from the slowest to the fastest round, the ratio and samples/s
    written beside it; fused modes dark, the others grey, the baseline and the ceilings hatched; a line at 1x and
    a dotted one at the better dense ceiling. Returns the legend's handles and labels."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    fused_c, other_c = "#1f4e99", "#9aa5b1"
    for ax, panel in zip(axes, panels):
        row = next((r for r in rows if _panel(r) == panel), None)
        if row is None:
            ax.text(0.5, 0.5, "no measurement", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        mine = [m for m in modes if m in row["modes"]][::-1]  # the first mode on top
        spread = [_spread(row, m) for m in mine]
        med = [s[0] for s in spread]
        err = [[s[0] - s[1] for s in spread], [s[2] - s[0] for s in spread]]
        bars = ax.barh([mode_title(row, m) for m in mine], med, xerr=err, color=[
            fused_c if m in FUSED_MODES else other_c for m in mine], error_kw={"elinewidth": 1, "capsize": 2.5,
                                                                              "ecolor": "0.15"})
        top = max(s[2] for s in spread)
        for bar, m, (median, _, fastest) in zip(bars, mine, spread):
            bar.set_gid(m)  # which mode a bar is, for a reader of the figure (the tests)
            if m == BASELINE or m in CEILINGS:
                bar.set_hatch("//")
            ax.text(fastest + top * 0.02, bar.get_y() + bar.get_height() / 2,
                    f"{median:.2f}×  ({row['modes'][m]['samples_s']:,.0f}/s)", va="center", fontsize=7,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6}, zorder=3)
        ax.axvline(1.0, color="0.2", linewidth=0.9)
        if row.get("ceiling_best") in row["modes"]:
            ax.axvline(row["modes"][row["ceiling_best"]]["over_seq_torch"], color="0.2", linewidth=1, linestyle=":")
        ax.set_xlim(0, top * 1.45)  # room for the text beside the longest whisker
        ax.set_title(f"{_panel_title(panel, rows)}, B = {row['B']}", fontsize=10)
        ax.set_xlabel("× PyTorch one after another (samples/s over all B models in brackets)", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(True, axis="x", alpha=0.3)
    handles = [Patch(color=fused_c), Patch(color=other_c), Patch(facecolor=other_c, hatch="//"),
               Line2D([], [], color="0.2", linewidth=0.9), Line2D([], [], color="0.2", linewidth=1, linestyle=":")]
    labels = ["the fused array (onnxfuse)", "the other ways to train the B models",
              "the baseline and the ceiling (one model at batch B*N)", "1× = PyTorch one after another",
              "the ceiling: the better of one model at batch B*N, eager or compiled"]
    return handles, labels


def _line_panels(fig, rows: list[dict], modes: list[str], panels: list[tuple[str, str]]) -> tuple[list, list]:
    """A line per mode against B (log2), each point the median ratio with the rounds' spread as whiskers; the
    fused modes solid and thick, the ceilings dashed. Returns the legend's handles and labels (one per title)."""
    import matplotlib.ticker
    from matplotlib import colormaps

    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    palette = [colormaps["tab10"](k) for k in range(10)] + [colormaps["Dark2"](k) for k in range(8)]
    colour = {m: palette[k % len(palette)] for k, m in enumerate(modes)}
    seen: dict[str, object] = {}
    for ax, panel in zip(axes, panels):
        mine = sorted((r for r in rows if _panel(r) == panel), key=lambda r: r["B"])
        for mode in modes:
            pts = [(r["B"], *_spread(r, mode)) for r in mine if mode in r["modes"]]
            if not pts or mode == BASELINE:
                continue
            Bs, med, lo, hi = zip(*pts)
            nudge = 2 ** (0.025 * (modes.index(mode) - len(modes) / 2))  # side by side: whiskers apart
            h = ax.errorbar([b * nudge for b in Bs], med, yerr=[[m - a for m, a in zip(med, lo)],
                                                                [b - m for m, b in zip(med, hi)]],
                            color=colour[mode], marker="o", markersize=4, capsize=2.5,
                            linewidth=2.2 if mode in FUSED_MODES else 1.2,
                            linestyle="--" if mode in CEILINGS else "-")
            h.lines[0].set_gid(mode)
            seen.setdefault(mode_title(mine[0], mode), h)
        base = ax.axhline(1.0, color="0.2", linewidth=0.9)
        seen.setdefault(f"{mode_title(mine[0], BASELINE) if mine else MODE_TITLES[BASELINE]} (1×)", base)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["B"] for r in mine}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_title(_panel_title(panel, rows), fontsize=10)
        ax.set_xlabel("B (models in the array)")
        ax.set_ylabel("× PyTorch one after another")
        ax.grid(True, alpha=0.3)
    return list(seen.values()), list(seen)


def _panel(row: dict) -> tuple[str, str]:
    """The plot's panel a row is drawn in: one per model and precision."""
    return row["model"], row["precision"]


def _panel_title(panel: tuple[str, str], rows: list[dict]) -> str:
    """The model's file name, and the precision where the run measured more than one."""
    name, precision = panel
    return os.path.basename(name) + (f" ({precision})" if len({r["precision"] for r in rows}) > 1 else "")


# ------------------------------------------------------------------------------------------------------ driver
def run_bench(models: Sequence[str] = ("lenet", "resnet18", "transformer_lm"), B: Sequence[int] = (1, 8, 16),
              device: Device | str = "cpu", modes: Sequence[str] = MODES, batch: int = 32, steps: int = 10,
              rounds: int = 3,
              warmup: int = 3, out: str | os.PathLike = "onnxfuse-bench", budget_s: float = 0, threads: int = 0,
              strategy: str = "default", progress: bool = True, precisions: Sequence[str] = ("fp32",)) -> list[dict]:
    """Measure every mode for every model, B and precision (see the module docstring); write bench.json, bench.csv,
    bench.md and bench.png to ``out``; return one dict per (model, B, precision) with each mode's samples/s and
    ratios (to the modes in the same precision) under ``row["modes"][mode]``; ``precisions``: of
    :data:`~onnxfuse.recipe.runtimes.PRECISIONS`. ``budget_s`` > 0: no new measurement starts after that many
    seconds. ``strategy``: the fusion strategy of the fused modes (``onnxfuse fuse --strategy``; ``auto`` measures
    each node's forms on the mode's own runtime first, outside the timed rounds)."""
    import torch

    models, Bs = list(models), list(B)
    modes, precisions = list(dict.fromkeys(modes)), list(dict.fromkeys(precisions))
    _check(models, Bs, modes, batch, steps, rounds, warmup, precisions)
    where = Device.of(device, "device: ")
    out = os.fspath(out)
    with claim_output(out, "bench", replace=False):  # its folder: no other command writes there meanwhile
        cmd = command(models, Bs, str(where), modes, batch, steps, rounds, warmup, out, budget_s, threads, strategy,
                      precisions)
        say = print if progress else (lambda *a, **k: None)
        why = where.available()
        if why is not None:
            raise ConfigError(why)
        dev = where.torch()
        if threads:
            torch.set_num_threads(threads)
        if dev.type == "cuda":
            torch.backends.cudnn.benchmark = True
        else:
            from onnxfuse.runtime.train_step import keep_heap

            keep_heap()  # what the fused step sets for its process, set before any mode runs: every mode has it
        notes = []
        why = _ort_unavailable(dev) if set(modes) & set(_ORT_MODES) else None
        if why:
            notes.append(f"left out {', '.join(m for m in modes if m in _ORT_MODES)}: {why}")
            modes = [m for m in modes if m not in _ORT_MODES]
        fp32_only = [m for m in modes if any(not _runs_in(m, p) for p in precisions)]
        if fp32_only:
            reduced = [p for p in precisions if not _runs_in(fp32_only[0], p)]
            notes.append(f"{', '.join(fp32_only)} left out at {', '.join(reduced)}: the ort runtime trains in "
                         f"{', '.join(RUNTIMES['ort'].precisions)} only")
        measured = modes if BASELINE in modes else [BASELINE] + modes  # every ratio is to PyTorch one after another
        files = {name: load_onnx_file(name, batch) for name in models if is_onnx_file(name)}  # all checked before measuring
        plan = _plan(models, measured, files, notes)
        env = {"torch": torch.__version__, "threads": torch.get_num_threads(),
               "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "cpu_count": os.cpu_count(),
               "cpu": cpu_description()}  # every figure says which CPU (model, instruction set, cores) it comes from
        say(f"onnxfuse bench on {device} ({_where(env, dev.type)}), torch {env['torch']} ({env['threads']} threads), batch "
            f"{batch} per model, AdamW, {steps} steps x {rounds} rounds after {warmup} warm-up; modes "
            f"{','.join(measured)}; precision {','.join(precisions)}")
        for note in notes:
            say(note)
        rows: list[dict] = []
        clock = Stopwatch()
        with tempfile.TemporaryDirectory(prefix="onnxfuse-bench-") as folder:
            for name in models:
                for b in Bs:
                    if budget_s and clock.seconds > budget_s:
                        say(f"skipped {name} B={b}: over the {budget_s:g} s budget")
                        notes.append(f"skipped {name} B={b}: over the {budget_s:g} s budget")
                        continue
                    try:
                        work = (_file_workload(files[name], b, dev) if name in files
                                else _zoo_workload(name, b, batch, dev, folder))
                        measured_rows = _measure(work, steps, warmup, rounds, dev, plan[name], folder, threads,
                                                 strategy, precisions)
                    except torch.OutOfMemoryError as e:
                        say(f"{name} B={b}: out of memory ({str(e).splitlines()[0][:120]})")
                        notes.append(f"{name} B={b}: out of memory")
                        continue
                    finally:
                        if dev.type == "cuda":
                            torch.cuda.empty_cache()
                            torch.cuda.reset_peak_memory_stats(dev)
                    rows.extend(measured_rows)
                    for r in measured_rows:
                        cells = "  ".join(f"{m} {c['samples_s']:,.0f}/s ({c['over_seq_torch']:.2f}x)"
                                          + (f" [first {c['first_call_s']:.1f} s]" if m.endswith(COMPILED) else "")
                                          for m, c in r["modes"].items())
                        say(f"{name:>14} B={b:<3} {r['precision']}  {cells}  peak {r['peak_mib']:,.0f} MiB  "
                            f"won: {r['winner']}", flush=True)
        ran = sorted({r["threads"] for r in rows})
        if ran:  # building the torch runtime sets the process's threads (1 unless --threads): what the rounds ran
            env["threads"] = ran[0] if len(ran) == 1 else ran
        text = table(rows, measured)
        with atomic_files(out) as stage:  # the four files or none (a full disk leaves no bench.json alone)
            with stage("bench.json") as path, open(path, "w") as f:
                json.dump({"command": cmd, "env": env, "modes": measured, "precisions": precisions, "notes": notes,
                           "rows": rows}, f, indent=1)
            with stage("bench.csv") as path:
                _write_csv(path, rows, measured)
            with stage("bench.md") as path, open(path, "w") as f:
                f.write(f"`{cmd}`\n\n{_where(env, dev.type)}, torch {env['torch']} ({env['threads']} threads); "
                        "samples/s over all B models (median round); ratios are medians of per-round "
                        "ratios, each within one precision.\n\n"
                        + "".join(f"- {n}\n" for n in notes) + ("\n" if notes else "") + wide_table(rows, measured)
                        + "\n\nWhich mode won, per model, B and precision:\n\n" + verdicts(rows)
                        + "\n\nEvery mode, with the ratio to the dense ceiling, its first step alone (the compile "
                        "time of a compiled mode; not in samples/s) and peak memory (CUDA's allocator):\n\n" + text
                        + "\n")
            with stage("bench.png") as path:
                _plot(path, rows, measured, env)
        say(text)
        say(f"wrote bench.json, bench.csv, bench.md, bench.png to {out}/")
        return rows
