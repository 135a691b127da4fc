"""The ways ``onnxfuse bench`` trains the same B models (its modes), each built as a step function the measurement
times: the fused array on each runtime, and every peer in its best form (the models one after another, a
torch.func ensemble, a hand-fused HFTA-style model, one dense model at batch B * N). What each mode is and why it
is built so: docs/benchmarks.md, "How onnxfuse bench measures"."""
from __future__ import annotations

import copy
import os
import resource
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from onnxfuse.core._clock import Stopwatch
from onnxfuse.recipe.runtimes import RUNTIMES

from onnxfuse.measure.workloads import OnnxFile, file_batch, file_protos, zoo_batch, zoo_modules, zoo_protos

__all__ = ["MODES", "MODE_TITLES", "FILE_TITLES", "BASELINE", "CEILING", "CEILINGS", "COMPILED", "FUSED_MODES",
           "ORT_MODES", "runs_in", "step_memory", "Workload", "zoo_workload", "file_workload", "modes_of_models", "fused_step",
           "seq_ort_step", "seq_torch_step", "adamw_step", "vmap_loss", "hfta_loss", "dense_loss", "summed",
           "peak_mib"]

MODE_TITLES = {"torch": "fused (torch runtime)", "torch-compiled": "fused (torch runtime, compiled)",
               "ort": "fused (ort runtime)", "seq-torch": "PyTorch one after another",
               "seq-torch-compiled": "PyTorch one after another, compiled",
               "seq-ort": "onnxruntime-training one after another", "concurrent": "B processes at once",
               "vmap": "torch.func ensemble", "vmap-compiled": "torch.func ensemble, compiled",
               "hfta": "HFTA-style fused PyTorch (hand-written)", "hfta-compiled": "HFTA-style, compiled",
               "dense": "one model at batch B*N", "dense-compiled": "one model at batch B*N, compiled"}
# an ONNX file has no torch module: these modes run its ONNX graph by onnxfuse's converter instead
FILE_TITLES = {"seq-torch": "the ONNX graph in torch eager (onnxfuse's converter) one after another",
               "seq-torch-compiled": "the ONNX graph in torch (onnxfuse's converter) one after another, compiled",
               "concurrent": "the ONNX graph in torch eager (onnxfuse's converter), B processes at once",
               "dense": "the ONNX graph in torch eager (onnxfuse's converter) at batch B*N",
               "dense-compiled": "the ONNX graph in torch (onnxfuse's converter) at batch B*N, compiled"}
MODES = tuple(MODE_TITLES)
BASELINE, CEILING = "seq-torch", "dense"
COMPILED = "-compiled"  # mode X-compiled is mode X under torch.compile
FUSED_MODES = ("torch", "torch-compiled", "ort")  # the fused array, on its runtimes
CEILINGS = (CEILING, CEILING + COMPILED)
ORT_MODES = ("ort", "seq-ort")  # the ort runtime's: in the precisions it trains in only


def runs_in(mode: str, precision: str) -> bool:
    """Whether ``mode`` trains in ``precision``: every mode but the ort runtime's in all of them."""
    return mode not in ORT_MODES or precision in RUNTIMES["ort"].precisions


# ----------------------------------------------------------------------------------------------- the workloads
@dataclass
class Workload:
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


def zoo_workload(name: str, B: int, n: int, device, folder: str) -> Workload:
    from onnxfuse.exporters.zoo import ZOO

    mods = zoo_modules(name, B)
    with Stopwatch() as export:
        protos = zoo_protos(name, mods, n, folder)
    export_s = export.seconds
    x, y = zoo_batch(name, n, device)
    seq = [m.to(device).train() for m in mods]
    return Workload(name, "zoo", protos, seq, lambda: copy.deepcopy(seq[0]), x, y, "input",
                     ZOO[name].task == "lm", export_s)


def file_workload(f: OnnxFile, B: int, device) -> Workload:
    """Model b's torch module is its ONNX graph in torch eager by onnxfuse's converter (initializers as
    nn.Parameters): there is no other torch version of a file."""
    from onnxfuse.runtime.torch.program import OnnxModule

    protos = file_protos(f, B)
    mods = [OnnxModule(copy.deepcopy(p)).to(device).train() for p in protos]
    x, y = file_batch(f, device)
    return Workload(f.path, "onnx", protos, mods, lambda: OnnxModule(copy.deepcopy(protos[0])).to(device).train(),
                     x, y, f.input_name, True)


def base_mode(mode: str) -> str:
    """The mode ``mode`` compiles (``vmap`` for ``vmap-compiled``), or ``mode`` itself."""
    return mode[:-len(COMPILED)] if mode.endswith(COMPILED) else mode


def left_out(name: str, f: OnnxFile | None) -> dict[str, str]:
    """The modes model ``name`` cannot run, each with why (a compiled mode where its eager one cannot)."""
    from onnxfuse.measure.hfta_models import HFTA_MODELS

    if f is None:
        out = {} if name in HFTA_MODELS else {
            "hfta": f"no hand-fused version of {name} (onnxfuse/measure/hfta_models.py has {', '.join(HFTA_MODELS)})"}
    else:
        out = {m: "an ONNX file has no torch module" for m in ("vmap", "hfta")}
        if f.fixed_batch:
            out[CEILING] = f"its batch is fixed ({f.input_shape[0]})"
    return out | {m: out[base_mode(m)] for m in MODES if m != base_mode(m) and base_mode(m) in out}


def modes_of_models(models: Sequence[str], modes: list[str], files: dict[str, OnnxFile], notes: list[str]
                    ) -> dict[str, list[str]]:
    """The modes each model runs; a note for each mode left out and for what an ONNX file's modes run."""
    runs = {}
    for name in models:
        left = left_out(name, files.get(name))
        runs[name] = [m for m in modes if m not in left]
        reasons: dict[str, list[str]] = {}
        for m in modes:
            if m in left:
                reasons.setdefault(left[m], []).append(m)
        notes.extend(f"{name}: left out {', '.join(ms)}: {why}" for why, ms in reasons.items())
        if name in files:
            eager = [m for m in (BASELINE, BASELINE + COMPILED, "concurrent") + CEILINGS if m in runs[name]]
            notes.append(f"{name}: {', '.join(eager)} run{'s' if len(eager) == 1 else ''} the file's ONNX graph "
                         "in torch by onnxfuse's converter (onnxfuse/runtime/torch/program.py), not a torch module; "
                         "model b > 0 is the file's weights plus 1 % seeded noise"
                         + (f"; measured at its fixed batch {files[name].input_shape[0]}"
                            if files[name].fixed_batch else ""))
    return runs


def _output(module, x):
    """A module's output; onnxfuse's converter returns the graph's outputs as a tuple."""
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def _loss(class_last: bool, out, y):
    import torch.nn.functional as F

    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)) if class_last else F.cross_entropy(out, y)


def _autocast(precision: str, device):
    """The context a peer's forward and loss run in: the fused array's own (torch.autocast; fp32: none)."""
    from onnxfuse.runtime.torch.precision import autocast

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


def summed(losses) -> float | None:
    """A step's losses (the fused runtime's per-model array, a peer's loss tensor or its list) summed, on the host."""
    if losses is None:
        return None
    if isinstance(losses, list):
        return float(sum(float(v) for v in losses))
    return float(np.sum(losses.detach().float().cpu().numpy() if hasattr(losses, "detach") else losses))


# ---------------------------------------------------------------------------------------------------- the modes
def fused_step(protos: list, lrs: list[float], loss_name, runtime: str, device: str, feeds: dict,
                workdir: str, threads: int = 0, strategy: str = "default", batch: int = 32,
                compile: str = "off", precision: str = "fp32") -> Callable[[], object]:
    from onnxfuse.core.passes import fuse_models

    from onnxfuse.measure.forms import make_strategy
    from onnxfuse.recipe.optim import make_optimizer
    from onnxfuse.runtime.trainers import make_trainer, wants_one_model

    labels = [f"model_{b}" for b in range(len(protos))]
    fa = fuse_models(protos, labels=labels,
                     strategy=make_strategy(strategy, runtime, device, batch, threads, compile=compile))
    # model 0 fused alone: the model-by-model form of a compiled step (TrainStep.FORMS) runs it on each model's weights
    one = fuse_models(protos[:1], labels=labels[:1]) if wants_one_model(runtime, device, compile) else None
    trainer = make_trainer(runtime, fa.model, fa.spec, loss_name, make_optimizer("adamw", len(protos), lr=lrs),
                           device=device, workdir=workdir, threads=threads or None, compile=compile,
                           precision=precision, one_model=None if one is None else (one.model, one.spec))
    def step():
        return trainer.step(feeds)
    stepper = getattr(trainer, "stepper", None)  # the torch runtime's: a compiled step times its forms first
    step.settled = (lambda: stepper.settled) if stepper is not None else (lambda: True)
    return step


def seq_ort_step(protos: list, lrs: list[float], loss_name, feeds: dict, workdir: str,
                  threads: int = 0) -> Callable[[], None]:
    """B one-model arrays on the ort runtime, stepped one after another."""
    steps = [fused_step([p], [lr], loss_name, "ort", "cpu", feeds, os.path.join(workdir, f"model_{b}"), threads)
             for b, (p, lr) in enumerate(zip(protos, lrs))]

    def step() -> None:
        for s in steps:
            s()
    return step


def _adamw(params, lr: float, compiled: bool):
    """A peer's AdamW: as written, or in its compiled form's (``fused=True``: one kernel for the update)."""
    import torch

    return torch.optim.AdamW(params, lr=lr, **({"fused": True} if compiled else {}))


def seq_torch_step(mods: list, lrs: list[float], class_last: bool, x, y,
                    precision: str = "fp32", compiled: bool = False) -> Callable[[], list]:
    """The B models one after another, each with its own AdamW and (fp16) its own GradScaler, as B separate
    trainings would have; a step returns the B losses. ``compiled``: in the form :func:`adamw_step` compiles
    (the forward and loss under ``torch.compile``, one function for all B: the models share its code and
    shapes, so it compiles once; ``AdamW(fused=True)``)."""
    import torch

    opts = [_adamw(m.parameters(), lr, compiled) for m, lr in zip(mods, lrs)]
    scalers = [_scaler(precision, x.device) for _ in mods]

    def loss_of(m):
        with _autocast(precision, x.device):
            return _loss(class_last, _output(m, x), y)
    loss_fn = torch.compile(loss_of, dynamic=False) if compiled else loss_of

    def step() -> list:
        losses = []
        for m, o, scaler in zip(mods, opts, scalers):
            o.zero_grad(set_to_none=True)
            loss = loss_fn(m)
            _update(loss, o, scaler)
            losses.append(loss.detach())
        return losses
    return step


def adamw_step(loss_fn: Callable[[], object], params: list, lr: float, compiled: bool, precision: str = "fp32",
                device=None) -> Callable[[], object]:
    """One AdamW step of the scalar ``loss_fn()`` over ``params``: as written, or in the best compiled form measured
    (docs/benchmarks.md): ``torch.compile(loss_fn)`` (forward and loss; AOTAutograd compiles the backward with
    it), static shapes, and ``AdamW(fused=True)``. bf16 / fp16: ``loss_fn`` under autocast (inside what is
    compiled), fp16 through one GradScaler. A step returns the loss."""
    import torch

    opt = _adamw(params, lr, compiled)
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


def vmap_loss(mods: list, class_last: bool, x, y) -> tuple[Callable[[], object], list]:
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


def hfta_loss(name: str, mods: list, class_last: bool, x, y) -> tuple[Callable[[], object], list]:
    """The B models rewritten by hand as one HFTA-style model: the loss summed over the models, its parameters."""
    from onnxfuse.measure.hfta_models import hfta_model

    model = hfta_model(name, mods)

    def loss():
        out = model(x)  # [B, N, ...]
        return sum(_loss(class_last, out[b], y) for b in range(out.shape[0]))
    return loss, list(model.parameters())


def dense_loss(model, class_last: bool, x, y, B: int) -> tuple[Callable[[], object], list]:
    """ONE model at batch B * N: its loss and parameters."""
    xb, yb = x.repeat((B,) + (1,) * (x.dim() - 1)), y.repeat((B,) + (1,) * (y.dim() - 1))

    def loss():
        return _loss(class_last, _output(model, xb), yb)
    return loss, list(model.parameters())


def step_memory(steppers: dict) -> dict:
    """``{key: MiB}``: the memory one more step of each stepper takes above what the process holds before it
    (activations, gradients, temporaries: not the weights and optimizer state it keeps between steps), on Linux
    with glibc; ``{}`` elsewhere. Untimed, after the rounds: the process's peak resident memory (VmHWM) is reset
    through ``/proc/self/clear_refs`` before each step, and meanwhile glibc returns every freed block over 64 KiB
    to the system (the kept heap of a training process would hold them and hide a step's growth); the kept heap
    is made again after."""
    import gc

    from onnxfuse.runtime.process import heap_returned

    out = {}
    with heap_returned() as trim:
        if trim is None or not os.access("/proc/self/clear_refs", os.W_OK):
            return out
        for key, step in steppers.items():
            gc.collect()
            trim()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = _status_mib("VmRSS")
            step()
            out[key] = max(_status_mib("VmHWM") - before, 0.0)
    return out


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"no {field} in /proc/self/status")


def peak_mib(device) -> float:
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
